"""shardkit: fully sharded data parallel on DTensor, a drop-in for torch's FSDP2.

Switch with one import line::

    from shardkit import fully_shard, FSDPModule, MixedPrecisionPolicy
"""

import importlib
from typing import Any

from shardkit.eager.api import ShardPlacementResult, fully_shard
from shardkit.clip import clip_grad_norm_, grad_norm
from shardkit.comm.check import CollectiveMismatch, check_collectives
from shardkit.comm import timeline
from shardkit.comm.trace import Trace, trace
from shardkit.memtrack import MemTracker
from shardkit import optim  # registers its optimizer step hooks for the first fully_shard (core/steps.py)
from shardkit.planner import Plan, apply_plan, plan
from shardkit.core.meshes import DataParallelMeshDims
from shardkit.core.module import FSDPModule, GradientReductionHandle, UnshardHandle, register_fsdp_forward_method
from shardkit.eager.module import share_comm_ctx
from shardkit.core.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "GradientReductionHandle",
    "register_fsdp_forward_method",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "share_comm_ctx",
    "ShardPlacementResult",
    "clip_grad_norm_",
    "grad_norm",
    "trace",
    "Trace",
    "timeline",
    "check_collectives",
    "CollectiveMismatch",
    "checkpoint",
    "ft",
    "plan",
    "MemTracker",
    "Plan",
    "apply_plan",
]


_LAZY = ("checkpoint", "ft")


def __getattr__(name: str) -> Any:
    """``shardkit.checkpoint`` is imported at its first use: it imports
    torch.distributed.checkpoint, a slow import that ``import shardkit`` need not pay; and
    ``shardkit.ft`` (torchft), which only torchft's users need."""
    if name in _LAZY:
        return importlib.import_module(f"shardkit.{name}")
    raise AttributeError(f"module 'shardkit' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
