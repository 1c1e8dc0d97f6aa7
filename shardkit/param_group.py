"""ParamGroup: the parameters of one ``fully_shard`` call, unsharded and resharded together.

Its sharded/unsharded state is separate from the training phase (``state.py``): only
``unshard`` / ``wait_for_unshard`` / ``reshard`` change it, whoever asks (hooks, prefetch, or
the user through ``FSDPModule.unshard``).
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardkit import optim
from shardkit.comm import collectives, trace
from shardkit.comm.collectives import Bucket, Comm, PendingAllGather, PendingReduceScatter
from shardkit.comm.streams import streams_for
from shardkit.dtensor.sharded_param import ShardedParam, free_storage


# Groups whose unsharded parameters (or an issued all-gather) exist right now. Any optimizer
# step marks them stale: the next unshard gathers again instead of reusing pre-step values
# (a root kept unsharded by an eval forward, or reshard_after_backward=False). torch's
# foreach and fused optimizers do not bump the parameters' version counters, so a step hook
# is the one reliable signal.
_live_unsharded: "weakref.WeakSet[ParamGroup]" = weakref.WeakSet()


def _mark_live_unsharded_stale(optimizer, args, kwargs) -> None:
    for group in list(_live_unsharded):
        group.stale = True


_step_hook = None


def _install_step_hook_once() -> None:
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_post_hook(_mark_live_unsharded_stale)


def still_on_meta(names: list[str]) -> RuntimeError:
    return RuntimeError(
        f"shardkit: parameters {names} are still on the meta device at the first forward or "
        "unshard. Materialize them first: model.to_empty(device=...), then initialize them "
        "(reset_parameters() or your own init)."
    )


class ParamGroup:
    def __init__(self, params: list[ShardedParam], mesh: DeviceMesh, post_forward_mesh: DeviceMesh | None = None) -> None:
        self.params = params
        self.mesh = mesh  # 1-D (FSDP) or 2-D (HSDP: replicate, shard)
        self.world = mesh.size(mesh.ndim - 1)  # ranks the parameters are sharded over
        self.replicas = mesh.size(0) if mesh.ndim == 2 else 1
        # reshard_after_forward=R: a (world / R, R) mesh whose dim 1 is this rank's R ranks.
        self.post_forward_mesh = post_forward_mesh
        if post_forward_mesh is not None:
            for p in params:
                p.set_post_forward(post_forward_mesh.size(1), post_forward_mesh.get_local_rank(1))
        self.name = ""  # the owning modules' FQNs, set at lazy init
        self.is_unsharded = False  # which parameters the modules hold
        self._holds_data = False  # whether the unsharded storage holds gathered data
        self._holds_post_forward = False  # whether the parameters' post-forward shards are kept
        self._pending: list[PendingAllGather] = []  # issued, not yet waited for
        self._pending_post_forward = False  # ... from the post-forward shards
        self._reducing: list[PendingReduceScatter] = []  # issued, not yet waited for
        self._gathered_versions: list[int] = []  # padded-shard versions when we last gathered
        self._ag_buckets: list[Bucket] | None = None  # None until lazy init
        self.stale = False  # an optimizer stepped since we gathered
        self.host_sync = any(p.pin_memory for p in params)  # gradients go to pinned host memory asynchronously
        _install_step_hook_once()
        optim.install_once()
        # Knobs set through FSDPModule.set_* (FSDP2 names).
        self.reshard_after_backward = True
        self.reduce_grads = True
        self.all_reduce_grads = True  # HSDP: False keeps the reduce-scatter sums for later
        self.gradient_divide_factor: float | None = None
        self._partial: dict = {}  # HSDP sums not yet all-reduced, by bucket

    # Unshard / reshard -------------------------------------------------------------------
    def lazy_init(self) -> None:
        meta = [p.fqn for p in self.params if p.shard_device.type == "meta"]
        if meta:
            raise still_on_meta(meta)
        for p in self.params:
            p.alloc_unsharded()
        streams = streams_for(self.params[0].device)
        self._comm = Comm.of(self.mesh, self.mesh.ndim - 1, streams)
        self._replicate_comm = Comm.of(self.mesh, 0, streams) if self.mesh.ndim == 2 else None
        self._ag_buckets = collectives.buckets(self.params, "param_dtype", self.world)
        self._rs_buckets = collectives.buckets(self.params, "reduce_dtype", self.world)
        if self.post_forward_mesh is not None:
            # reshard_after_forward=R: R consecutive ranks of the shard dimension, "dp/R" in the trace
            post_name = f"{self._comm.mesh_dim}/{self.post_forward_mesh.size(1)}"
            self._post_comm = Comm.of(self.post_forward_mesh, 1, streams, post_name)
            self._post_buckets = collectives.buckets(self.params, "param_dtype", self._post_comm.world, post_forward=True)

    def unshard(self) -> None:
        """Issue the all-gather (``wait_for_unshard`` finishes it); a no-op if one is issued
        or the gathered data is still fresh. After ``reshard_to_post_forward`` it gathers
        from the post-forward shards, among their R ranks only."""
        if self._pending or self._holds_data:
            if self._fresh():
                if not self._pending:
                    self._register_unsharded()  # data kept by reshard(free=False)
                return
            self.reshard()  # the shards changed since we gathered: gather again
        if not dist.is_initialized():
            raise RuntimeError(
                f"shardkit: cannot unshard group '{self.name or '<root>'}': torch.distributed is "
                "not initialized (call init_process_group first, and do not destroy it while "
                "training)."
            )
        if self._ag_buckets is None:
            self.lazy_init()
        if self._holds_post_forward and self._fresh():
            self._pending = [collectives.all_gather(b, self._post_comm, self.name) for b in self._post_buckets]
            self._pending_post_forward = True
        else:
            self._drop_post_forward()
            self._pending = [collectives.all_gather(b, self._comm, self.name) for b in self._ag_buckets]
            self._gathered_versions = self._shard_versions()
            self.stale = False
        _live_unsharded.add(self)

    def needs_all_gather(self) -> bool:
        """Whether ``unshard()`` would issue an all-gather now."""
        if self._pending:
            return False
        return not (self._holds_data and self._fresh())

    def wait_for_unshard(self) -> None:
        """Finish the issued all-gather and register the unsharded parameters."""
        if not self._pending:
            return
        comm = self._post_comm if self._pending_post_forward else self._comm
        for pending in self._pending:
            collectives.finish_all_gather(pending, comm)
        self._pending = []
        if self._pending_post_forward:
            self._pending_post_forward = False
            self._drop_post_forward()
        self._holds_data = True
        self._register_unsharded()

    def reshard(self, free: bool = True, keep_post_forward: bool = False) -> None:
        """Register the sharded parameters; free the unsharded storage unless ``free=False``
        (the data is then reused by the next unshard if no optimizer step came between)."""
        if self._pending:
            self.wait_for_unshard()
        if not keep_post_forward:
            self._drop_post_forward()
        if self.is_unsharded:
            for p in self.params:
                p.to_sharded()
            self.is_unsharded = False
            detail = "(data kept)" if not free else f"(1/{self._post_comm.world} kept)" if keep_post_forward else ""
            trace.record("reshard", self.name, detail)
        if free and self._holds_data:
            for p in self.params:
                free_storage(p.unsharded_flat)
            self._holds_data = False
            if not self._holds_post_forward:
                _live_unsharded.discard(self)

    def reshard_to_post_forward(self) -> None:
        """After forward with ``reshard_after_forward=R``: keep this rank's 1/R of every
        parameter for the backward all-gather among R ranks, free the rest."""
        if self._pending:
            self.wait_for_unshard()
        if self._holds_data:
            for p in self.params:
                p.keep_post_forward_shard()
            self._holds_post_forward = True
        self.reshard(keep_post_forward=True)

    def _drop_post_forward(self) -> None:
        if self._holds_post_forward:
            for p in self.params:
                p.post_forward_shard = None
            self._holds_post_forward = False

    def _register_unsharded(self) -> None:
        if not self.is_unsharded:
            for p in self.params:
                p.to_unsharded()
            self.is_unsharded = True
            trace.record("unshard", self.name)

    def _fresh(self) -> bool:
        """No optimizer step and no in-place edit of the shards since we last gathered."""
        return not self.stale and self._gathered_versions == self._shard_versions()

    def _shard_versions(self) -> list[int]:
        """In-place edits of the sharded parameters outside an optimizer step bump these."""
        return [p.sharded_param._version for p in self.params]

    # Gradients ---------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """After backward: issue one reduce-scatter per bucket (``finish_reduce`` hands the
        results to ``.grad``), or keep the grads unreduced (no gradient sync).

        Every trainable parameter takes part, with a zero gradient where this rank has none,
        so ranks that used different parameters still issue the same collectives.
        """
        if self._ag_buckets is None:
            return  # never ran: no gradients
        if not self.reduce_grads:
            for p in self.params:
                if p.requires_grad:
                    p.accumulate_unreduced_grad()
            return
        for bucket in self._rs_buckets:
            trainable = [p for p in bucket.params if p.requires_grad]
            if not trainable:
                continue  # frozen parameters get no reduction
            grads = [p.take_unsharded_grad() for p in trainable]
            sub = bucket if len(trainable) == len(bucket.params) else bucket.subset(trainable)
            how = collectives.Reduction(self.gradient_divide_factor or self.world * self.replicas)
            if self._replicate_comm is not None:  # HSDP
                how.partial = self._partial.pop(tuple(map(id, sub.params)), None)
                if self.all_reduce_grads:
                    how.replicate = self._replicate_comm
                else:
                    how.keep_partial = self._partial
            self._reducing.append(collectives.reduce_scatter(sub, grads, self._comm, self.name, how))

    def reduce_progress(self) -> bool:
        """Move the issued reductions on without blocking, in issue order (so every rank starts
        its HSDP all-reduces in the same order); whether all have completed."""
        return all(collectives.progress(p) for p in self._reducing)  # stops at the first not done

    def finish_reduce(self, keep: bool = True) -> None:
        """Wait for the issued reduce-scatters; give the results to ``.grad`` unless ``keep=False``."""
        for pending in self._reducing:
            if keep:
                collectives.finish_reduce_scatter(pending, self._comm)
            elif pending.work is not None:
                pending.work.wait()
        self._reducing = []

    def reset_layout(self) -> None:
        """Forget buffer layouts after the parameters' dtype or device changed."""
        self.reshard()
        self.finish_reduce()
        self._ag_buckets = None
