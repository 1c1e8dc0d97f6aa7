"""ParamGroup: the parameters of one ``fully_shard`` call, unsharded and resharded together.

Which parameters the modules hold is the group's ``Holding``, a state of its own, separate
from the training phase (``state.py``). Only ``issue_unshard``, ``wait_for_unshard`` and
``reshard`` change it, whoever asks (the schedule, a prefetch, or the user through
``FSDPModule.unshard``):

    SHARDED   --issue_unshard()---------------------> GATHERING   (all-gather issued)
    GATHERING --wait_for_unshard()------------------> UNSHARDED   (copied out, registered)
    UNSHARDED --reshard()---------------------------> SHARDED     (storage freed)
    UNSHARDED --reshard(free=False)-----------------> KEPT        (sharded registered, data kept)
    KEPT      --issue_unshard(), data still fresh---> UNSHARDED   (no all-gather)
    KEPT      --issue_unshard(), data stale---------> GATHERING   (freed, gathered again)
    KEPT      --reshard()---------------------------> SHARDED
    GATHERING --reshard()---------------------------> SHARDED     (waits for the all-gather first)

``reshard_to_post_forward`` (``reshard_after_forward=R``) also keeps this rank's 1/R of each
parameter (the post-forward shards) in SHARDED; the next ``issue_unshard`` gathers from them
among R ranks and lets them go.

A group's parameters usually share one mesh. FSDP2's per-parameter mesh
(``shard_placement_fn`` returning a ``ShardPlacementResult``: MoE experts over an
expert-FSDP mesh, the dense layers over the whole data-parallel mesh) splits them into one
``MeshPart`` per mesh: each part has its own collectives (one all-gather, one reduce-scatter
per step) and buffers, while the group still unshards and reshards as one. The data is stale once an optimizer has stepped (a global step
hook reports it: ``shards_changed``) or a sharded parameter was edited in place (its version
counter moved) since it was gathered.

A group's reductions outlive its post-backward: the root's schedule finishes them later,
oldest first. ``Reducing`` is the one record of the reductions in flight, shared by every
group under the root, and the one path that finishes them.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardkit.comm import collectives, trace
from shardkit.comm.buckets import Bucket, GatherBucket, reduce_buckets
from shardkit.comm.collectives import Comm, PendingAllGather, Reduction, ReduceSettings
from shardkit.comm.streams import streams_for
from shardkit.dtensor.sharded_param import ShardedParam
from shardkit.core import reduction, steps
from shardkit.core.options import GroupOptions


def _outside_inference_mode(method: Callable) -> Callable:
    """``method`` (an unshard step) runs outside ``torch.inference_mode`` when called inside it
    (with grad off): the unsharded buffers and views it makes or fills outlive the forward, and
    made inside it they would be inference tensors, which the first training forward could not
    fill ("Inplace update to inference tensor outside InferenceMode"). FSDP2 fails there."""

    @functools.wraps(method)
    def outside(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode(False), torch.no_grad():
            return method(*args, **kwargs)

    return outside


class Holding(enum.Enum):
    SHARDED = "sharded"  # the modules hold the sharded parameters; no unsharded data
    GATHERING = "gathering"  # an all-gather is issued; the modules still hold the sharded ones
    UNSHARDED = "unsharded"  # the modules hold the unsharded parameters
    KEPT = "kept"  # the modules hold the sharded parameters; the gathered data is kept for reuse


@dataclass
class CommPlan:
    """How a group's collectives run, and what their buffers hold between steps. Made at
    lazy init, once the shards are materialized; made again after ``.to()``."""

    comm: Comm  # the dim the parameters are sharded over
    replicate: Comm | None  # HSDP: the replicate dim
    post_forward: Comm | None  # reshard_after_forward=R: R consecutive ranks of the shard dim
    all_gather: GatherBucket
    reduce_scatter: list[Bucket]  # one per reduce_dtype
    post_forward_bucket: GatherBucket | None
    partial: dict = field(default_factory=dict)  # HSDP sums not yet all-reduced, by partial_key(bucket)
    separate: Comm | None = None  # set_separate_reduce_scatter_group: its own process group, made at first use

    def keep_partial(self, key: tuple, sums: tuple) -> None:
        """HSDP without the all-reduce: keep a reduction's ``(chunk, ranks averaged over)``."""
        self.partial[key] = sums

    def take_partial(self, key: tuple) -> tuple | None:
        """The sums kept for ``key``'s bucket, dropped here: the next reduction adds them."""
        return self.partial.pop(key, None)


def partial_key(bucket: Bucket) -> tuple:
    """Which HSDP partial sums belong to a reduce-scatter bucket: its parameters."""
    return tuple(map(id, bucket.params))


