"""Pretrained weights in the Hugging Face layout, read straight into shards and written back.

``load_pretrained(model, path)`` reads safetensors (one file, or the shards of a
``model.safetensors.index.json``) into a sharded model: each rank reads only the bytes of the
part of each tensor it holds (its rows under FSDP, its block under FSDP x TP), with
positional reads straight into its local tensors, and no collective. Nothing is
materialized in full, a model built on the meta device included. (Not a memory map: the
pages of a mapped file count in the rank's resident memory while it is open, about the
rank's share of the file again.) ``save_pretrained(model, dir)`` writes the same layout back:
each tensor goes whole to one owner rank (``shardkit.optim.owners``, one packed all-to-all
per mesh and dtype), which streams it into its own file; rank 0 writes the index.

The format is small (an 8-byte header length, a JSON header of each tensor's dtype, shape and
byte range, then the raw little-endian bytes), so shardkit reads and writes it itself: no
dependency; tests/unit/test_pretrained_api.py checks both ways against the safetensors package.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from shardkit.checkpoint.errors import CheckpointError, CorruptCheckpointError, ModelMismatchError
from shardkit.core.meshes import mesh_device
from shardkit.optim.owners import Matrix, OwnerCompute, Piece, _splits, pieces

__all__ = ["load_pretrained", "save_pretrained"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
KeyMap = Mapping[str, str] | Callable[[str], str | None] | None


# Reading ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Entry:
    """One tensor of the files: where it is and what its header says."""

    key: str  # the key in the file
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # the tensor's first byte in the file


def _files(path: str) -> list[str]:
    """The safetensors files ``path`` names: a file, an index, or a folder holding either."""
    if os.path.isdir(path):
        for name in (INDEX, SINGLE):
            if os.path.exists(os.path.join(path, name)):
                return _files(os.path.join(path, name))
        raise CheckpointError(path, _rank(), f"holds neither {INDEX} nor {SINGLE}")
    if not os.path.exists(path):
        raise CheckpointError(path, _rank(), "does not exist")
    if not path.endswith(".json"):
        return [path]
    try:
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(path, _rank(), f"is not a safetensors index (a JSON object with a 'weight_map'): {e}") from e
    folder = os.path.dirname(path)
    files = sorted(set(weight_map.values()))
    for name in files:
        if not os.path.exists(os.path.join(folder, name)):
            raise CheckpointError(path, _rank(), f"names {name}, which is not in {folder or '.'}")
    return [os.path.join(folder, name) for name in files]


def _header(file: str) -> tuple[dict, int]:
    """The file's header and where its data starts, checked against its size: a truncated or
    corrupt file fails here, naming itself, before any tensor is read."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ValueError(f"its header claims {n} bytes, the file has {size}")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(file, _rank(), f"is not a safetensors file (truncated or corrupt): {e}") from e
    header.pop("__metadata__", None)
    end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if 8 + n + end != size:
        raise CorruptCheckpointError(
            file, _rank(), f"is truncated or corrupt: its header places tensors up to byte {8 + n + end}, the file has {size} bytes"
        )
    return header, 8 + n


def _entries(path: str) -> dict[str, _Entry]:
    out: dict[str, _Entry] = {}
    for file in _files(path):
        header, data = _header(file)
        for key, info in header.items():
            if key in out:
                raise CorruptCheckpointError(path, _rank(), f"key {key!r} is in both {out[key].file} and {file}")
            dtype = _FROM_NAME.get(info.get("dtype"))
            if dtype is None:
                raise CorruptCheckpointError(file, _rank(), f"{key}: dtype {info.get('dtype')!r} is not one torch holds")
            shape, (begin, end) = tuple(info["shape"]), info["data_offsets"]
            if end - begin != math.prod(shape) * dtype.itemsize:
                raise CorruptCheckpointError(file, _rank(), f"{key}: {end - begin} bytes for a {info['dtype']} tensor of shape {list(shape)}")
            out[key] = _Entry(key, file, dtype, shape, data + begin)
    return out


