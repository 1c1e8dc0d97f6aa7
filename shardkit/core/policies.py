"""The policy dataclasses of FSDP2, by the same names, fields and defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from shardkit.core.options import ParamOptions


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """All-gather/compute in ``param_dtype``, reduce gradients in ``reduce_dtype``, cast
    outputs to ``output_dtype``; ``None`` keeps the original dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    # FSDP2's since torch 2.15: per parameter, its original dtype keeps it unconverted; None
    # (or param_dtype) gives it param_dtype. Called once per parameter, at fully_shard.
    param_dtype_override_fn: Callable[[torch.nn.Parameter], torch.dtype | None] | None = field(default=None, kw_only=True)

    def param_dtype_for(self, param: torch.nn.Parameter, where: str) -> torch.dtype | None:
        """``param``'s all-gather and compute dtype (None: its own)."""
        if self.param_dtype_override_fn is None:
            return self.param_dtype
        dtype = self.param_dtype_override_fn(param)
        if dtype is None or dtype == self.param_dtype:
            return self.param_dtype
        if dtype != param.dtype:
            raise ValueError(
                f"param_dtype_override_fn returned {dtype} for {where} ({param.dtype}); return None, "
                f"param_dtype ({self.param_dtype}) or the parameter's own dtype."
            )
        return None


@dataclass
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU; the optimizer steps there."""

    pin_memory: bool = True


_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def check_policies(mp_policy: object, offload_policy: object) -> tuple[MixedPrecisionPolicy, ParamOptions]:
    """The mixed precision policy and what the policies ask of each parameter, from shardkit's
    policies or torch FSDP2's (code that switched only the ``fully_shard`` import still passes
    torch's), with messages that say what to pass instead."""
    if not all(hasattr(mp_policy, f) for f in _FIELDS):
        raise TypeError(f"mp_policy should be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    override = getattr(mp_policy, "param_dtype_override_fn", None)  # torch 2.15's field
    mp = MixedPrecisionPolicy(**{f: getattr(mp_policy, f) for f in _FIELDS}, param_dtype_override_fn=override)
    for field in _FIELDS[:3]:
        dtype = getattr(mp, field)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(f"MixedPrecisionPolicy.{field} should be a floating-point torch.dtype or None, got {dtype!r}")
    kind = type(offload_policy).__name__
    if kind not in ("OffloadPolicy", "CPUOffloadPolicy"):
        raise TypeError(f"offload_policy should be an OffloadPolicy or CPUOffloadPolicy, got {kind}")
    offload = kind == "CPUOffloadPolicy"
    pin_memory = offload and bool(getattr(offload_policy, "pin_memory", True))
    return mp, ParamOptions(mp.param_dtype, mp.reduce_dtype, offload, pin_memory, mp)