class MeshPart:
    """The parameters of a group that share one mesh, and the plan of their collectives."""

    def __init__(self, params: list[ShardedParam], mesh: DeviceMesh, post_forward_mesh: DeviceMesh | None = None) -> None:
        self.params = params
        # 1-D (FSDP) or 2-D (HSDP: replicate, shard); reshard_after_forward=R: (world / R, R).
        self.mesh, self.post_forward_mesh = mesh, post_forward_mesh
        if post_forward_mesh is not None:
            for p in params:
                p.set_post_forward(post_forward_mesh.size(1), post_forward_mesh.get_local_rank(1))
        self.plan: CommPlan | None = None  # at lazy init

    @property
    def world(self) -> int:
        """The ranks the parameters are sharded over."""
        return self.mesh.size(self.mesh.ndim - 1)

    @property
    def holds_post_forward(self) -> bool:
        return self.params[0].post_forward_shard is not None

    def make_plan(self) -> None:
        streams = streams_for(self.params[0].device)
        mesh, post_mesh = self.mesh, self.post_forward_mesh
        comm = Comm.of(mesh, mesh.ndim - 1, streams)
        replicate = Comm.of(mesh, 0, streams) if mesh.ndim == 2 else None
        post, post_bucket = None, None
        if post_mesh is not None:  # "dp/R" in the trace
            post = Comm.of(post_mesh, 1, streams, f"{comm.mesh_dim}/{post_mesh.size(1)}")
            post_bucket = GatherBucket(self.params, post.world, post_forward=True)
        all_gather = GatherBucket(self.params, self.world)
        self.plan = CommPlan(comm, replicate, post, all_gather, reduce_buckets(self.params, self.world), post_bucket)

    def reduce_comm(self, separate: bool) -> Comm:
        """The shard dim's process group, or (``set_separate_reduce_scatter_group``) a second
        one over the same ranks, so that reduce-scatters need not queue behind all-gathers."""
        plan = self.plan
        if not separate:
            return plan.comm
        if plan.separate is None:
            plan.separate = Comm.of(self.mesh, self.mesh.ndim - 1, plan.comm.streams, separate=True)
        return plan.separate


def still_on_meta(names: list[str]) -> RuntimeError:
    return RuntimeError(
        f"shardkit: parameters {names} are still on the meta device at the first forward or "
        "unshard. Materialize them first: model.to_empty(device=...), then initialize them "
        "(reset_parameters() or your own init)."
    )