def _mapper(key_map: KeyMap) -> Callable[[str], str | None]:
    """File key -> model key. A mapping renames prefixes (the longest that matches wins; an
    empty target drops the prefix); a callable returns the model key, or None to skip it."""
    if key_map is None:
        return lambda k: k
    if callable(key_map):
        return key_map
    prefixes = sorted(key_map, key=len, reverse=True)

    def rename(key: str) -> str:
        for prefix in prefixes:
            if key.startswith(prefix):
                return key_map[prefix] + key[len(prefix) :]
        return key

    return rename


def _targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
    """The model's state-dict tensors by key (the parameters and buffers themselves, so that
    a copy into them lands) and, for each key, the keys tied to it (one tensor, several names)."""
    state = model.state_dict(keep_vars=True)  # (the state-dict hooks reshard first)
    by_id: dict[int, list[str]] = {}
    for key, t in state.items():
        by_id.setdefault(id(t), []).append(key)
    return state, {key: by_id[id(t)] for key, t in state.items()}


def load_pretrained(model: nn.Module, path: str, strict: bool = True, key_map: KeyMap = None) -> _IncompatibleKeys:
    """Read a safetensors checkpoint (a file, a ``model.safetensors.index.json``, or a folder
    holding either) into ``model``'s parameters and buffers, in place. Every rank calls it;
    each reads only the part of each tensor it holds, no collective runs.

    - Works on any sharding: shardkit's or FSDP2's ``fully_shard``, HSDP, FSDP x TP,
      per-parameter meshes, plain (unsharded) tensors. A model on the meta device is first
      materialized shard by shard (``model.to_empty``); its non-persistent buffers (not in
      the file) stay on the meta device, for you to initialize.
    - Values are cast to each parameter's dtype. Weights tied in the model (one tensor,
      several keys) need only one of their keys in the file.
    - ``key_map`` maps the file's keys to the model's: ``{"model.": ""}`` renames prefixes,
      or a function ``file_key -> model_key`` (None skips the key).
    - ``strict``: missing or unexpected keys raise ``ModelMismatchError``, listing them, before
      anything is read (``strict=False`` returns them, as ``load_state_dict`` does); a shape
      that differs always raises. A truncated or corrupt file raises
      ``CorruptCheckpointError`` naming it.
    """
    _little_endian()
    entries = _entries(path)
    rename = _mapper(key_map)
    state, tied = _targets(model)
    by_model_key: dict[str, _Entry] = {}
    unexpected = []
    for key, entry in entries.items():
        target = rename(key)
        if target is None:
            continue
        if target in state and target not in by_model_key:
            by_model_key[target] = entry
        else:
            unexpected.append(key)
    missing = [k for k in state if not any(t in by_model_key for t in tied[k])]
    shapes = [f"{k}: the file has {list(e.shape)} ({e.file}), the model {list(state[k].shape)}"
              for k, e in by_model_key.items() if tuple(state[k].shape) != e.shape]
    if shapes or (strict and (missing or unexpected)):
        named = [k if rename(k) == k else f"{k} (as {rename(k)})" for k in unexpected]
        raise ModelMismatchError(path, _rank(), _mismatch(missing if strict else [], named if strict else [], shapes))
    if any(t.device.type == "meta" for t in state.values()) or _meta_buffers(model):
        _materialize(model)
        state, tied = _targets(model)
    by_file: dict[str, list[tuple[str, _Entry]]] = {}
    for k, entry in by_model_key.items():
        by_file.setdefault(entry.file, []).append((k, entry))
    with torch.no_grad():
        for file, items in by_file.items():
            with open(file, "rb", buffering=0) as f:
                for k, entry in items:
                    _read_into(f.fileno(), entry, state[k], k)
    return _IncompatibleKeys(missing, unexpected)


