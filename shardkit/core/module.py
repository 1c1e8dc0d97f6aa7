"""``FSDPModule``: the interface a module gains from ``fully_shard``, FSDP2's names and semantics.

Each mode implements it: eager mode in ``eager/module.py`` (``EagerFSDPModule``), compiled mode
in ``compiled/module.py`` (``CompiledFSDPModule``). A method a mode does not implement raises a
``NotImplementedError`` that names it and the mode to use instead.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule

from shardkit.core.setup import user_class


class FSDPModule(_TorchFSDPModule):
    """Mixed into the class of every module ``fully_shard`` was applied to.

    ``fully_shard(block)`` changes ``type(block)`` to ``FSDPBlock(<mode>FSDPModule, Block)``, so
    ``isinstance(block, FSDPModule)`` holds in both modes and these methods are available. It
    subclasses torch's ``FSDPModule``, so torch code that checks for FSDP2 (pipelining, torch's
    ``register_fsdp_forward_method``) treats shardkit modules as FSDP modules; every public
    method of torch's is declared here.
    """

    mode = ""  # "eager" or "compiled": named in the errors of what a mode does not do
    other_mode = ""  # what to use instead

    def __new__(cls, *args: Any, **kwargs: Any):
        # Code that rebuilds a module from its class (nn.Sequential slicing) gets the original class.
        orig_cls = user_class(cls)
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _shardkit(self) -> Any:
        """This module's state: the mode's own (``GroupState`` or ``CompiledGroup``)."""
        raise NotImplementedError

    def _register_forward_method(self, method_name: str) -> None:
        """``register_fsdp_forward_method``: ``method_name`` runs with the parameters gathered, as forward."""
        raise NotImplementedError

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gather this module's parameters (not recursive). With ``async_op=True``, return a
        handle; the module's next forward waits for it if ``wait()`` was not called."""
        unavailable(self, "unshard")

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        unavailable(self, "reshard")

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False`` accumulates unreduced gradients locally (no communication) until set back. Sets
        ``set_requires_all_reduce`` to the same value too (HSDP), as FSDP2 does."""
        unavailable(self, "set_requires_gradient_sync")

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only: ``False`` reduce-scatters within the replica but skips the all-reduce across
        replicas, keeping the sums until a backward with it on (gradient accumulation that talks
        across nodes once). A no-op for 1-D meshes."""
        unavailable(self, "set_requires_all_reduce")

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """FSDP2's ``set_reshard_after_forward``."""
        unavailable(self, "set_reshard_after_forward")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: backward does not all-gather this module's parameters again (for modules whose
        backward needs no parameter values, e.g. an embedding). Not recursive."""
        unavailable(self, "set_unshard_in_backward")

    def set_lockstep(self, enabled: bool = True) -> None:
        """For models that run some ``fully_shard`` modules on some ranks only (rank-dependent
        branches, modality encoders): every collective is first agreed on among the ranks, so that
        all of them issue the same collectives in the same order. Costs one small blocking all-
        gather per collective and turns prefetching off. Call on the root. See
        shardkit/eager/lockstep.py."""
        unavailable(self, "set_lockstep")

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """FSDP2's ``set_reshard_after_backward``."""
        unavailable(self, "set_reshard_after_backward")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last one of the step (for microbatching): only the last
        one forgets the forward order that backward prefetching follows. Call on the root."""
        unavailable(self, "set_is_last_backward")

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """FSDP2's (torch 2.15): keep the unsharded storage across reshard and unshard (its data
        pointers, for CUDA graph capture). Accepted; no effect: shardkit frees it on reshard and
        allocates it again at the next unshard (the results are the same), said once by a warning."""
        unavailable(self, "set_keep_unsharded_storage")

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """FSDP2's (torch 2.15): ``True``: the caller ends the step's backward with
        ``finalize_backward()`` (after backwards with gradient sync off, it reduces what they
        accumulated); the end of each backward then no longer counts as the step's last
        (``set_is_last_backward``). Call on the root."""
        unavailable(self, "set_manual_backward_finalization")

    def finalize_backward(self, *, async_op: bool = False) -> "GradientReductionHandle | None":
        """FSDP2's (torch 2.15): end the step's backward: issue the reductions of the gradients
        accumulated with gradient sync off, then finish every reduction and reshard as the settings
        say. ``async_op=True``: return a handle; its ``wait()`` finishes. A no-op before the first
        forward. Call on the root."""
        unavailable(self, "finalize_backward")

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """After this module's all-gather in forward, issue those modules' all-gathers."""
        unavailable(self, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """After this module's all-gather in backward, issue those modules' all-gathers."""
        unavailable(self, "set_modules_to_backward_prefetch")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel world size."""
        unavailable(self, "set_gradient_divide_factor")

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """``True``: this group's reductions use ``ReduceOp.SUM`` only and divide after (NCCL's
        zero-copy transfers need SUM), where they would average in the collective (``ReduceOp.AVG``:
        fp32/bf16 over one mesh dim on NCCL). Not recursive, as FSDP2."""
        unavailable(self, "set_force_sum_reduction_for_comms")

    def set_post_optim_event(self, event: Any) -> None:
        """The next forward's all-gathers wait for ``event`` (recorded after the optimizer step),
        which is then dropped: set a new one each step. shardkit's all-gathers also wait for the
        compute stream, which the optimizer step ran on, so this adds no overlap."""
        unavailable(self, "set_post_optim_event")

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(reduced)`` on each reduced gradient buffer of this group (this rank's flat
        chunk, in ``reduce_dtype``, as the collectives left it: averaged where the backend averages,
        NCCL with fp32/bf16, else summed and not yet divided, as FSDP2): after the HSDP all-reduce,
        or after the reduce-scatter without one. The hook may edit it in place. ``stream`` (CUDA,
        not with HSDP): run the hook on it."""
        unavailable(self, "set_all_reduce_hook")

    def set_custom_all_gather(self, comm: Any) -> None:
        """Issue this group's all-gather with ``comm`` (FSDP2's ``AllGather``): its ``allocate(size,
        dtype=, device=)`` makes the output buffer and ``comm(output, input, group, async_op)`` runs
        the collective."""
        unavailable(self, "set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Issue this group's reduce-scatter with ``comm`` (FSDP2's ``ReduceScatter``): its
        ``allocate`` makes the input and output buffers and ``comm(output, input, group, op,
        async_op)`` runs the collective with ``op``: ``ReduceOp.AVG`` where the backend averages
        (NCCL, fp32/bf16, as FSDP2), else SUM, divided after."""
        unavailable(self, "set_custom_reduce_scatter")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reductions (and so their input buffers) may be in flight when this group's
        reduce-scatter is issued; the oldest is finished first beyond that. shardkit's default is 2
        (FSDP2's 1 stalls the compute stream on an exposed reduce-scatter)."""
        unavailable(self, "set_reduce_scatter_max_input_buffers")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run this group's reduce-scatters on a process group of their own over the same ranks
        (made at the first one, on every rank of the mesh alike), so that on NCCL they can run
        concurrently with the all-gathers instead of queueing behind them."""
        unavailable(self, "set_separate_reduce_scatter_group")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted for FSDP2 compatibility; shardkit allocates its communication buffers with the
        default allocator, which gives the same results (it warns once when enabled)."""
        unavailable(self, "set_allocate_memory_from_process_group_for_comm")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Accepted for FSDP2 compatibility; shardkit does not allocate its all-gather buffers in
        symmetric memory, which gives the same results (it warns once)."""
        unavailable(self, "set_symm_mem_for_comm")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Accepted for FSDP2 compatibility: shardkit always reduces unused parameters with zero
        gradients (and leaves ``.grad`` None where no rank used one)."""
        unavailable(self, "set_reduce_scatter_unused_params")

    def reset_iter_state(self) -> None:
        """After an exception inside forward or backward: reshard everything and return every group
        to IDLE; the failed step's gradients are dropped. Call on the root."""
        unavailable(self, "reset_iter_state")

    def _get_fsdp_state(self) -> fsdp2_view.StateView:
        """What torch code that reaches into FSDP2's state gets (see fsdp2_view.py)."""
        unavailable(self, "_get_fsdp_state")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's private knob to issue forward all-gathers without waiting for them: shardkit
        already issues the next group's all-gather ahead (prefetch) and waits only before use."""
        unavailable(self, "_set_unshard_async_op")
    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated FSDP2 name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)


def unavailable(module: FSDPModule, what: str, why: str = "") -> None:
    """Raise: ``module``'s mode does not do ``what`` (``why``: the reason, if not just that)."""
    why = why or f"{module.mode} mode does not take it"
    raise NotImplementedError(f"shardkit.{module.mode}: {what} is not available in {module.mode} mode ({why}); "
                              f"use {module.other_mode} for it.")


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
    module._register_forward_method(method_name)


_warned: set[str] = set()


_BUFFERS = "shardkit allocates its communication buffers with the default allocator (the results are the same; only where the buffers live differs)"


def warn_no_effect(call: str, why: str = _BUFFERS) -> None:
    """Say once per process that ``call`` is accepted and does nothing, and ``why``."""
    if call not in _warned:
        _warned.add(call)
        warnings.warn(f"shardkit: {call} has no effect: {why}.", stacklevel=3)
