"""When users replace what ``fully_shard`` registered on their modules.

- ``module._apply`` (``.to(...)``, ``to_empty``) swaps the sharded parameter's data:
  ``reset_from_registered`` re-derives the padded shard from it.
- Before the first forward a parameter may be assigned anew (``m.w = nn.Parameter(t)``, or
  ``load_state_dict(sd, assign=True)`` after meta-device init): ``adopt`` takes it at lazy
  init, as FSDP2 does.
- ``load_state_dict`` with full tensors: ``from_full`` cuts this rank's shard of each.
- During forward a module may change its own parameter's data (``self.classifier =
  self.classifier.to(torch.float32)``): ``follow`` follows it at every unshard. A new
  Parameter object there cannot be followed: ``check_held`` raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from shardkit.dtensor import extension
from shardkit.dtensor.placements import to_dtensor

if TYPE_CHECKING:
    from shardkit.dtensor.sharded_param import ShardedParam


def reset_from_registered(p: "ShardedParam") -> None:
    """Re-derive the padded shard after ``module._apply`` (``to_empty``, ``.to``) swapped its data."""
    registered = p.slots[0].module._parameters[p.slots[0].name]
    local = registered._local_tensor
    if local.device.type == "meta":
        padded = local.new_empty(p.padded_shape)
    elif _backs(p.padded_shard, local):
        padded = p.padded_shard  # nothing moved
    elif type(local) is torch.Tensor and local.shape == p.padded_shape and local.is_contiguous():
        padded = local  # no padding to add: keep the new tensor (to_empty's pages stay untouched)
    else:
        padded = local.new_zeros(p.padded_shape)
        with torch.no_grad():
            p._valid(padded).copy_(local)
        registered._local_tensor = p._valid(padded)
    # Keep the registered Parameter object (the optimizer may already hold it).
    p.padded_shard, p.sharded_param = padded, registered
    if local.dtype != p.dtype:  # .to(dtype): mixed-precision dtypes that followed the old one follow the new
        p.param_dtype = local.dtype if p.param_dtype == p.dtype else p.param_dtype
        p.reduce_dtype = local.dtype if p.reduce_dtype == p.dtype else p.reduce_dtype
    p.dtype, p.spec = local.dtype, registered._spec
    p.unsharded_param = p.unsharded_flat = None
    p.extension = extension.of(local, p.fqn)


def adopt(p: "ShardedParam") -> None:
    """At lazy init: take what the module holds if it is no longer our sharded parameter. A
    DTensor like ours is adopted; a full tensor (FSDP2 raises) is sharded into a new one."""
    slot = p.slots[0]
    registered = slot.module._parameters[slot.name]
    if registered is p.sharded_param or registered is p.unsharded_param:
        return  # ours (unsharded: an explicit unshard() before the first forward)
    where = f"{type(slot.module).__name__}.{slot.name} (parameter '{p.fqn}')"
    if isinstance(registered, DTensor):
        if (registered.shape, registered.placements) != (p.sharded_param.shape, p.spec.placements):
            raise ValueError(
                f"shardkit: {where} was replaced after fully_shard by a DTensor {list(registered.placements)} of "
                f"shape {tuple(registered.shape)}; expected {list(p.spec.placements)} of shape "
                f"{tuple(p.sharded_param.shape)} (a state dict of the same model, sharded the same way)."
            )
        reset_from_registered(p)
    elif p.tp_spec is None and registered.shape == p.shape:
        p._init_requires_grad = registered.requires_grad
        p._shard(registered.detach(), p.device)  # a new Parameter (DTensor has slots: no swap_tensors)
        registered._shardkit_replaced = True  # an optimizer holding it warns at its first step
    else:
        raise ValueError(
            f"shardkit: {where} was replaced after fully_shard by a tensor of shape {tuple(registered.shape)}; "
            f"it can take a full tensor of shape {tuple(p.shape)} before the first forward."
        )
    p.sharded_param._shardkit_owned = True
    for s in p.slots:
        s.module._parameters[s.name] = p.sharded_param


def follow(p: "ShardedParam") -> None:
    """Before the unsharded parameter is registered again: if the module gave it other data
    during a forward (HF
    SwitchTransformers' router runs ``self.classifier = self.classifier.to(torch.float32)``,
    which sets ``param.data`` to an fp32 copy): it no longer views the all-gather buffer.
    Keep the module's choice of dtype and device, and refill it with what was just gathered,
    so that no step computes with an earlier step's values. (``.data``: autograd does not
    see this as an in-place edit; within a step the values are the same.)"""
    if p.extension is not None or p.tp_spec is not None or p.unsharded_param.untyped_storage()._cdata == p._flat_storage:
        return
    data = p.unsharded_param.data
    gathered = p.unsharded_padded.narrow(p.dim, 0, p.shape[p.dim])
    if data.shape != gathered.shape:
        raise RuntimeError(
            f"shardkit: parameter '{p.fqn}' of {type(p.slots[0].module).__name__} was given data of shape "
            f"{tuple(data.shape)} during forward, but it has shape {tuple(gathered.shape)}; shardkit can follow a "
            "change of dtype or device only. Reshape a copy instead of the parameter."
        )
    data.copy_(gathered)


def from_full(p: "ShardedParam", full: torch.Tensor) -> DTensor:
    """This rank's shard of a full (unsharded, global) tensor, as a DTensor like the sharded
    parameter: for ``load_state_dict`` of plain tensors. No communication."""
    if p.tp_spec is not None:  # the TP-local part first, as tensor parallel would have it
        full = distribute_tensor(full, p.tp_spec.mesh, p.tp_spec.placements, src_data_rank=None)._local_tensor
    return to_dtensor(p._my_rows(full).to(p.shard_device, p.dtype), p.spec)


def check_held(p: "ShardedParam") -> None:
    """Before resharding: the modules still hold our unsharded parameter (or the sharded one)."""
    for slot in p.slots:
        held = slot.module._parameters.get(slot.name)
        if held is not p.unsharded_param and held is not p.sharded_param:
            raise RuntimeError(
                f"shardkit: {type(slot.module).__name__}.{slot.name} (parameter '{p.fqn}') was replaced by a "
                "new object while unsharded, e.g. `module.weight = nn.Parameter(...)` in forward. shardkit would "
                "lose its gradient and keep training the old one. Change the parameter's data instead "
                "(`module.to(dtype)` is followed), or use a plain tensor attribute for the copy."
            )


def _backs(padded: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether ``padded`` still holds ``local``'s data (an empty local shard has no pointer)."""
    if padded.device != local.device or padded.dtype != local.dtype:
        return False
    return local.numel() == 0 or padded.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