def _read_into(fd: int, entry: _Entry, target: torch.Tensor, key: str) -> None:
    """This rank's part of ``entry`` into ``target`` (a parameter or buffer, sharded or not)."""
    if isinstance(target, DTensor):
        coordinate = target.device_mesh.get_coordinate()
        if coordinate is None:
            return  # this rank is not on the tensor's mesh: it holds none of it
        piece = pieces(entry.shape, target.device_mesh, target.placements, [tuple(coordinate)], key)[0]
        local = target._local_tensor
    else:
        piece = Piece(tuple(slice(0, n) for n in entry.shape), entry.shape)
        local = target
    if tuple(local.shape) != piece.shape:
        raise ModelMismatchError(
            entry.file, _rank(), f"{key}: this rank holds a local tensor of shape {list(local.shape)}, but placements "
            f"{list(getattr(target, 'placements', []))} of {list(entry.shape)} give it {list(piece.shape)}"
        )
    if piece.numel == 0:
        return
    direct = local.dtype == entry.dtype and local.device.type == "cpu" and local.is_contiguous() and type(local) is torch.Tensor
    out = local if direct else torch.empty(piece.shape, dtype=entry.dtype)  # (a cast or a device copy: one piece at a time)
    _read_piece(fd, entry, piece.index, out)
    if not direct:
        local.copy_(out)


def _read_piece(fd: int, entry: _Entry, index: tuple, out: torch.Tensor) -> None:
    """The bytes of ``entry`` at ``index`` (per dim: a range, or increasing positions of a
    ``_StridedShard``) into ``out``, in order: one read per contiguous run, that is per run of
    the last dim that is not held whole, for each position of the dims before it."""
    shape, size = entry.shape, entry.dtype.itemsize
    positions = [range(ix.start, ix.stop) if isinstance(ix, slice) else ix.tolist() for ix in index]
    for dim, p in enumerate(positions):
        if any(b <= a for a, b in zip(p, p[1:])):
            raise ValueError(f"{entry.key}: this rank holds positions {list(p)} of dim {dim}, not in increasing order")
    partial = [d for d, p in enumerate(positions) if len(p) != shape[d]]
    last = partial[-1] if partial else 0
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    runs = _runs(positions[last]) if shape else [range(0, 1)]
    dst = (ctypes.c_char * (out.numel() * size)).from_address(out.data_ptr())
    view, at = memoryview(dst).cast("B"), 0
    for prefix in itertools.product(*positions[:last]):
        base = sum(p * strides[d] for d, p in enumerate(prefix))
        for run in runs:
            start = (base + run.start * (strides[last] if shape else 1)) * size
            n = len(run) * (strides[last] if shape else 1) * size
            _pread_exactly(fd, view[at : at + n], entry.begin + start, entry)
            at += n
    assert at == len(view), (entry.key, at, len(view))


def _pread_exactly(fd: int, into: memoryview, offset: int, entry: _Entry) -> None:
    while len(into):
        got = os.preadv(fd, [into], offset)
        if got == 0:
            raise CorruptCheckpointError(entry.file, _rank(), f"ended inside tensor {entry.key} (truncated while being read)")
        into, offset = into[got:], offset + got


def _runs(positions) -> list[range]:
    """Increasing positions as maximal ranges: [0, 1, 4, 5] -> [0:2, 4:6]."""
    if isinstance(positions, range):
        return [positions]
    out, start = [], positions[0]
    for a, b in zip(positions, list(positions[1:]) + [None]):
        if b != a + 1:
            out.append(range(start, a + 1))
            start = b
    return out


def _meta_buffers(model: nn.Module) -> bool:
    return any(b.device.type == "meta" for b in model.buffers())


def _materialize(model: nn.Module) -> None:
    """``to_empty`` on the meshes' device: each rank allocates only its shards. Non-persistent
    buffers (not in any file) go back to the meta device, so that a forward that needs them
    fails loudly instead of reading uninitialized memory."""
    devices = {mesh_device(t.device_mesh) for t in model.parameters() if isinstance(t, DTensor)}
    device = devices.pop() if len(devices) == 1 else torch.device("cpu")
    left = []
    kept: list[tuple[nn.Module, str]] = []
    for name, module in model.named_modules():
        for b in getattr(module, "_non_persistent_buffers_set", ()):
            buf = module._buffers.get(b)
            if buf is not None and buf.device.type == "meta":
                kept.append((module, b))
                left.append(f"{name}.{b}" if name else b)
    model.to_empty(device=device)
    for module, b in kept:
        module._buffers[b] = torch.empty_like(module._buffers[b], device="meta")
    if left:
        warnings.warn(
            f"shardkit.checkpoint.load_pretrained: the model was on the meta device; its non-persistent buffers "
            f"{left} are not in any file and stay on the meta device: initialize them before the first forward.",
            stacklevel=3,
        )


def _mismatch(missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"missing from the file ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        parts.append(f"in the file but not in the model ({len(unexpected)}): {', '.join(unexpected)}")
    if shapes:
        parts.append("shapes differ: " + "; ".join(shapes))
    return "does not match the model: " + ". ".join(parts) + (
        ". Pass key_map to rename keys, or strict=False to load the rest." if missing or unexpected else "."
    )


# Writing ------------------------------------------------------------------------------------
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.float8_e8m0fnu: "F8_E8M0",
    torch.complex64: "C64",
}
_FROM_NAME = {name: dtype for dtype, name in _DTYPES.items()}


def save_pretrained(model: nn.Module, save_directory: str, *, dtype: torch.dtype | None = None) -> None:
    """Write ``model``'s state dict to ``save_directory`` in the Hugging Face layout: one
    safetensors file per rank that owns tensors (``model-0000k-of-0000n.safetensors``) and
    ``model.safetensors.index.json``; one rank alone writes ``model.safetensors``. Every rank
    calls it. No rank holds the full model: each tensor is gathered whole on one owner rank
    only (owners balanced by bytes), which streams it to its file. Tied weights are written
    once, under their first key; ``dtype`` casts floating-point tensors. A model with a
    Hugging Face ``config`` also gets its ``config.json`` (``from_pretrained`` needs it)."""
    _little_endian()
    state, tied = _targets(model)
    keys = [k for k in state if tied[k][0] == k]
    values = [state[k].detach() for k in keys]
    if dtype is not None:
        values = [v.to(dtype) if v.is_floating_point() else v for v in values]
    rank, world = _rank(), _world()
    matrices = [_matrix(v, k) for k, v in zip(keys, values)]
    gatherer = OwnerCompute(cost=lambda shape: float(torch.Size(shape).numel()), bucket_bytes=256 << 20, name="save_pretrained")
    gathered = [keys[i] for i in gatherer.owned_here(matrices)]
    whole = _whole_owned_here(keys, values, matrices, rank, world)
    claims = _all_gather([(k, tuple(state[k].shape)) for k in gathered + whole])
    # A tensor on a sub-mesh (FSDP x TP's dp-only norms and embeddings) has an owner in each copy
    # of that mesh (one per tp rank), all holding the same values: the lowest rank writes it.
    first = {}
    for r, keys_r in enumerate(claims):
        for k, _ in keys_r:
            first.setdefault(k, r)
    owners = [[(k, shape) for k, shape in keys_r if first[k] == r] for r, keys_r in enumerate(claims)]
    mine = [k for k, _ in owners[rank]]  # this rank's file, in the order it is written
    writes = set(mine)
    writers = [r for r in range(world) if owners[r]]
    names = {r: SINGLE if len(writers) == 1 else f"model-{n + 1:05d}-of-{len(writers):05d}.safetensors" for n, r in enumerate(writers)}
    os.makedirs(save_directory, exist_ok=True)
    value_of = dict(zip(keys, values))
    writer = _Writer(os.path.join(save_directory, names[rank]), [(k, value_of[k]) for k in mine]) if mine else None
    gatherer.gather(matrices, lambda i, full: writer.write(keys[i], full) if keys[i] in writes else None)
    for k in whole:
        if k in writes:
            writer.write(k, _local_whole(value_of[k]))
    if writer is not None:
        writer.close()
    _barrier()
    if rank == 0:
        if len(writers) > 1:
            total = sum(torch.Size(shape).numel() * value_of[k].dtype.itemsize for r in writers for k, shape in owners[r])
            index = {"metadata": {"total_size": total}, "weight_map": {k: names[r] for r in writers for k, _ in sorted(owners[r])}}
            _write_json(os.path.join(save_directory, INDEX), index)
        config = getattr(model, "config", None)
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(save_directory)
    _barrier()


def _matrix(value: torch.Tensor, key: str) -> Matrix:
    """A tensor to gather whole: sharded on some mesh dim, or (mesh None) held whole by every rank."""
    if isinstance(value, DTensor):
        for dim, p in enumerate(value.placements):
            if p.is_partial():
                raise ValueError(f"save_pretrained: {key} is Partial on mesh dim {dim}; reduce it first")
        if value.device_mesh.size() > 1 and any(_splits(p) for p in value.placements):
            return Matrix(value._local_tensor, value.shape, value.device_mesh, tuple(value.placements), key)
        return Matrix(value._local_tensor, value.shape, None, (), key)
    return Matrix(value, value.shape, None, (), key)


def _whole_owned_here(keys, values, matrices, rank: int, world: int) -> list[str]:
    """Tensors every rank holds whole, spread over the ranks by bytes (the same on every rank)."""
    load = [0] * world
    mine = []
    whole = [i for i, m in enumerate(matrices) if m.mesh is None]
    for i in sorted(whole, key=lambda i: (-values[i].numel() * values[i].dtype.itemsize, i)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += values[i].numel() * values[i].dtype.itemsize
        if owner == rank:
            mine.append(keys[i])
    return sorted(mine, key=keys.index)


def _local_whole(value: torch.Tensor) -> torch.Tensor:
    return value._local_tensor if isinstance(value, DTensor) else value


class _Writer:
    """One safetensors file written tensor by tensor: the header first (the shapes and dtypes
    are known), then each tensor's bytes as it arrives, into ``<file>.incomplete``, renamed
    when the last one is in."""

    def __init__(self, file: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.file, self.order, self.next = file, [k for k, _ in tensors], 0
        header, offset = {}, 0
        for key, t in tensors:
            if t.dtype not in _DTYPES:
                raise TypeError(f"save_pretrained: {key} has dtype {t.dtype}, which safetensors does not store")
            n = t.numel() * t.dtype.itemsize
            header[key] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            offset += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.out = open(file + ".incomplete", "wb")
        self.out.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, key: str, full: torch.Tensor) -> None:
        expected = self.order[self.next]
        assert key == expected, f"save_pretrained: wrote {key} where {expected} was next"
        self.next += 1
        data = full.detach().to("cpu").contiguous()
        if data.numel():
            self.out.write((ctypes.c_char * (data.numel() * data.element_size())).from_address(data.data_ptr()))

    def close(self) -> None:
        assert self.next == len(self.order), f"save_pretrained: {len(self.order) - self.next} tensors of {self.file} not written"
        self.out.close()
        os.replace(self.file + ".incomplete", self.file)


def _write_json(file: str, obj: dict) -> None:
    with open(file + ".incomplete", "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(file + ".incomplete", file)


def _little_endian() -> None:
    if sys.byteorder != "little":
        raise NotImplementedError("shardkit.checkpoint: safetensors files are little-endian; this machine is not")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