class ParamGroup:
    def __init__(self, parts: list[MeshPart], options: GroupOptions) -> None:
        self.parts = parts  # one per mesh, the first for the mesh fully_shard was given
        self.params = [p for part in parts for p in part.params]
        self.options = options  # read here; written only through its own setters (options.py)
        self.name = ""  # the owning modules' FQNs, set at lazy init
        self.holding = Holding.SHARDED
        self.initialized = False  # lazy init made the buffers and the collectives' plans
        self.gathered_version: int | None = None  # the shards' version when gathered; None: stale or none
        self.all_gathers: list[PendingAllGather] = []  # issued, not yet waited for
        self.reducing = Reducing()  # where our reductions in flight are recorded: the root's, from lazy init
        steps.watch(self)  # an optimizer step makes gathered data stale: shards_changed

    def named(self, name: str) -> None:
        """Lazy init: the owning modules' FQNs under the root, for the trace and errors."""
        self.name = name

    def reduce_into(self, reducing: "Reducing") -> None:
        """Lazy init: record our reductions in the root's ``Reducing``, with every other group's."""
        self.reducing = reducing

    def holds_any(self, ids: set[int]) -> bool:
        """Whether an optimizer stepping on the parameters ``ids`` steps on ours (core/steps.py)."""
        return self.initialized and any(id(p.sharded_param) in ids for p in self.params)

    def shards_changed(self) -> None:
        """An optimizer stepped on our shards: data gathered before is stale."""
        self.gathered_version = None

    @property
    def has_post_forward_mesh(self) -> bool:
        """``reshard_after_forward=R``: some part keeps 1/R of its parameters after forward."""
        return any(part.post_forward_mesh is not None for part in self.parts)

    @property
    def is_unsharded(self) -> bool:
        return self.holding is Holding.UNSHARDED

    def drop_post_forward_mesh(self) -> None:
        """``set_reshard_after_forward(bool)`` replaces an int: reshard to the whole mesh or not at all."""
        for part in self.parts:
            part.post_forward_mesh = None
            if part.plan is not None:
                part.plan.post_forward = None

    @_outside_inference_mode
    def lazy_init(self) -> None:
        for p in self.params:
            p.adopt_registered()
            p.refresh_extension()  # hooks attached to the local shard after fully_shard, as FSDP2 allows
        meta = [p.fqn for p in self.params if p.shard_device.type == "meta"]
        if meta:
            raise still_on_meta(meta)
        for p in self.params:
            p.alloc_unsharded()
        for part in self.parts:
            part.make_plan()
        self.initialized = True

    # Unshard / reshard -------------------------------------------------------------------
    @_outside_inference_mode
    def issue_unshard(self) -> None:
        """Issue the all-gather and return (``wait_for_unshard`` waits, copies out and
        registers); a no-op if one is issued or the kept data is still fresh."""
        if self.holding is Holding.GATHERING:
            return
        if self.holding in (Holding.UNSHARDED, Holding.KEPT):
            if self._fresh():
                if self.holding is Holding.KEPT:
                    self._register_unsharded()
                return
            self.reshard()  # the shards changed since we gathered: gather again
        if not dist.is_initialized():
            raise RuntimeError(
                f"shardkit: cannot unshard group '{self.name or '<root>'}': torch.distributed is "
                "not initialized (call init_process_group first, and do not destroy it while "
                "training)."
            )
        if not self.initialized:
            self.lazy_init()
        fresh = self._fresh()
        self.gathered_version = self._shard_version()
        self.all_gathers = []
        for part in self.parts:  # one all-gather per mesh
            plan = part.plan
            if part.holds_post_forward and plan.post_forward is not None and fresh:
                comm, bucket = plan.post_forward, plan.post_forward_bucket
            else:
                comm, bucket = plan.comm, plan.all_gather
            self.all_gathers.append(collectives.all_gather(bucket, comm, self.name, self.options.custom_all_gather))
        self._drop_post_forward()  # the handles keep them until the all-gather is waited for
        self.holding = Holding.GATHERING


    def needs_all_gather(self) -> bool:
        """Whether ``issue_unshard()`` would issue an all-gather now."""
        held = self.holding in (Holding.UNSHARDED, Holding.KEPT) and self._fresh()
        return self.holding is not Holding.GATHERING and not held

    @_outside_inference_mode
    def wait_for_unshard(self) -> None:
        """Finish the issued all-gather and register the unsharded parameters."""
        if self.holding is not Holding.GATHERING:
            return
        for pending in self.all_gathers:
            collectives.finish_all_gather(pending)
        self.all_gathers = []
        self._register_unsharded()

    def reshard(self, free: bool = True) -> None:
        """Register the sharded parameters; free the unsharded storage unless ``free=False``
        (the data is then reused by the next unshard if no optimizer step came between)."""
        self._drop_post_forward()
        self._reshard(free, "" if free else "(data kept)")

    @_outside_inference_mode
    def reshard_to_post_forward(self) -> None:
        """After forward with ``reshard_after_forward=R``: keep this rank's 1/R of every
        parameter for the backward all-gather among R ranks, free the rest."""
        self.wait_for_unshard()
        kept = [part for part in self.parts if part.plan.post_forward is not None]
        if self.holding is not Holding.SHARDED:
            for p in (p for part in kept for p in part.params):
                p.keep_post_forward_shard()
        self._reshard(True, "(" + ", ".join(f"1/{part.plan.post_forward.world} kept" for part in kept) + ")")

    def _reshard(self, free: bool, detail: str) -> None:
        self.wait_for_unshard()
        if self.holding is Holding.UNSHARDED:
            for p in self.params:
                p.to_sharded()
            trace.record("reshard", self.name, detail)
            self.holding = Holding.KEPT
        if free and self.holding is Holding.KEPT:
            for part in self.parts:
                collectives.free_all_gather(part.plan.all_gather)
            self.holding = Holding.SHARDED

    def _drop_post_forward(self) -> None:
        for part in self.parts:
            if part.holds_post_forward:
                for p in part.params:
                    p.drop_post_forward_shard()

    def _register_unsharded(self) -> None:
        for p in self.params:
            p.to_unsharded()
        self.holding = Holding.UNSHARDED
        trace.record("unshard", self.name)

    def _fresh(self) -> bool:
        """No optimizer step and no in-place edit of the shards since we last gathered."""
        return self.gathered_version == self._shard_version()

    def _shard_version(self) -> int:
        """In-place edits of the sharded parameters outside an optimizer step bump this."""
        return sum(p.sharded_param._version for p in self.params)

    # Gradients ---------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """After backward: issue one reduce-scatter per bucket, or keep the grads unreduced (no
        gradient sync); either way the call is recorded in ``reducing``, whose ``finish``
        hands the results to ``.grad``.

        Every trainable parameter takes part, with a zero gradient where this rank has none,
        so ranks that used different parameters still issue the same collectives.
        """
        issued: list[Reduction] = []
        try:
            self._issue_reductions(issued)
        finally:  # one entry per call, even one that issued nothing: the schedule's limit counts calls
            self.reducing.issued(self, issued)

    def _issue_reductions(self, issued: list[Reduction]) -> None:
        if not self.initialized:
            return  # never ran: no gradients
        if not self.options.requires_gradient_sync:
            for p in self.params:
                if p.requires_grad:
                    p.accumulate_unreduced_grad()
            return
        for part in self.parts:
            comm = part.reduce_comm(self.options.separate_reduce_scatter)
            for bucket in part.plan.reduce_scatter:
                trainable = [p for p in bucket.params if p.requires_grad]
                if trainable:  # frozen parameters get no reduction
                    grads = [p.take_unsharded_grad() for p in trainable]
                    sub = bucket if len(trainable) == len(bucket.params) else bucket.subset(trainable)
                    issued.append(collectives.reduce_scatter(sub, grads, comm, self.name, self._reduction(part, sub)))

    def holds_unreduced_grads(self) -> bool:
        """Gradients from backwards with gradient sync off, or from one whose reduction has
        not been issued, wait for a reduction."""
        return any(p.accumulated_grad is not None or (p.unsharded_param is not None and p.unsharded_param.grad is not None) for p in self.params)

    def _reduction(self, part: MeshPart, bucket: Bucket) -> ReduceSettings:
        """How ``bucket``'s gradients are reduced this time (the knobs may change between steps)."""
        plan, options = part.plan, self.options
        hook = (options.all_reduce_hook, options.all_reduce_hook_stream) if options.all_reduce_hook is not None else None
        partial = keep_partial = None
        if plan.replicate is not None:  # HSDP
            key = partial_key(bucket)
            partial = plan.take_partial(key)
            if not options.requires_all_reduce:
                keep_partial = functools.partial(plan.keep_partial, key)  # instead of the all-reduce
        ranks = plan.comm.world * (plan.replicate.size() if plan.replicate is not None else 1)  # (a resizable replicate group: now)
        return ReduceSettings(reduction.divide_by(options, ranks), replicate=plan.replicate, partial=partial,
                              keep_partial=keep_partial, custom=options.custom_reduce_scatter, hook=hook,
                              force_sum=options.force_sum_reduction, user_factor=options.gradient_divide_factor is not None)

    def move_reductions_on(self) -> None:
        """Move our reductions in flight on without blocking, in issue order, up to the first
        not yet complete (so every rank starts its HSDP all-reduces in the same order)."""
        for reduction in self.reducing.of(self):
            reduction.move_on()
            if not reduction.done():
                return

    def reduce_done(self) -> bool:
        """Whether every reduction of ours in flight was complete when last moved on."""
        return all(r.done() for r in self.reducing.of(self))

    def finish_reduce(self, keep: bool = True) -> None:
        """Wait for our reductions in flight; give the results to ``.grad`` unless ``keep=False``."""
        self.reducing.finish(self, keep)

    def reset_plan(self) -> None:
        """Forget the collectives' plans after the parameters' dtype or device changed."""
        self.reshard()
        self.finish_reduce()
        self.initialized = False
        for part in self.parts:
            part.plan = None


