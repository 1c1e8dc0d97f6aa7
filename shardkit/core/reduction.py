"""The reduction rule both modes' executors follow: what the summed gradients are divided by,
and how much of it before the sum."""

from __future__ import annotations

from typing import Any

import torch


def divide_by(options: Any, ranks: int) -> float:
    """The user's ``set_gradient_divide_factor``, or the ``ranks`` of the data-parallel mesh
    (both dims for HSDP): the mean over the ranks that hold the parameter."""
    return options.gradient_divide_factor or ranks


def divide_factors(factor: float, dtype: torch.dtype) -> tuple[float, float]:
    """(before, after) the sum. fp32/bf16: all after. Otherwise (fp16, fp64) about sqrt(factor)
    before, a power of two, and the rest after (FSDP2's split; dividing by a power of two is
    exact, so the result is the same as dividing after)."""
    if dtype in (torch.float32, torch.bfloat16):
        return 1.0, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre


def hook_sees_divided(dtype: torch.dtype, force_sum: bool) -> bool:
    """Whether the all-reduce hook (``set_all_reduce_hook``) receives the divided gradient: in
    fp32/bf16 without ``set_force_sum_reduction_for_comms`` FSDP2 divides inside the collectives
    (AVG, or a premultiplied sum), so its hook sees the result; otherwise it sees the sum
    divided by the ``before`` factor alone, and the ``after`` factor is applied once it returns."""
    return dtype in (torch.float32, torch.bfloat16) and not force_sum
