"""The ``FSDPModule`` methods of a compiled-mode module.

A compiled-mode module is an ``FSDPModule`` (shardkit's, so torch's too): code that walks a
model for FSDP modules and sets them up (gradient accumulation, resharding) works unchanged.
Each setting is a plain attribute of the module's group that the traced forward reads, so
dynamo guards on it: a new setting compiles one more graph, and going back to a setting seen
before reuses its graph. What has no meaning in one graph does nothing (said in its
docstring); what compiled mode cannot do raises, naming the method and what to use instead.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from shardkit.compiled import unused
from shardkit.compiled.group import CompiledGroup
from shardkit.core import steps
from shardkit.core.module import FSDPModule, UnshardHandle, unavailable
from shardkit.core.setup import state_of


class CompiledFSDPModule(FSDPModule):
    """What ``shardkit.compiled.fully_shard`` makes a module's class also derive from."""

    mode, other_mode = "compiled", "shardkit.fully_shard (eager)"

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        for group in _groups(self, recurse=True):
            group.check_movable()  # before any parameter moves
        result = nn.Module._apply(self, *args, **kwargs)
        follow_registered(self._shardkit())  # .to()/.to_empty() replace the sharded parameters' data
        return result

    def _shardkit(self) -> CompiledGroup:
        return self.__dict__["_shardkit_state"]

    def _get_fsdp_state(self) -> Any:
        unavailable(self, f"_get_fsdp_state ({type(self).__name__}'s FSDP2 runtime state)", "compiled mode runs in the graph and keeps no such state")

    def _register_forward_method(self, method_name: str) -> None:
        """``register_fsdp_forward_method``: the method gathers the group's parameters as forward does."""
        from shardkit.compiled.forwarding import gathering

        method = getattr(type(self), method_name)
        setattr(self, method_name, gathering(self._shardkit(), method).__get__(self))

    # settings the graph reads ------------------------------------------------------------------
    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """``True``: backward all-gathers the group again (the graph recomputes the gather);
        ``False``: forward's unsharded parameters are kept for backward. Either replaces an int
        given to ``fully_shard``, as in eager mode."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for group in _groups(self, recurse):
            group.options.set_reshard_after_forward(reshard_after_forward)
            group.drop_two_step()

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel world size."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive factor, got {factor}")
        self._shardkit().options.set_gradient_divide_factor(float(factor))

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """``True``: this group's graph reduces with ``SUM`` and divides after, where it would
        average in the collectives (fp32/bf16 on NCCL), as eager mode. Not recursive."""
        self._shardkit().options.set_force_sum_reduction(bool(enable))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: backward keeps the unsharded gradients (summed in ``reduce_dtype``, no
        communication; the sharded parameters get no gradient) and the next backward with it
        on adds them before its reduce-scatter, as FSDP2's gradient accumulation without sync.
        Compiles one graph for ``False`` and one for the first backward after it. Sets
        ``set_requires_all_reduce`` to the same value, as FSDP2 does."""
        for group in _groups(self, recurse):
            group.options.set_requires_gradient_sync(bool(requires_gradient_sync))
            for b in range(len(group.buckets)) if not requires_gradient_sync else ():
                group.unreduced_leaf(b)  # made here, outside any compiled region
        self.set_requires_all_reduce(requires_gradient_sync, recurse=recurse)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False``: backward reduce-scatters but does not all-reduce over the replicas;
        the sums (this rank's rows, undivided, in ``reduce_dtype``) are kept, the sharded
        parameters get no gradient, and the next backward with it on adds them before its
        all-reduce, as FSDP2. One graph for ``False``, one for the first backward after it.
        Without a replicate dim it changes nothing (nothing is all-reduced)."""
        for group in _groups(self, recurse):
            group.options.set_requires_all_reduce(bool(requires_all_reduce))
            for b in range(len(group.buckets)) if not requires_all_reduce and group.replicate_comm is not None else ():
                group.partial_leaf(b)  # made here, outside any compiled region

    # what one graph already does -------------------------------------------------------------
    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted; no effect: each compiled backward finishes its reductions in the graph."""

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """``False``: backward keeps each bucket's all-gather output (in the ``.grad`` of a leaf
        of the group's) and the next forward uses it instead of all-gathering, as FSDP2's
        gradient accumulation without re-gathering; an optimizer step over the group's
        parameters, ``load_state_dict``, ``.to()`` or ``reshard()`` drops it, and the next
        forward all-gathers the shards as they are then (FSDP2 would use the stale parameters
        after a step). ``True`` (the default): the backward graph frees them. One graph for a
        backward that keeps, one for a forward that uses what was kept. Read at forward: set
        between a forward and its backward, it holds from the next forward (FSDP2: at that backward)."""
        for group in _groups(self, recurse):
            group.options.set_reshard_after_backward(bool(reshard_after_backward))
            for b in range(len(group.buckets)) if not reshard_after_backward else ():
                group.kept_leaf(b)  # made here, outside any compiled region
            steps.watch(group)  # an optimizer step over its parameters drops what it kept

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Accepted; no effect: the graph all-gathers the group at its forward, overlapped
        with the previous group's compute (``shardkit.compiled.overlap``). With ``async_op``, a
        handle whose ``wait()`` does nothing, as FSDP2's API returns one."""
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Frees what a backward kept (``set_reshard_after_backward(False)``); otherwise there
        is nothing to free: outside the graph only the sharded parameters exist."""
        self._shardkit().drop_kept()

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted; no effect: the graph runs on the stream the optimizer ran on."""

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        unavailable(self, "set_modules_to_forward_prefetch", "the graph's own schedule prefetches the next group (shardkit.compiled.overlap)")

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        unavailable(self, "set_modules_to_backward_prefetch", "the graph's own schedule prefetches the next group (shardkit.compiled.overlap)")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's private knob (torch's pipelining sets it): the graph never waits early."""

    def reset_iter_state(self) -> None:
        """Accepted; no effect: a failed graph leaves no state behind."""

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Accepted; no effect: the graph allocates its buffers itself."""


def follow_registered(group: CompiledGroup) -> None:
    """The modules hold new tensors for the group's parameters (``.to()``, ``setattr``,
    ``load_state_dict(assign=True)``): the layout, the buckets and the graph's leaves follow them."""
    for p in group.params:
        p.reset_from_registered()
    group.make_leaves()
    group.make_buckets()  # (raises if backwards without sync kept gradients)
    unused.rewatch(group)


def following_register_parameter(group: CompiledGroup, base: type, names: set[str]) -> Any:
    """``register_parameter`` of a module holding some of the group's parameters (``names``):
    ``setattr`` and ``load_state_dict(assign=True)`` register through it."""

    def register_parameter(self: nn.Module, name: str, param: Any) -> None:
        base.register_parameter(self, name, param)
        if name in names and param is not None:
            follow_registered(group)

    return register_parameter


def _groups(module: CompiledFSDPModule, recurse: bool) -> list[CompiledGroup]:
    found = [state_of(m) for m in module.modules()] if recurse else [module._shardkit()]
    unique = {id(g): g for g in found if isinstance(g, CompiledGroup)}
    return list(unique.values())