class Reducing:
    """The reductions in flight under one root, in issue order: the one record of them, and
    ``finish``, the one path that waits for them and hands the results to ``.grad``.

    Each ``reduce_gradients`` call is an entry, even one that issued nothing (gradient sync
    off, frozen parameters): the schedule's limit (``MAX_REDUCING``) counts entries. Finishing
    a group finishes all its reductions, oldest first, and leaves its later entries, empty.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[ParamGroup, list[Reduction]]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def issued(self, group: ParamGroup, reductions: list[Reduction]) -> None:
        self._entries.append((group, reductions))

    def oldest(self) -> ParamGroup:
        return self._entries[0][0]

    def of(self, group: ParamGroup) -> list[Reduction]:
        """``group``'s reductions in flight, in issue order."""
        return [r for g, reductions in self._entries if g is group for r in reductions]

    def finish(self, group: ParamGroup, keep: bool = True) -> None:
        """Wait for ``group``'s reductions; give the results to ``.grad`` unless ``keep=False``."""
        for g, reductions in self._entries:
            if g is group:
                for reduction in reductions:
                    reduction.finish(keep)
                reductions.clear()

    def finish_oldest(self) -> None:
        """Finish the oldest entry's group, and forget that entry."""
        self.finish(self.oldest())
        del self._entries[0]

    def finish_all(self, keep: bool = True) -> None:
        """Finish every group, in issue order, and forget every entry."""
        for group, _ in self._entries:
            self.finish(group, keep)
        self._entries = []
