"""FSDPModule: the methods a module gains from ``fully_shard`` (FSDP2's names and semantics)."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.tensor import DTensor

from shardkit import fsdp2_view, hooks, root
from shardkit.dtensor.sharded_param import ParamSlot, ShardedParam
from shardkit.state import GroupState, state_of, under_another_root


class FSDPModule(_TorchFSDPModule):
    """Mixed into the class of every module ``fully_shard`` was applied to.

    ``fully_shard(block)`` changes ``type(block)`` to ``FSDPBlock(FSDPModule, Block)``, so
    ``isinstance(block, FSDPModule)`` holds and these methods are available. It subclasses
    torch's ``FSDPModule``, so torch code that checks for FSDP2 (pipelining, torch's
    ``register_fsdp_forward_method``) treats shardkit modules as FSDP modules; every public
    method of torch's is overridden here, and what torch reads of FSDP2's state is answered
    by ``fsdp2_view.py``.
    """

    _orig_cls_mro_index = 3  # FSDPBlock, FSDPModule, torch's FSDPModule, Block

    def __new__(cls, *args: Any, **kwargs: Any):
        # Code that rebuilds a module from its class (nn.Sequential slicing) gets the original class.
        orig_cls = cls.__mro__[cls._orig_cls_mro_index]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _shardkit(self) -> GroupState:
        return state_of(self)

    def _get_fsdp_state(self) -> fsdp2_view.StateView:
        """What torch code that reaches into FSDP2's state gets (see fsdp2_view.py)."""
        return fsdp2_view.view(self._shardkit())

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's private knob to issue forward all-gathers without waiting for them: shardkit
        already issues the next group's all-gather ahead (prefetch) and waits only before use."""

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gather this module's parameters (not recursive). With ``async_op=True``, return a
        handle; the module's next forward waits for it if ``wait()`` was not called."""
        group = self._shardkit().group
        if group is not None:
            group.issue_unshard()
        handle = UnshardHandle(group)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        group = self._shardkit().group
        if group is not None:
            group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False`` accumulates unreduced gradients locally (no communication) until set back.
        Sets ``set_requires_all_reduce`` to the same value too (HSDP), as FSDP2 does."""
        for state in _states(self, recurse):
            state.options.set_requires_gradient_sync(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: ``False`` reduce-scatters within the replica but skips the all-reduce
        across replicas, keeping the sums until a backward with it on (gradient accumulation
        that talks across nodes once). A no-op for 1-D meshes."""
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
        """``False``: backward does not all-gather this module's parameters again (for modules
        whose backward needs no parameter values, e.g. an embedding). Not recursive."""
        self._shardkit().options.set_unshard_in_backward(unshard_in_backward)

    def set_lockstep(self, enabled: bool = True) -> None:
        """For models that run some ``fully_shard`` modules on some ranks only (rank-dependent
        branches, modality encoders): every collective is first agreed on among the ranks,
        so that all of them issue the same collectives in the same order. Costs one small
        blocking all-gather per collective and turns prefetching off. Call on the root.
        See shardkit/lockstep.py."""
        state = self._shardkit()
        if under_another_root(state):
            raise RuntimeError("set_lockstep must be called on the root FSDP module")
        root.set_lockstep(state.shared, enabled)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for state in _states(self, recurse):
            state.options.set_reshard_after_backward(reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last one of the step (for microbatching): only the
        last one forgets the forward order that backward prefetching follows. Call on the root."""
        self._shardkit().shared.options.set_is_last_backward(is_last_backward)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """FSDP2's (torch 2.15): keep the unsharded storage across reshard and unshard (its
        data pointers, for CUDA graph capture). Accepted; no effect: shardkit frees it on
        reshard and allocates it again at the next unshard (the results are the same), said
        once by a warning."""
        _warn_once("set_keep_unsharded_storage", "shardkit frees the unsharded storage at reshard and allocates it "
                   "again at unshard (the results are the same; its data pointers change)")

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """FSDP2's (torch 2.15): ``True``: the caller ends the step's backward with
        ``finalize_backward()`` (after backwards with gradient sync off, it reduces what they
        accumulated); the end of each backward then no longer counts as the step's last
        (``set_is_last_backward``). Call on the root."""
        state = self._shardkit()
        if under_another_root(state):
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        state.shared.options.set_manual_finalization(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> "GradientReductionHandle | None":
        """FSDP2's (torch 2.15): end the step's backward: issue the reductions of the gradients
        accumulated with gradient sync off, then finish every reduction and reshard as the
        settings say. ``async_op=True``: return a handle; its ``wait()`` finishes. A no-op
        before the first forward. Call on the root."""
        schedule = self._shardkit().schedule
        if schedule is not None:
            schedule.finalize_backward()
        handle = GradientReductionHandle(schedule.finish_backward if schedule is not None else None)
        if async_op:
            return handle
        handle.wait()
        return None

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """After this module's all-gather in forward, issue those modules' all-gathers."""
        self._shardkit().options.set_forward_prefetch([m._shardkit() for m in _checked_fsdp_modules(modules, "forward")])

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """After this module's all-gather in backward, issue those modules' all-gathers."""
        self._shardkit().options.set_backward_prefetch([m._shardkit() for m in _checked_fsdp_modules(modules, "backward")])

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel world size."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor expects a positive factor, got {factor}")
        self._shardkit().options.set_gradient_divide_factor(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated FSDP2 name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """``True``: this group's reductions use ``ReduceOp.SUM`` only and divide after (NCCL's
        zero-copy transfers need SUM), where they would average in the collective
        (``ReduceOp.AVG``: fp32/bf16 over one mesh dim on NCCL). Not recursive, as FSDP2."""
        self._shardkit().options.set_force_sum_reduction(enable)

    def set_post_optim_event(self, event: Any) -> None:
        """The next forward's all-gathers wait for ``event`` (recorded after the optimizer
        step), which is then dropped: set a new one each step. shardkit's all-gathers also wait
        for the compute stream, which the optimizer step ran on, so this adds no overlap."""
        self._shardkit().shared.options.set_post_optim_event(event)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduced)`` on each reduced gradient buffer of this group (this rank's flat
        chunk, in ``reduce_dtype``, as the collectives left it: averaged where the backend
        averages, NCCL with fp32/bf16, else summed and not yet divided, as FSDP2): after the
        HSDP all-reduce, or after the reduce-scatter without one. The hook may edit it in place.
        ``stream`` (CUDA, not with HSDP): run the hook on it."""
        state = self._shardkit()
        if stream is not None and state.group is not None and any(part.mesh.ndim == 2 for part in state.group.parts):
            raise ValueError("set_all_reduce_hook: stream cannot be set when using HSDP (the hook runs after its all-reduce)")
        state.options.set_all_reduce_hook(hook, stream)

    def set_custom_all_gather(self, comm: Any) -> None:
        """Issue this group's all-gather with ``comm`` (FSDP2's ``AllGather``): its
        ``allocate(size, dtype=, device=)`` makes the output buffer and
        ``comm(output, input, group, async_op)`` runs the collective."""
        _check_comm(comm, "set_custom_all_gather")
        self._shardkit().options.set_custom_all_gather(comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Issue this group's reduce-scatter with ``comm`` (FSDP2's ``ReduceScatter``): its
        ``allocate`` makes the input and output buffers and ``comm(output, input, group, op,
        async_op)`` runs the collective with ``op``: ``ReduceOp.AVG`` where the backend
        averages (NCCL, fp32/bf16, as FSDP2), else SUM, divided after."""
        _check_comm(comm, "set_custom_reduce_scatter")
        self._shardkit().options.set_custom_reduce_scatter(comm)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reductions (and so their input buffers) may be in flight when this group's
        reduce-scatter is issued; the oldest is finished first beyond that. shardkit's default
        is 2 (FSDP2's 1 stalls the compute stream on an exposed reduce-scatter)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for state in _states(self, recurse):
            state.options.set_max_reducing(max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run this group's reduce-scatters on a process group of their own over the same ranks
        (made at the first one, on every rank of the mesh alike), so that on NCCL they can run
        concurrently with the all-gathers instead of queueing behind them."""
        for state in _states(self, recurse):
            state.options.set_separate_reduce_scatter(enable)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility; shardkit allocates its communication buffers with
        the default allocator, which gives the same results (it warns once when enabled)."""
        if enable:
            _warn_once("set_allocate_memory_from_process_group_for_comm(True)")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for FSDP2 compatibility; shardkit does not allocate its all-gather buffers in
        symmetric memory, which gives the same results (it warns once)."""
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm supports backend='NCCL' only, got {backend!r}")
        _warn_once(f"set_symm_mem_for_comm({backend!r})")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted for FSDP2 compatibility: shardkit always reduces unused parameters with
        zero gradients (and leaves ``.grad`` None where no rank used one)."""

    def reset_iter_state(self) -> None:
        """After an exception inside forward or backward: reshard everything and return every
        group to IDLE; the failed step's gradients are dropped. Call on the root."""
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


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` makes the unsharded parameters usable."""

    def __init__(self, group=None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class GradientReductionHandle:
    """Returned by ``finalize_backward(async_op=True)``; ``wait()`` finishes the reductions
    (the gradients are ready after it)."""

    def __init__(self, finish: Callable[[], None] | None = None) -> None:
        self._finish = finish

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run the pre/post-forward hooks around ``module.<method_name>`` (e.g. ``generate``) as
    around ``forward``. A no-op if ``module`` is not an FSDPModule."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    if hasattr(module, "_shardkit_forward_method"):  # compiled mode: no hooks
        return module._shardkit_forward_method(method_name)
    method: Callable = getattr(module, method_name)
    state = module._shardkit()

    @functools.wraps(method)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = hooks.pre_forward(state, module, args, kwargs)
        return hooks.post_forward(state, module, args, method(*args, **kwargs))

    setattr(module, method_name, wrapped)


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


_warned: set[str] = set()


_BUFFERS = "shardkit allocates its communication buffers with the default allocator (the results are the same; only where the buffers live differs)"


def _warn_once(call: str, why: str = _BUFFERS) -> None:
    if call not in _warned:
        _warned.add(call)
        warnings.warn(f"shardkit: {call} has no effect: {why}.", stacklevel=3)


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


def accept_full_tensors(slots: list[tuple[ParamSlot, ShardedParam]]) -> None:
    """``load_state_dict`` with plain (full) tensors for sharded parameters: each rank keeps its
    shard (FSDP2 makes the user distribute them first). A hook on each module that registers
    one of them, run before that module loads its own entries."""
    by_module: dict[nn.Module, list[tuple[str, ShardedParam]]] = {}
    for slot, p in slots:
        by_module.setdefault(slot.module, []).append((slot.name, p))

    def hook_for(entries):
        def hook(state_dict, prefix, *args):
            for name, p in entries:
                value = state_dict.get(prefix + name)
                full_shape = p.tp_spec.shape if p.tp_spec is not None else p.shape
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == full_shape:
                    state_dict[prefix + name] = p.shard_of_full(value)
        return hook

    for module, entries in by_module.items():
        module._register_load_state_dict_pre_hook(hook_for(entries))
