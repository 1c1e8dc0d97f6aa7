"""ParamGroup: the parameters of one ``fully_shard`` call, unsharded and resharded together.

Which parameters the modules hold is the group's ``Holding``, a state of its own, separate
from the training phase (``state.py``). Only ``unshard``, ``wait_for_unshard`` and
``reshard`` change it, whoever asks (the schedule, a prefetch, or the user through
``FSDPModule.unshard``):

    SHARDED   --unshard()---------------------> GATHERING   (all-gather issued)
    GATHERING --wait_for_unshard()------------> UNSHARDED   (copied out, registered)
    UNSHARDED --reshard()---------------------> SHARDED     (storage freed)
    UNSHARDED --reshard(free=False)-----------> KEPT        (sharded registered, data kept)
    KEPT      --unshard(), data still fresh---> UNSHARDED   (no all-gather)
    KEPT      --unshard(), data stale---------> GATHERING   (freed, gathered again)
    KEPT      --reshard()---------------------> SHARDED
    GATHERING --reshard()---------------------> SHARDED     (waits for the all-gather first)

``reshard_to_post_forward`` (``reshard_after_forward=R``) also keeps this rank's 1/R of each
parameter (the post-forward shards) in SHARDED; the next ``unshard`` gathers from them among
R ranks and lets them go.

A group's parameters usually share one mesh. FSDP2's per-parameter mesh
(``shard_placement_fn`` returning a ``ShardPlacementResult``: MoE experts over an
expert-FSDP mesh, the dense layers over the whole data-parallel mesh) splits them into one
``MeshPart`` per mesh: each part has its own collectives (one all-gather, one reduce-scatter
per step) and buffers, while the group still unshards and reshards as one. The data is stale once an optimizer has stepped (a global step
hook) or a sharded parameter was edited in place (its version counter moved) since it was
gathered.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardkit import optim
from shardkit.comm import collectives, trace
from shardkit.comm.buckets import Bucket, GatherBucket, reduce_buckets
from shardkit.comm.collectives import Comm, PendingAllGather, Reduction, ReduceSettings
from shardkit.comm.streams import streams_for
from shardkit.dtensor.sharded_param import ShardedParam
from shardkit.options import GroupOptions


class Holding(enum.Enum):
    SHARDED = "sharded"  # the modules hold the sharded parameters; no unsharded data
    GATHERING = "gathering"  # an all-gather is issued; the modules still hold the sharded ones
    UNSHARDED = "unsharded"  # the modules hold the unsharded parameters
    KEPT = "kept"  # the modules hold the sharded parameters; the gathered data is kept for reuse


@dataclass
class Layout:
    """How a group's collectives run, and what their buffers hold between steps. Made at
    lazy init, once the shards are materialized; made again after ``.to()``."""

    comm: Comm  # the dim the parameters are sharded over
    replicate: Comm | None  # HSDP: the replicate dim
    post_forward: Comm | None  # reshard_after_forward=R: R consecutive ranks of the shard dim
    all_gather: GatherBucket
    reduce_scatter: list[Bucket]  # one per reduce_dtype
    post_forward_bucket: GatherBucket | None
    partial: dict = field(default_factory=dict)  # HSDP sums not yet all-reduced, by bucket
    separate: Comm | None = None  # set_separate_reduce_scatter_group: its own process group, made at first use


class MeshPart:
    """The parameters of a group that share one mesh, and the layout of their collectives."""

    def __init__(self, params: list[ShardedParam], mesh: DeviceMesh, post_forward_mesh: DeviceMesh | None = None) -> None:
        self.params = params
        # 1-D (FSDP) or 2-D (HSDP: replicate, shard); reshard_after_forward=R: (world / R, R).
        self.mesh, self.post_forward_mesh = mesh, post_forward_mesh
        if post_forward_mesh is not None:
            for p in params:
                p.set_post_forward(post_forward_mesh.size(1), post_forward_mesh.get_local_rank(1))
        self.layout: Layout | None = None  # at lazy init

    @property
    def world(self) -> int:
        """The ranks the parameters are sharded over."""
        return self.mesh.size(self.mesh.ndim - 1)

    @property
    def holds_post_forward(self) -> bool:
        return self.params[0].post_forward_shard is not None

    def make_layout(self) -> None:
        streams = streams_for(self.params[0].device)
        mesh, post_mesh = self.mesh, self.post_forward_mesh
        comm = Comm.of(mesh, mesh.ndim - 1, streams)
        replicate = Comm.of(mesh, 0, streams) if mesh.ndim == 2 else None
        post, post_bucket = None, None
        if post_mesh is not None:  # "dp/R" in the trace
            post = Comm.of(post_mesh, 1, streams, f"{comm.mesh_dim}/{post_mesh.size(1)}")
            post_bucket = GatherBucket(self.params, post.world, post_forward=True)
        all_gather = GatherBucket(self.params, self.world)
        self.layout = Layout(comm, replicate, post, all_gather, reduce_buckets(self.params, self.world), post_bucket)

    def reduce_comm(self, separate: bool) -> Comm:
        """The shard dim's process group, or (``set_separate_reduce_scatter_group``) a second
        one over the same ranks, so that reduce-scatters need not queue behind all-gathers."""
        layout = self.layout
        if not separate:
            return layout.comm
        if layout.separate is None:
            layout.separate = Comm.of(self.mesh, self.mesh.ndim - 1, layout.comm.streams, separate=True)
        return layout.separate


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
        self.options = options  # shared with the group's state: the set_* knobs
        self.name = ""  # the owning modules' FQNs, set at lazy init
        self.holding = Holding.SHARDED
        self.initialized = False  # lazy init made the buffers and the collectives' layouts
        self.gathered_version: int | None = None  # the shards' version when gathered; None: stale or none
        self.all_gathers: list[PendingAllGather] = []  # issued, not yet waited for
        self.reductions: list[Reduction] = []  # issued, not yet finished
        optim.install_once()
        optim.groups.add(self)  # an optimizer step makes gathered data stale

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
            if part.layout is not None:
                part.layout.post_forward = None

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
            part.make_layout()
        self.initialized = True

    # Unshard / reshard -------------------------------------------------------------------
    def unshard(self) -> None:
        """Issue the all-gather (``wait_for_unshard`` finishes it); a no-op if one is issued
        or the kept data is still fresh."""
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
            layout = part.layout
            if part.holds_post_forward and layout.post_forward is not None and fresh:
                comm, bucket = layout.post_forward, layout.post_forward_bucket
            else:
                comm, bucket = layout.comm, layout.all_gather
            self.all_gathers.append(collectives.all_gather(bucket, comm, self.name, self.options.custom_all_gather))
        self._drop_post_forward()  # the handles keep them until the all-gather is waited for
        self.holding = Holding.GATHERING

    def needs_all_gather(self) -> bool:
        """Whether ``unshard()`` would issue an all-gather now."""
        held = self.holding in (Holding.UNSHARDED, Holding.KEPT) and self._fresh()
        return self.holding is not Holding.GATHERING and not held

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

    def reshard_to_post_forward(self) -> None:
        """After forward with ``reshard_after_forward=R``: keep this rank's 1/R of every
        parameter for the backward all-gather among R ranks, free the rest."""
        self.wait_for_unshard()
        kept = [part for part in self.parts if part.layout.post_forward is not None]
        if self.holding is not Holding.SHARDED:
            for p in (p for part in kept for p in part.params):
                p.keep_post_forward_shard()
        self._reshard(True, "(" + ", ".join(f"1/{part.layout.post_forward.world} kept" for part in kept) + ")")

    def _reshard(self, free: bool, detail: str) -> None:
        self.wait_for_unshard()
        if self.holding is Holding.UNSHARDED:
            for p in self.params:
                p.to_sharded()
            trace.record("reshard", self.name, detail)
            self.holding = Holding.KEPT
        if free and self.holding is Holding.KEPT:
            for part in self.parts:
                collectives.free_all_gather(part.layout.all_gather)
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
        """After backward: issue one reduce-scatter per bucket (``finish_reduce`` hands the
        results to ``.grad``), or keep the grads unreduced (no gradient sync).

        Every trainable parameter takes part, with a zero gradient where this rank has none,
        so ranks that used different parameters still issue the same collectives.
        """
        if not self.initialized:
            return  # never ran: no gradients
        if not self.options.requires_gradient_sync:
            for p in self.params:
                if p.requires_grad:
                    p.accumulate_unreduced_grad()
            return
        for part in self.parts:
            comm = part.reduce_comm(self.options.separate_reduce_scatter)
            for bucket in part.layout.reduce_scatter:
                trainable = [p for p in bucket.params if p.requires_grad]
                if trainable:  # frozen parameters get no reduction
                    grads = [p.take_unsharded_grad() for p in trainable]
                    sub = bucket if len(trainable) == len(bucket.params) else bucket.subset(trainable)
                    self.reductions.append(collectives.reduce_scatter(sub, grads, comm, self.name, self._reduction(part, sub)))

    def holds_unreduced_grads(self) -> bool:
        """Gradients from backwards with gradient sync off, or from one whose reduction has
        not been issued, wait for a reduction."""
        return any(p.accumulated_grad is not None or (p.unsharded_param is not None and p.unsharded_param.grad is not None) for p in self.params)

    def _reduction(self, part: MeshPart, bucket: Bucket) -> ReduceSettings:
        """How ``bucket``'s gradients are reduced this time (the knobs may change between steps)."""
        layout, options = part.layout, self.options
        # The default divisor: every rank of the part's mesh (both dims for HSDP).
        how = ReduceSettings(options.gradient_divide_factor or part.mesh.size(), custom=options.custom_reduce_scatter, force_sum=options.force_sum_reduction, user_factor=options.gradient_divide_factor is not None)
        if options.all_reduce_hook is not None:
            how.hook = (options.all_reduce_hook, options.all_reduce_hook_stream)
        if layout.replicate is not None:  # HSDP
            how.partial = layout.partial.pop(tuple(map(id, bucket.params)), None)
            how.replicate = layout.replicate
            if not options.requires_all_reduce:
                how.keep_partial = layout.partial  # instead of the all-reduce
        return how

    def reduce_done(self) -> bool:
        """Move the issued reductions on without blocking, in issue order (so every rank starts
        its HSDP all-reduces in the same order); whether all have completed."""
        return all(r.done() for r in self.reductions)  # stops at the first not done

    def finish_reduce(self, keep: bool = True) -> None:
        """Wait for the issued reductions; give the results to ``.grad`` unless ``keep=False``."""
        for pending in self.reductions:
            pending.finish(keep)
        self.reductions = []

    def reset_layout(self) -> None:
        """Forget buffer layouts after the parameters' dtype or device changed."""
        self.reshard()
        self.finish_reduce()
        self.initialized = False
        for part in self.parts:
            part.layout = None
