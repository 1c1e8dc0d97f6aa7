"""Checkpoints: sharded (torch.distributed.checkpoint, any world size on load) and full.

A shardkit model's ``state_dict()`` holds sharded DTensors under the unsharded model's keys,
so torch's own tools work on it unchanged: ``torch.distributed.checkpoint`` (DCP) saves each
rank's shards and loads them back on any number of ranks. This package adds what a training
job needs around them:

- ``save`` / ``load``: model, optimizer, step, RNG states and your own extras in one DCP
  checkpoint, written to ``<path>.incomplete`` and renamed to ``<path>`` only once every rank
  has written its part, with a ``COMPLETE`` marker (``manifest.py``: sizes and CRC-32s of
  everything written) inside. ``save(..., async_save=True)`` writes in the background.
- ``load`` reads nothing that can run code (``trust.py``), checks what it reads against the
  manifest, and fails only with ``CheckpointError``s that say what is wrong and what would
  load (``errors.py``); ``latest(root)`` finds the newest complete checkpoint.
- ``full_state_dict`` / ``load_full_state_dict``: plain full tensors on rank 0 (for
  ``torch.save`` or safetensors), gathered and scattered one parameter at a time, so no rank
  ever holds more than one full parameter beyond its shards.
- ``load_pretrained`` / ``save_pretrained`` (``pretrained.py``): safetensors in the Hugging
  Face layout, read straight into the shards (each rank reads only what it holds) and
  written back with each tensor whole on one rank only.

See docs/checkpointing.md for recipes.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from shardkit.checkpoint import manifest, trust
from shardkit.checkpoint.errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ModelMismatchError,
    UnsafeCheckpointError,
)
from shardkit.checkpoint.manifest import MARKER, latest
from shardkit.checkpoint.pretrained import load_pretrained, save_pretrained

__all__ = [
    "save", "load", "latest", "read_marker", "full_state_dict", "load_full_state_dict", "load_pretrained", "save_pretrained",
    "MARKER", "CheckpointError",
    "IncompleteCheckpointError", "CorruptCheckpointError", "UnsafeCheckpointError", "ModelMismatchError",
]
_FAILURES = (Exception, CheckpointException)  # torch's CheckpointException is a BaseException
_in_flight: Future | None = None  # the last asynchronous save


def save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, step: int | None = None, extra: dict | None = None, async_save: bool = False) -> Future | None:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``, ``step``, every rank's RNG
    state, ``extra``) to the folder ``path``; every rank calls it. With ``async_save=True`` it
    returns a ``Future`` once the state is copied to host memory: the files are written, and the
    checkpoint published, in the background (``future.result()`` waits, and raises its error)."""
    rank, world = _rank_world()
    staging = path + ".incomplete"
    global _in_flight
    if _in_flight is not None:  # one save at a time: the previous asynchronous one finishes first
        _in_flight.result()
    with _failures(path, rank, "saving"):
        if rank == 0 and os.path.exists(staging):
            shutil.rmtree(staging)  # left by an interrupted save
        _barrier()
        state = _state(model, optimizer)
        state[f"rng/rank{rank}"] = _rng_state()
        meta = {"step": step, "extra": extra, "world_size": world, "time": time.time()}
        writer = FileSystemWriter(staging)
        writer.fs = manifest.SummingFileSystem()  # checksums while writing
        if not async_save:
            dcp.save(state, storage_writer=writer)
            _finish_save(staging, path, meta, rank, None, writer.fs.sums)
            return None
        group = _checkpoint_group()
        writing = dcp.async_save(state, storage_writer=writer, process_group=group)
    done: Future = Future()

    def finish() -> None:
        try:
            with _failures(path, rank, "saving"):
                writing.result()
                _finish_save(staging, path, meta, rank, group, writer.fs.sums)
            done.set_result(None)
        except BaseException as exc:  # handed to whoever waits on the future
            done.set_exception(exc)

    threading.Thread(target=finish, name=f"shardkit-save-{os.path.basename(path)}", daemon=True).start()
    _in_flight = done
    return done


