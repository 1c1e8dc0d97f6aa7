"""The knobs of a group and of a step, made by ``fully_shard`` and set by ``FSDPModule.set_*``,
and what the policies ask of each parameter.

``GroupOptions`` and ``RootOptions`` exist from the ``fully_shard`` call on, so every
``set_*`` method works the same before and after the first forward; the runtime reads them
each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass
class GroupOptions:
    """What one ``fully_shard`` call and its module's ``set_*`` methods ask of its group."""

    reshard_after_forward: bool | None = None  # None: True, except for the root (decided at lazy init)
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True  # False: backward needs no parameter values (an embedding)
    requires_gradient_sync: bool = True  # False: accumulate unreduced gradients locally
    requires_all_reduce: bool = True  # HSDP: False keeps the reduce-scatter sums for a later backward
    gradient_divide_factor: float | None = None  # None: the data-parallel world size
    forward_prefetch: list | None = None  # groups to all-gather after this one in forward; None: the next
    backward_prefetch: list | None = None  # ... in backward; None: the previous one in forward order
    all_reduce_hook: Callable | None = None  # called on each reduced gradient chunk, before the division
    all_reduce_hook_stream: Any = None  # CUDA stream it runs on (None: the compute stream)
    custom_all_gather: Any = None  # FSDP2's AllGather protocol: allocate(...) and __call__(out, in, group, async_op)
    custom_reduce_scatter: Any = None  # ReduceScatter: allocate(...) and __call__(out, in, group, op, async_op)
    separate_reduce_scatter: bool = False  # reduce-scatters on a process group of their own
    force_sum_reduction: bool = False  # set_force_sum_reduction_for_comms: never ReduceOp.AVG
    max_reducing: int | None = None  # reductions (and their input buffers) in flight; None: the schedule's MAX_REDUCING

    # The one way to change a knob: ``FSDPModule.set_*`` (module.py) and lazy init (root.py)
    # call these, so only this file writes the fields (the group's state and its ParamGroup
    # read the same object).
    def set_requires_gradient_sync(self, enabled: bool) -> None:
        self.requires_gradient_sync = self.requires_all_reduce = enabled  # FSDP2 sets both

    def set_requires_all_reduce(self, enabled: bool) -> None:
        self.requires_all_reduce = enabled

    def set_reshard_after_forward(self, reshard: bool) -> None:
        self.reshard_after_forward = reshard

    def settle_reshard_after_forward(self, is_root: bool) -> None:
        """Lazy init: unless the user chose, reshard after forward everywhere but the root."""
        if self.reshard_after_forward is None:
            self.reshard_after_forward = not is_root

    def set_unshard_in_backward(self, enabled: bool) -> None:
        self.unshard_in_backward = enabled

    def set_reshard_after_backward(self, enabled: bool) -> None:
        self.reshard_after_backward = enabled

    def set_forward_prefetch(self, states: list) -> None:
        self.forward_prefetch = states

    def set_backward_prefetch(self, states: list) -> None:
        self.backward_prefetch = states

    def set_gradient_divide_factor(self, factor: float) -> None:
        self.gradient_divide_factor = factor

    def set_force_sum_reduction(self, enabled: bool) -> None:
        self.force_sum_reduction = enabled

    def set_all_reduce_hook(self, hook: Callable | None, stream: Any) -> None:
        self.all_reduce_hook, self.all_reduce_hook_stream = hook, stream

    def set_custom_all_gather(self, comm: Any) -> None:
        self.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        self.custom_reduce_scatter = comm

    def set_max_reducing(self, limit: int) -> None:
        self.max_reducing = limit

    def set_separate_reduce_scatter(self, enabled: bool) -> None:
        self.separate_reduce_scatter = enabled


@dataclass
class RootOptions:
    """What a whole step asks, set on the root. Every module has its own until the root's
    lazy init makes the root's the one its whole tree shares (as FSDP2's state context)."""

    is_last_backward: bool = True  # False: the next backward is not the last of the step (microbatches)
    manual_finalization: bool = False  # set_manual_backward_finalization: finalize_backward() ends the step's backward
    lockstep: bool = False  # agree on every collective first (shardkit/eager/lockstep.py)
    post_optim_event: Any = None  # the next forward's all-gathers wait for it, then drop it

    # Set by the root's FSDPModule.set_* (module.py) and root.set_lockstep, through these only.
    def set_is_last_backward(self, last: bool) -> None:
        self.is_last_backward = last

    def set_manual_finalization(self, enabled: bool) -> None:
        self.manual_finalization = enabled

    def set_lockstep(self, enabled: bool) -> None:
        self.lockstep = enabled

    def set_post_optim_event(self, event: Any) -> None:
        self.post_optim_event = event

    def take_post_optim_event(self) -> Any:
        """The event set since the last forward (or None), dropped: it is used once."""
        event, self.post_optim_event = self.post_optim_event, None
        return event


@dataclass(frozen=True)
class ParamOptions:
    """What a ``fully_shard`` call's policies ask of each of its parameters."""

    param_dtype: torch.dtype | None = None  # MixedPrecisionPolicy
    reduce_dtype: torch.dtype | None = None
    offload: bool = False  # CPUOffloadPolicy
    pin_memory: bool = False
    mp_policy: Any = None  # the MixedPrecisionPolicy itself, for fsdp_pre_all_gather
