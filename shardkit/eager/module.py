"""Eager mode's ``FSDPModule``: each method through the group's options, schedule or state."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule

from shardkit.core.module import FSDPModule, GradientReductionHandle, UnshardHandle, warn_no_effect
from shardkit.eager import fsdp2_view, hooks, root
from shardkit.eager.state import GroupState, under_another_root


class EagerFSDPModule(FSDPModule):
    """What ``shardkit.fully_shard`` makes a module's class also derive from."""

    mode, other_mode = "eager", "shardkit.compiled.fully_shard"

    def _shardkit(self) -> GroupState:
        return self.__dict__["_shardkit_state"]

    def _register_forward_method(self, method_name: str) -> None:
        method: Callable = getattr(self, method_name)
        state = self._shardkit()

        @functools.wraps(method)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = hooks.pre_forward(state, self, args, kwargs)
            return hooks.post_forward(state, self, args, method(*args, **kwargs))

        setattr(self, method_name, wrapped)

    def _get_fsdp_state(self) -> fsdp2_view.StateView:
        return fsdp2_view.view(self._shardkit())

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's private knob to issue forward all-gathers without waiting for them: shardkit
        already issues the next group's all-gather ahead (prefetch) and waits only before use."""

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        group = self._shardkit().group
        if group is not None:
            group.issue_unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        group = self._shardkit().group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        for state in _states(self, recurse):
            state.options.set_requires_gradient_sync(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        for state in _states(self, recurse):
            state.options.set_requires_all_reduce(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for state in _states(self, recurse):
            state.options.set_reshard_after_forward(reshard_after_forward)
            if state.group is not None:  # a bool replaces an int: reshard to the whole mesh or not at all
                state.group.drop_post_forward_mesh()

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        self._shardkit().options.set_unshard_in_backward(unshard_in_backward)

    def set_lockstep(self, enabled: bool = True) -> None:
        """For models that run some ``fully_shard`` modules on some ranks only (rank-dependent
        branches, modality encoders): every collective is first agreed on among the ranks,
        so that all of them issue the same collectives in the same order. Costs one small
        blocking all-gather per collective and turns prefetching off. Call on the root.
        See shardkit/eager/lockstep.py."""
        state = self._shardkit()
        if under_another_root(state):
            raise RuntimeError("set_lockstep must be called on the root FSDP module")
        root.set_lockstep(state.shared, enabled)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in _states(self, recurse):
            state.options.set_reshard_after_backward(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        self._shardkit().shared.options.set_is_last_backward(is_last_backward)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        warn_no_effect("set_keep_unsharded_storage", "shardkit frees the unsharded storage at reshard and allocates it "
                   "again at unshard (the results are the same; its data pointers change)")

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        state = self._shardkit()
        if under_another_root(state):
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        state.shared.options.set_manual_finalization(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> "GradientReductionHandle | None":
        schedule = self._shardkit().schedule
        if schedule is not None:
            schedule.finalize_backward()
        handle = GradientReductionHandle(schedule.finish_backward if schedule is not None else None)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._shardkit().options.set_forward_prefetch([m._shardkit() for m in _checked_fsdp_modules(modules, "forward")])

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        self._shardkit().options.set_backward_prefetch([m._shardkit() for m in _checked_fsdp_modules(modules, "backward")])

    def set_gradient_divide_factor(self, factor: float) -> None:
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive factor, got {factor}")
        self._shardkit().options.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        self._shardkit().options.set_force_sum_reduction(enable)

    def set_post_optim_event(self, event: Any) -> None:
        self._shardkit().shared.options.set_post_optim_event(event)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        state = self._shardkit()
        if stream is not None and state.group is not None and any(part.mesh.ndim == 2 for part in state.group.parts):
            raise ValueError("set_all_reduce_hook: stream cannot be set when using HSDP (the hook runs after its all-reduce)")
        state.options.set_all_reduce_hook(hook, stream)

    def set_custom_all_gather(self, comm: Any) -> None:
        _check_comm(comm, "set_custom_all_gather")
        self._shardkit().options.set_custom_all_gather(comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        _check_comm(comm, "set_custom_reduce_scatter")
        self._shardkit().options.set_custom_reduce_scatter(comm)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for state in _states(self, recurse):
            state.options.set_max_reducing(max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        for state in _states(self, recurse):
            state.options.set_separate_reduce_scatter(enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        if enable:
            warn_no_effect("set_allocate_memory_from_process_group_for_comm(True)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {backend!r}")
        warn_no_effect(f"set_symm_mem_for_comm({backend!r})")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted for FSDP2 compatibility: shardkit always reduces unused parameters with
        zero gradients (and leaves ``.grad`` None where no rank used one)."""

    def reset_iter_state(self) -> None:
        state = self._shardkit()
        if under_another_root(state):
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        if state.schedule is not None:
            state.schedule.reset()
        elif state.group is not None:  # before the first forward: nothing but an unshard to undo
            state.group.reshard()

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # .to()/.to_empty()/.cuda() replace the data of our sharded parameters: re-derive the shards.
        self.reshard()
        result = super(_TorchFSDPModule, self)._apply(*args, **kwargs)  # past torch's FSDP2 override: the user's class
        group = self._shardkit().group
        if group is not None:
            for p in group.params:
                p.reset_from_registered()
            group.reset_plan()
        return result


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """FSDP2's: let several roots (the stage modules of pipeline parallel, one rank holding
    several) share one communication context, so that they do not each hold their own
    streams and buffers. shardkit's collectives already share one set of streams per device
    (``comm/streams.py``), whichever root issues them; this checks the modules and makes
    them report one context to torch code that compares contexts (2.15's pipelining)."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"share_comm_ctx expects a list of modules fully_shard was applied to, got {type(module).__name__}: {module}")
    for module in modules[1:]:  # one context object: what torch's pipelining compares
        module._shardkit().shared.share_comm_ctx(modules[0]._shardkit().shared.comm_ctx)


def _check_comm(comm: Any, method: str) -> None:
    if not (callable(comm) and callable(getattr(comm, "allocate", None))):
        raise TypeError(
            f"{method} expects an object with allocate(size, *, dtype, device) and __call__ "
            f"(FSDP2's AllGather / ReduceScatter), got {type(comm).__name__}."
        )


def _states(module: FSDPModule, recurse: bool) -> list[GroupState]:
    modules = module.modules() if recurse else [module]
    return [m._shardkit() for m in modules if isinstance(m, FSDPModule)]


def _checked_fsdp_modules(modules: list, direction: str) -> list[FSDPModule]:
    for i, m in enumerate(modules):
        if not isinstance(m, FSDPModule):
            raise ValueError(
                f"set_modules_to_{direction}_prefetch expects modules that fully_shard was applied to, "
                f"but modules[{i}] is a {type(m).__name__}; call fully_shard on it first."
            )
    return modules
