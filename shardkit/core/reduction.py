"""The reduction rule both modes' executors follow: what the summed gradients are divided by,
and how much of it before the sum."""

from __future__ import annotations

from typing import Any, NamedTuple

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


class ReduceOps(NamedTuple):
    """How one reduction divides: by ``before`` ahead of the sum, by ``after`` once it is done,
    and whether the reduce-scatter and the HSDP all-reduce average (``ReduceOp.AVG``)
    instead of summing."""

    before: float
    after: float
    shard_averages: bool
    replicate_averages: bool


def reduce_ops(divide_by: float, dtype: torch.dtype, force_sum: bool, user_factor: bool,
               shard: tuple[int, bool], replicate: tuple[int, bool] | None) -> ReduceOps:
    """The ops of one reduction over ``shard`` (and, HSDP, ``replicate``), each given as
    (ranks, whether its backend averages: NCCL). SUM and a division, except where every dim's
    backend averages and the collectives may divide (``divides_in_collectives``): divided by the
    data-parallel ranks, both dims average (FSDP2's choice); by a user's factor equal to the
    shard dim's ranks, the shard dim alone. A dim of one rank sums (the same; NCCL's AVG over
    one rank is unreliable)."""
    # (no generators: dynamo traces this inside compiled mode's backward)
    before, after = divide_factors(divide_by, dtype)
    over = replicate or (1, True)
    averages = (shard[1] or shard[0] == 1) and (over[1] or over[0] == 1) and divides_in_collectives(dtype, force_sum)
    if averages and not user_factor and divide_by == shard[0] * over[0]:
        return ReduceOps(before, 1.0, shard[0] > 1, (replicate or shard)[0] > 1)
    if averages and user_factor and divide_by == shard[0]:
        return ReduceOps(before, 1.0, shard[0] > 1, False)
    return ReduceOps(before, after, False, False)
