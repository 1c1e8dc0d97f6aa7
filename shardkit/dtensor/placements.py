"""Sharding math: how many rows of a parameter each rank holds, and the DTensor placements of
the sharded parameters (1-D, HSDP, dp x tp).

We shard dim 0 like ``torch.chunk`` (and like DTensor's ``Shard(0)``): every rank but the
last few holds ``ceil(rows / world)`` rows, the tail ranks hold fewer or none. For the
collectives every rank's shard is padded to that same ``padded_rows`` so all-gather inputs
and reduce-scatter outputs have equal sizes on every rank.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard


def padded_rows(rows: int, world: int) -> int:
    """Rows of every rank's padded shard: ``ceil(rows / world)``."""
    return math.ceil(rows / world) if rows else 0


def local_rows(rows: int, world: int, rank: int) -> int:
    """Rows that ``rank`` really holds (``torch.chunk`` semantics), 0 for empty tail ranks."""
    per_rank = padded_rows(rows, world)
    return max(0, min(per_rank, rows - rank * per_rank))


def chunk_sizes(rows: int, world: int) -> list[int]:
    """Rows per rank: ``chunk_sizes(13, 3) == [5, 5, 3]``, ``chunk_sizes(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]``."""
    return [local_rows(rows, world, rank) for rank in range(world)]


def row_numel(shape: tuple[int, ...]) -> int:
    """Elements in one dim-0 row of a tensor of ``shape``."""
    return math.prod(shape[1:])


_dp_tp_meshes: dict = {}  # (dp mesh, tp mesh) ids -> their concatenation, made once


def sharded_spec(mesh: DeviceMesh, tp_spec: DTensorSpec | None, shape: torch.Size, dtype: torch.dtype, dim: int, spmd, where: str) -> DTensorSpec:
    """The sharded parameter's spec: of a plain parameter (``dp_spec``), of a tensor-parallel
    one (``dp_tp_spec``), or of one on a full SPMD mesh (``spmd_spec``)."""
    if spmd is not None:
        if tp_spec is None:
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...): {where} is a plain tensor; with dp_mesh_dims every parameter "
                "must be a DTensor on the full mesh (Replicate() on the data-parallel dims), e.g. via "
                "distribute_tensor or parallelize_module."
            )
        return spmd_spec(spmd, tp_spec, dim, where)
    return dp_spec(mesh, shape, dtype, dim) if tp_spec is None else dp_tp_spec(mesh, tp_spec, dim, where)


def dp_spec(mesh: DeviceMesh, shape: torch.Size, dtype: torch.dtype, dim: int) -> DTensorSpec:
    """``Shard(dim)`` over a 1-D mesh; ``(Replicate(), Shard(dim))`` over a 2-D one (HSDP)."""
    placements = (Replicate(),) * (mesh.ndim - 1) + (Shard(dim),)
    return DTensorSpec(mesh, placements, TensorMeta(shape, contiguous_stride(shape), dtype))


def dp_tp_spec(dp_mesh: DeviceMesh, tp_spec: DTensorSpec, dim: int, where: str) -> DTensorSpec:
    """The sharded parameter's spec on the data-parallel mesh (1-D, or 2-D for HSDP) followed by
    the parameter's own mesh (tensor or expert parallel, 1-D or 2-D): dp splits the TP-local
    tensor, a ``_StridedShard`` where the parameter's placements already split that dim."""
    if tp_spec.mesh.ndim > 2:
        raise NotImplementedError(
            f"{where} is a DTensor on the {tp_spec.mesh.ndim}-D mesh {tp_spec.mesh}; fully_shard composes with "
            "tensor or expert parallel over 1 or 2 mesh dims (as FSDP2). Put the parameter on those dims only, "
            "or pass the full mesh with dp_mesh_dims=DataParallelMeshDims(...)."
        )
    shared = set(dp_mesh.mesh.flatten().tolist()) & set(tp_spec.mesh.mesh.flatten().tolist())
    if len(shared) > 1:  # tensor parallel runs across the dp ranks, not within each
        raise ValueError(
            f"{where} is already a DTensor ({list(tp_spec.placements)} on {tp_spec.mesh}) over ranks that "
            f"fully_shard's mesh {dp_mesh} also shards over. fully_shard composes with tensor parallel on "
            'other dims of one mesh: TP on mesh["tp"], fully_shard(mesh=mesh["dp"]) (HSDP: '
            'mesh["dp_replicate", "dp_shard"]). For data parallel alone, give it plain tensors: it shards them itself.'
        )
    key = (id(dp_mesh), id(tp_spec.mesh))
    if key not in _dp_tp_meshes:
        _dp_tp_meshes[key] = (_concatenated(dp_mesh, tp_spec.mesh, where), dp_mesh, tp_spec.mesh)
    mesh = _dp_tp_meshes[key][0]
    split = tp_spec.num_shards_map[dim]
    dp = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    meta = TensorMeta(tp_spec.shape, contiguous_stride(tp_spec.shape), tp_spec.tensor_meta.dtype)
    return DTensorSpec(mesh, (*(Replicate(),) * (dp_mesh.ndim - 1), dp, *tp_spec.placements), meta)