def _finish_save(staging: str, path: str, meta: dict, rank: int, group, sums: dict) -> None:
    """Once every rank's files are written: gather their checksums (each rank its own), then
    rank 0 publishes the manifest and renames the folder into place."""
    files = _all_gather(manifest.own_files(staging, rank, sums), group)
    if rank == 0:
        meta["files"] = {name: sums for ranks in files for name, sums in ranks.items()}
        meta["files"][".metadata"] = manifest.checksum(os.path.join(staging, ".metadata"))
        _publish(staging, path, meta)
    _barrier(group)


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, rng: bool = True) -> dict:
    """Load a checkpoint written by ``save`` into ``model`` (and ``optimizer``), on any number
    of ranks; restores this rank's RNG state if the checkpoint has one for it. Returns
    ``{"step": ..., "extra": ..., "world_size": ...}`` as saved. Every file is checked against
    the manifest first, and nothing in the folder can run code (``trust.py``)."""
    rank, world = _rank_world()
    with _failures(path, rank, "loading"):
        meta = manifest.read(path, rank)
        _verify(path, meta, rank, world)
        reader = trust.SafeReader(path, meta.get("files"))
        try:
            metadata = reader.read_metadata()
        except trust.Refused as exc:
            raise UnsafeCheckpointError(path, rank, f".metadata asks to import {exc}, which a checkpoint never needs; nothing was run. Load only checkpoints you trust to be shardkit's.") from exc
        state = _state(model, optimizer)
        _check_model(path, rank, metadata, state["model"])
        rng_key = f"rng/rank{rank}"
        if rng and meta.get("world_size") == world:
            state[rng_key] = _rng_state()  # a same-shaped placeholder DCP loads into
        try:
            dcp.load(state, storage_reader=reader, planner=trust.SafePlanner())
        except CheckpointException as exc:
            damaged = [e for e, _ in exc.failures.values() if isinstance(e, trust.Damaged)]
            if damaged:  # found as the items were read: the model is partly loaded
                raise CorruptCheckpointError(path, rank, f"{damaged[0]} The model is partly loaded: load a good checkpoint into it.{manifest.hint(path)}") from exc
            raise
        model_sd, optim_sd = state["model"], state.get("optim")
        if optimizer is not None:
            set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
        else:
            model.load_state_dict(model_sd)
        if rng_key in state:
            _set_rng_state(state[rng_key])
    return meta


def read_marker(path: str) -> dict:
    """What ``save`` recorded, or a ``CheckpointError`` saying why ``path`` would not load."""
    return manifest.read(path, _rank_world()[0])


def _verify(path: str, meta: dict, rank: int, world: int) -> None:
    """Each rank checks its share of the files; all raise if any is damaged."""
    if "files" not in meta:
        return  # written before checksums existed
    names = sorted(meta["files"])
    problems = [p for p in _all_gather(manifest.verify(path, meta, names[rank::world], rank), None) if p]
    if problems:
        raise CorruptCheckpointError(path, rank, f"{problems[0]} Do not load it.{manifest.hint(path)}")


def _check_model(path: str, rank: int, metadata, model_sd: dict) -> None:
    """The model's keys and shapes against the checkpoint's, all differences listed at once."""
    saved = {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.")}
    missing = sorted(set(model_sd) - set(saved))
    unexpected = sorted(set(saved) - set(model_sd))
    shapes = sorted(
        f"{k}: checkpoint {tuple(saved[k].size)}, model {tuple(v.shape)}"
        for k, v in model_sd.items()
        if k in saved and isinstance(v, torch.Tensor) and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(v.shape)
    )
    if missing or unexpected or shapes:
        parts = [f"{what} {items}" for what, items in [("missing from the checkpoint:", missing), ("not in the model:", unexpected), ("other shapes:", shapes)] if items]
        raise ModelMismatchError(path, rank, "was saved from another model; " + "; ".join(parts) + ".")


class _failures:
    """Every failure inside becomes a ``CheckpointError`` naming the path and rank, cause chained."""

    def __init__(self, path: str, rank: int, doing: str) -> None:
        self.path, self.rank, self.doing = path, rank, doing

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or isinstance(exc, CheckpointError) or not isinstance(exc, _FAILURES):
            return False
        raise CheckpointError(self.path, self.rank, f"{self.doing} failed: {_describe(exc)}") from exc


def _describe(exc: BaseException) -> str:
    """One line: torch's CheckpointException carries each failed rank's exception and traceback."""
    if isinstance(exc, CheckpointException) and exc.failures:
        ranks = sorted(exc.failures)
        first = exc.failures[ranks[0]][0]
        return f"{type(first).__name__}: {first} (on ranks {ranks}; the cause holds each rank's traceback)"
    return f"{type(exc).__name__}: {exc}"


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
    manifest.write(staging, meta)
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


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _all_gather(obj: Any, group) -> list:
    """Every rank's ``obj`` (small: checksums, a message)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


_group = None


def _checkpoint_group():
    """A gloo group of every rank for the background half of an asynchronous save, so that its
    collectives never interleave with training's on the default group (made at the first one)."""
    global _group
    if _group is None and dist.is_initialized():
        _group = dist.new_group(backend="gloo")
    return _group
