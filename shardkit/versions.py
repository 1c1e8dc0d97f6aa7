"""The torch release shardkit runs on, and one named flag per FSDP2 difference between releases
that shardkit has to follow (2.13 is the baseline; 2.14.1 changes nothing shardkit follows).
The rest of shardkit compares no versions: it asks these flags.
"""

from __future__ import annotations

import re

import torch


def parse(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a torch version: ``"2.15.0+cu132"`` -> ``(2, 15, 0)``. A
    pre-release or nightly (``"2.15.0a0+git1234"``, ``"2.15.0.dev20260101"``) counts as its release."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


TORCH_VERSION: tuple[int, int, int] = parse(torch.__version__)

# torch 2.15: with MixedPrecisionPolicy(reduce_dtype=None), FSDP2 reduces gradients, accumulates
# them without sync, and keeps them sharded in each parameter's grad_dtype (its original dtype
# unless grad_dtype was set before lazy init; an explicit None: the gradient's own dtype), no
# longer in param_dtype (fsdp/_fully_shard/_fsdp_param.py: FSDPParam.unsharded_grad_dtype;
# _fsdp_param_group.py: FSDPParamGroup._get_reduce_dtype).
REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE = TORCH_VERSION >= (2, 15)

# torch 2.15: a local tensor whose fsdp_should_release_all_gather_outputs_after_post_all_gather()
# returns True has its all-gather outputs freed right after fsdp_post_all_gather
# (_fsdp_param.py: FSDPParam._init_extensions, init_unsharded_param).
# shardkit honours the hook on every torch (it saves memory only; dtensor/extension.py).
RELEASE_ALL_GATHER_OUTPUTS_HOOK = TORCH_VERSION >= (2, 15)

# torch 2.15: Tensor._has_grad_dtype_override tells an explicit grad_dtype from the default one
# (grad_dtype itself, settable on leaves, is older). Asked of torch, not of the version.
HAS_GRAD_DTYPE_OVERRIDE = hasattr(torch.Tensor, "_has_grad_dtype_override")

# torch 2.15: FSDPModule.set_manual_backward_finalization / finalize_backward(async_op=) ->
# GradientReductionHandle, which torch.distributed.pipelining's stage uses instead of
# fully_shard.state(m)._state_ctx.all_states[*]._fsdp_param_groups[*].post_backward() and
# _root_post_backward_final_callback() (2.13, 2.14). shardkit has both on every torch
# (module.py) and answers the older calls too (fsdp2_view.py).
MANUAL_BACKWARD_FINALIZATION = TORCH_VERSION >= (2, 15)