def _concatenated(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, where: str) -> DeviceMesh:
    """The data-parallel mesh's dims followed by the parameter's own: one mesh for its spec."""
    try:
        return DeviceMesh._concatenate([dp_mesh, tp_mesh])
    except Exception as e:  # noqa: BLE001 - torch raises several kinds for meshes of different roots
        raise ValueError(
            f"{where} is a DTensor on {tp_mesh}, and fully_shard's mesh is {dp_mesh}: they are not dims of "
            "one mesh, so the sharded parameter has no mesh to live on. Slice both from one "
            'init_device_mesh(...): parallelize_module(block, mesh["tp"]) and fully_shard(block, '
            'mesh=mesh["dp_replicate", "dp_shard"]) (or mesh["dp"]).'
        ) from e


def spmd_spec(spmd, tp_spec: DTensorSpec, dim: int, where: str) -> DTensorSpec:
    """The sharded parameter's spec on a full SPMD mesh (``dp_mesh_dims``): the parameter's own
    placements, with ``Shard(dim)`` on the data-parallel shard dim (a ``_StridedShard`` where a
    later mesh dim shards the same tensor dim: fully_shard splits the already-split local
    tensor). Several shard dims are one flattened dim of the spec's mesh, as in FSDP2."""
    mesh = tp_spec.mesh
    if mesh != spmd.mesh:
        raise ValueError(
            f"{where} is a DTensor on {mesh}, not on the mesh passed to fully_shard with dp_mesh_dims "
            f"({spmd.mesh}); distribute it on that full mesh."
        )
    for i in spmd.shard + spmd.replicate:
        if not isinstance(tp_spec.placements[i], Replicate):
            raise ValueError(
                f"{where}: expected Replicate() on the data-parallel dim '{mesh.mesh_dim_names[i]}' (index {i}), "
                f"got {tp_spec.placements[i]}; fully_shard shards it over that dim itself."
            )
    placements = list(tp_spec.placements)
    for i in spmd.shard:
        split = math.prod(mesh.size(j) for j in range(i + 1, mesh.ndim) if isinstance(placements[j], Shard) and placements[j].dim == dim)
        placements[i] = _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
    meta = TensorMeta(tp_spec.shape, contiguous_stride(tp_spec.shape), tp_spec.tensor_meta.dtype)
    if len(spmd.shard) <= 1:  # (none: replicate only, the parameter's own placements)
        return DTensorSpec(mesh, tuple(placements), meta)
    # Several shard dims: one flattened dim in place of the first (HSDP: the replicate dims
    # move in front of it, as the 2-D data-parallel mesh has them).
    submeshes, spec_placements, hsdp = [], [], bool(spmd.replicate)
    for i, name in enumerate(mesh.mesh_dim_names):
        if i == spmd.shard[0]:
            submeshes.append(spmd.dp_mesh)
            spec_placements += [Replicate()] * hsdp + [placements[i]]
        elif i in spmd.shard or (hsdp and i in spmd.replicate):
            continue
        else:
            submeshes.append(mesh[name])
            spec_placements.append(placements[i])
    return DTensorSpec(DeviceMesh._concatenate(submeshes), tuple(spec_placements), meta)


def with_size(shape: torch.Size, dim: int, size: int) -> torch.Size:
    """``shape`` with dimension ``dim`` set to ``size``."""
    return torch.Size((*shape[:dim], size, *shape[dim + 1 :]))


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def to_dtensor(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """Wrap a local shard as a DTensor with a precomputed spec (no checks, no autograd).
    ``DTensor.__new__`` alone: ``DTensor.__init__`` does nothing but costs a dynamo-disable
    wrapper (2 of the 3 us, per gradient per step)."""
    return DTensor.__new__(DTensor, local, spec, requires_grad=False)
