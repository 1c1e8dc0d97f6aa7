"""The reduction rule both modes' executors follow: what the summed gradients are divided by,
and how much of it before the sum."""

from __future__ import annotations

from typing import Any

import torch


def divide_by(options: Any, ranks: int) -> float:
    """The user's ``set_gradient_divide_factor``, or the ``ranks`` of the data-parallel mesh
    (both dims for HSDP): the mean over the ranks that hold the parameter."""
    return options.gradient_divide_factor or ranks


def overflow_risk(dtype: torch.dtype) -> bool:
    """Whether a sum of gradients in ``dtype`` can overflow or underflow (fp16, fp64 and the
    like: not fp32 or bf16, whose exponent is wide)."""
    return dtype not in (torch.float32, torch.bfloat16)


def divides_in_collectives(dtype: torch.dtype, force_sum: bool) -> bool:
    """Whether the collectives themselves may divide (AVG, or a premultiplied sum) as FSDP2's
    do: in a dtype without overflow risk, unless ``set_force_sum_reduction_for_comms``. The
    all-reduce hook (``set_all_reduce_hook``) then receives the divided gradient; otherwise it
    receives the sum divided by the ``before`` factor of ``divide_factors`` alone, and the
    ``after`` factor is applied once it returns."""
    return not overflow_risk(dtype) and not force_sum


def divide_factors(factor: float, dtype: torch.dtype) -> tuple[float, float]:
    """(before, after) the sum. Without overflow risk: all after. Otherwise about sqrt(factor)
    before, a power of two, and the rest after (FSDP2's split; dividing by a power of two is
    exact, so the result is the same as dividing after)."""
    if not overflow_risk(dtype):
        return 1.0, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre
