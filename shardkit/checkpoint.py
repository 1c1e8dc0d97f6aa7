"""Checkpoints: sharded (torch.distributed.checkpoint, any world size on load) and full.

A shardkit model's ``state_dict()`` holds sharded DTensors under the unsharded model's keys,
so torch's own tools work on it unchanged: ``torch.distributed.checkpoint`` (DCP) saves each
rank's shards and loads them back on any number of ranks, and the
``torch.distributed.checkpoint.state_dict`` helpers (``get_state_dict``, ``set_state_dict``,
full or sharded) map optimizer state to parameter names. This module adds what a training
job needs around them:

- ``save`` / ``load``: model, optimizer, step, RNG states and your own extras in one DCP
  checkpoint, written to ``<path>.incomplete`` and renamed to ``<path>`` only once every rank
  has written its part, with a ``COMPLETE`` marker inside. A save killed halfway leaves the
  previous checkpoint at ``<path>`` readable; ``load`` refuses a folder without the marker.
- ``full_state_dict`` / ``load_full_state_dict``: plain full tensors on rank 0 (for
  ``torch.save`` or safetensors), gathered and scattered one parameter at a time, so no rank
  ever holds more than one full parameter beyond its shards.

See docs/checkpointing.md for recipes.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

MARKER = "COMPLETE"


class IncompleteCheckpointError(RuntimeError):
    pass


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None, extra: dict | None = None) -> None:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``, ``step``, every rank's RNG
    state, ``extra``) to the folder ``path``; every rank calls it."""
    rank, world = _rank_world()
    staging = path + ".incomplete"
    if rank == 0 and os.path.exists(staging):
        shutil.rmtree(staging)  # left by an interrupted save
    _barrier()
    state = _state(model, optimizer)
    state[f"rng/rank{rank}"] = _rng_state()
    dcp.save(state, checkpoint_id=staging)
    _barrier()  # every rank has written its part
    if rank == 0:
        _publish(staging, path, {"step": step, "extra": extra, "world_size": world, "time": time.time()})
    _barrier()


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, rng: bool = True) -> dict:
    """Load a checkpoint written by ``save`` into ``model`` (and ``optimizer``), on any number
    of ranks; restores this rank's RNG state if the checkpoint has one for it. Returns
    ``{"step": ..., "extra": ..., "world_size": ...}`` as saved."""
    meta = read_marker(path)
    rank, world = _rank_world()
    state = _state(model, optimizer)
    rng_key = f"rng/rank{rank}"
    if rng and meta.get("world_size") == world:
        state[rng_key] = _rng_state()  # a same-shaped placeholder DCP loads into
    dcp.load(state, checkpoint_id=path)
    model_sd, optim_sd = state["model"], state.get("optim")
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:
        model.load_state_dict(model_sd)
    if rng_key in state:
        _set_rng_state(state[rng_key])
    return meta


def read_marker(path: str) -> dict:
    """What ``save`` recorded, or a clear error for a folder that is not a complete checkpoint."""
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        hint = ""
        if os.path.isdir(path + ".incomplete") or path.endswith(".incomplete"):
            hint = " A save into it was interrupted; load the previous checkpoint instead."
        raise IncompleteCheckpointError(
            f"{path} is not a complete shardkit checkpoint: it has no {MARKER} marker.{hint}"
        )
    with open(marker) as f:
        return json.load(f)


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict as full CPU tensors: on rank 0 only (an empty dict elsewhere) or
    on every rank. One all-gather per sharded parameter; every rank calls it."""
    rank, _ = _rank_world()
    keep = rank == 0 or not rank0_only
    out = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()  # a collective: every rank, same order
        if keep:
            out[key] = value.detach().to("cpu", copy=True)
    return out


def load_full_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor] | None, *, from_rank0: bool = True) -> None:
    """Load full tensors into a sharded model. With ``from_rank0`` only rank 0 needs them (pass
    None elsewhere): each parameter is sent from rank 0 and each rank keeps its shard, one
    parameter at a time. Otherwise every rank passes the whole dict and no communication
    happens. Every rank calls it."""
    if not from_rank0:
        model.load_state_dict(state_dict)
        return
    rank, _ = _rank_world()
    own = model.state_dict()
    sharded = {}
    for key, target in own.items():
        if not isinstance(target, DTensor):
            sharded[key] = _broadcast(state_dict[key] if rank == 0 else torch.empty_like(target), target.device)
            continue
        full = state_dict[key] if rank == 0 else torch.empty(target.shape, dtype=target.dtype)
        full = full.to(target.device, target.dtype)
        # Rank 0's tensor, split by the parameter's placements: scatter-like, one parameter at a time.
        sharded[key] = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=0)
    model.load_state_dict(sharded)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": model.state_dict()}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _publish(staging: str, path: str, meta: dict) -> None:
    """Mark the staged checkpoint complete and put it in place of the old one."""
    with open(os.path.join(staging, MARKER), "w") as f:
        json.dump(meta, f)
    old = path + ".old"
    if os.path.exists(path):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(path, old)  # between these two renames, <path>.old is the good one
    os.rename(staging, path)
    if os.path.exists(old):
        shutil.rmtree(old)


def _rng_state() -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor) -> None:
    torch.set_rng_state(state.to("cpu", torch.uint8))


def _broadcast(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = t.to(device)
    if dist.is_initialized():
        dist.broadcast(t, src=0)
    return t


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
