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


@dataclass
class RootOptions:
    """What a whole step asks, set on the root. Every module has its own until the root's
    lazy init makes the root's the one its whole tree shares (as FSDP2's state context)."""

    is_last_backward: bool = True  # False: the next backward is not the last of the step (microbatches)
    manual_finalization: bool = False  # set_manual_backward_finalization: finalize_backward() ends the step's backward
    lockstep: bool = False  # agree on every collective first (shardkit/lockstep.py)
    post_optim_event: Any = None  # the next forward's all-gathers wait for it, then drop it


@dataclass(frozen=True)
class ParamOptions:
    """What a ``fully_shard`` call's policies ask of each of its parameters."""

    param_dtype: torch.dtype | None = None  # MixedPrecisionPolicy
    reduce_dtype: torch.dtype | None = None
    offload: bool = False  # CPUOffloadPolicy
    pin_memory: bool = False
    mp_policy: Any = None  # the MixedPrecisionPolicy itself, for fsdp_pre_all_gather
