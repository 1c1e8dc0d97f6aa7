"""Optimizer steps on the local shards: users see DTensors, the kernels see plain tensors.

An optimizer over DTensor parameters pays DTensor's dispatch (sharding propagation, output
wrapping) on every one of its ~10 elementwise ops per parameter: for a 3 M parameter GPT on
CPU, AdamW takes 15.6 ms on DTensors against 4.3 ms on the same local tensors. For the
elementwise optimizers of ``torch.optim`` the sharded step is exactly the step on each
rank's local shard, so around every step of those optimizers we swap, for shardkit's
parameters only:

- in ``param_groups``, each DTensor parameter for its local tensor (with its local grad);
- in ``state``, its entries for their local tensors.

After the step everything is swapped back, so between steps the optimizer holds the
DTensors it was given and its ``state_dict()`` holds DTensor state, as with torch's FSDP2.
State created by the first step is wrapped as DTensors shaped like the parameter.

Not swapped: optimizers not listed in ``_ELEMENTWISE`` (LBFGS, Adafactor, Muon, your own:
their math may reduce over a parameter), parameters shardkit does not own. Per-optimizer
step hooks (``optimizer.register_step_pre_hook``) run inside the swap and see the local
tensors. ``SHARDKIT_LOCAL_OPTIM=0`` turns the swap off.
"""

from __future__ import annotations

import os
import warnings
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

_ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)

# optimizer -> what its pre-step hook swapped: [(optimizer param group, dtensor params), ...], [(param, local, state)]
_swapped: dict[int, tuple[list, list]] = {}
_installed = False
_checked: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()  # optimizers looked at once


def install_once() -> None:
    """Register the process-wide step hooks (core/steps.py calls it at the first ``fully_shard``,
    before its own staleness hook, which must see the DTensors that ``_to_dtensor`` swaps back)."""
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(_warn_if_built_before_fully_shard)
        if os.environ.get("SHARDKIT_LOCAL_OPTIM", "1") != "0":
            register_optimizer_step_pre_hook(_to_local)
            register_optimizer_step_post_hook(_to_dtensor)
        _installed = True


def _warn_if_built_before_fully_shard(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """At an optimizer's first step: does it hold parameters that ``fully_shard`` replaced? Its
    steps would then change tensors the model no longer uses (FSDP2 is silent here)."""
    if optimizer in _checked:
        return
    _checked.add(optimizer)
    replaced = [p for opt_group in optimizer.param_groups for p in opt_group["params"] if hasattr(p, "_shardkit_replaced")]
    if replaced:
        warnings.warn(
            f"shardkit: this {type(optimizer).__name__} holds {len(replaced)} parameters that fully_shard has "
            "replaced by sharded ones, so its steps do not change the model. Build the optimizer after "
            "fully_shard: fully_shard(model); optimizer = torch.optim.AdamW(model.parameters(), ...).",
            stacklevel=3,
        )


def _owned(p: torch.Tensor) -> bool:
    return getattr(p, "_shardkit_owned", False)


def _to_local(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if type(optimizer) not in _ELEMENTWISE:
        return
    _to_dtensor(optimizer, args, kwargs)  # a step that raised left its swap in place
    opt_groups, params = [], []
    state = optimizer.state
    for opt_group in optimizer.param_groups:
        originals = opt_group["params"]
        if not any(_owned(p) for p in originals):
            continue
        local_params = []
        for p in originals:
            if not _owned(p) or not (p.grad is None or isinstance(p.grad, DTensor)):
                local_params.append(p)
                continue
            local = p._local_tensor
            local.grad = p.grad._local_tensor if p.grad is not None else None
            p_state = state.pop(p, None)
            if p_state is not None:
                state[local] = {k: v._local_tensor if isinstance(v, DTensor) else v for k, v in p_state.items()}
            params.append((p, local, p_state))
            local_params.append(local)
        opt_groups.append((opt_group, originals))
        opt_group["params"] = local_params
    if opt_groups:
        _swapped[id(optimizer)] = (opt_groups, params)


def _to_dtensor(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    swapped = _swapped.pop(id(optimizer), None)
    if swapped is None:
        return
    opt_groups, params = swapped
    for opt_group, originals in opt_groups:
        opt_group["params"] = originals
    state = optimizer.state
    for p, local, old in params:
        local.grad = None
        new = state.pop(local, None)
        if new is not None:
            state[p] = {k: _as_dtensor(v, p, local, old.get(k) if old else None) for k, v in new.items()}


def _as_dtensor(value, param: DTensor, local: torch.Tensor, old):
    """The DTensor form of a state value after the step: the old DTensor if the step updated
    its local tensor in place, a new one for new state shaped like the parameter."""
    if isinstance(old, DTensor) and old._local_tensor is value:
        return old
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())
    return value
