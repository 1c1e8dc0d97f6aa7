"""The policy dataclasses of FSDP2, by the same names and defaults.

Non-default values are accepted by the constructors (so code written for FSDP2 imports and
builds them) but ``fully_shard`` refuses them until mixed precision and offload land.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """All-gather/compute in ``param_dtype``, reduce gradients in ``reduce_dtype``, cast
    outputs to ``output_dtype``; ``None`` keeps the original dtype."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients on CPU; the optimizer steps there."""

    pin_memory: bool = True


def check_supported(mp_policy: object, offload_policy: object) -> None:
    """Refuse what this version cannot do yet, with a message that says so."""
    dtypes = [getattr(mp_policy, f, None) for f in ("param_dtype", "reduce_dtype", "output_dtype")]
    if any(d is not None for d in dtypes):
        raise NotImplementedError(
            f"shardkit does not support mixed precision yet (got {mp_policy}); "
            "pass mp_policy=MixedPrecisionPolicy() or use autocast."
        )
    if type(offload_policy).__name__ != "OffloadPolicy":
        raise NotImplementedError(
            f"shardkit does not support {type(offload_policy).__name__} yet; pass offload_policy=OffloadPolicy()."
        )
