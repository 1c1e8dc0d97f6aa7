"""The mesh ``fully_shard`` uses: the default one, what it accepts, and what it derives from it
(the device, the smaller mesh of ``reshard_after_forward=R``, the data-parallel part of a full
SPMD mesh named by ``dp_mesh_dims``, a parameter's own mesh from ``shard_placement_fn``)."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group()
        else:
            raise RuntimeError(
                "fully_shard needs a process group: call torch.distributed.init_process_group() "
                "(or launch with torchrun) before fully_shard, or pass mesh=init_device_mesh(...)."
            )
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    device_type = accelerator.type if accelerator is not None else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


@dataclass
class DataParallelMeshDims:
    """FSDP2's: which dims of a full SPMD mesh (e.g. ``("dp_replicate", "dp_shard", "tp")``)
    are data parallel, for ``fully_shard(model, mesh=full_mesh, dp_mesh_dims=...)`` on
    parameters that are already DTensors on that mesh (``Replicate()`` on those dims).
    ``shard``: the dim(s) to shard over (several are flattened into one); ``replicate``: the
    HSDP replication dim(s)."""

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if value is None else (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class Spmd:
    """Where the data-parallel dims sit in a full SPMD mesh: the sharded parameters stay
    DTensors on it (``placements.spmd_spec``); the collectives run on ``dp_mesh``."""

    mesh: DeviceMesh  # the full mesh the parameters are DTensors on
    shard: tuple[int, ...]  # its dims that fully_shard shards over (flattened when several)
    replicate: tuple[int, ...]  # its HSDP replication dims
    dp_mesh: DeviceMesh  # 1-D (shard), or 2-D (replicate, shard)

    @property
    def dims(self) -> frozenset[int]:
        return frozenset(self.shard + self.replicate)


def spmd_mesh(mesh: DeviceMesh, dims: Any) -> Spmd:
    """``dp_mesh_dims`` checked against ``mesh``, and the data-parallel mesh it names."""
    shard, replicate = _names(getattr(dims, "shard", None)), _names(getattr(dims, "replicate", None))
    if not shard and not replicate:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in shard + replicate:
        if name not in mesh.mesh_dim_names:
            raise ValueError(f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}")

    def flat(names: tuple[str, ...]) -> DeviceMesh:
        return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))

    if not shard:  # replicate only (FSDP2's DDP mode): HSDP over a shard dim of one rank
        name = "_".join(replicate)
        dp = flat(replicate)._unflatten(0, (flat(replicate).size(), 1), (name, f"{name}_unsharded"))
    elif not replicate:
        dp = flat(shard)
    else:
        dp = DeviceMesh._concatenate([flat(replicate), flat(shard)])
    index = mesh.mesh_dim_names.index
    return Spmd(mesh, tuple(map(index, shard)), tuple(map(index, replicate)), dp)


def param_mesh(mesh_info: Any, where: str) -> DeviceMesh:
    """The data-parallel mesh of a ``ShardPlacementResult``'s ``mesh_info``: FSDP2's
    ``FSDPMeshInfo(mesh, shard_mesh_dim=0)`` (1-D) or ``HSDPMeshInfo(mesh, shard_mesh_dim=1,
    replicate_mesh_dim=0)`` (2-D), or a DeviceMesh itself."""
    if isinstance(mesh_info, DeviceMesh):
        mesh = mesh_info
    else:
        mesh = getattr(mesh_info, "mesh", None)
        if not isinstance(mesh, DeviceMesh):
            raise TypeError(
                f"shard_placement_fn returned a ShardPlacementResult for {where} whose mesh_info is "
                f"{type(mesh_info).__name__}; pass FSDP2's FSDPMeshInfo / HSDPMeshInfo or a DeviceMesh."
            )
        shard_dim, replicate_dim = getattr(mesh_info, "shard_mesh_dim", None), getattr(mesh_info, "replicate_mesh_dim", None)
        if (shard_dim, replicate_dim) not in ((0, None), (1, 0)) or mesh.ndim != (shard_dim + 1):
            raise NotImplementedError(
                f"shard_placement_fn for {where}: shardkit takes a 1-D mesh (shard_mesh_dim=0) or a 2-D one "
                f"(replicate_mesh_dim=0, shard_mesh_dim=1), got shard_mesh_dim={shard_dim}, "
                f"replicate_mesh_dim={replicate_dim} on {mesh}."
            )
        if getattr(mesh_info, "dp_mesh_dims", None) is not None:
            raise NotImplementedError(
                f"shard_placement_fn for {where}: a mesh_info of a full SPMD mesh (dp_mesh_dims) as a "
                "parameter's own mesh is not supported; give that parameter's data-parallel mesh."
            )
    check_mesh(mesh)
    return mesh


def resizable(pg: dist.ProcessGroup) -> bool:
    """Whether a process group may change its size between steps: one written in Python that
    c10d did not make (torchft's ``ManagedProcessGroup``, whose ``size()`` is the replicas in the
    current quorum, or any such wrapper). c10d's groups, Python ones included (torch's threaded
    test group), have the ranks they were made with. A resizable group's size is read at each
    reduction."""
    return type(pg) is not dist.ProcessGroup and pg not in dist.distributed_c10d._world.pg_group_ranks


def check_mesh(mesh: Any, spmd: bool = False, compiled: bool = False) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard expects mesh to be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; "
            "build one with init_device_mesh('cpu' or 'cuda', (world_size,))."
        )
    if not spmd and mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1-D DeviceMesh (FSDP) or a 2-D one (HSDP: replicate, shard), got a "
            f"{mesh.ndim}-D mesh {mesh}. With tensor parallel, pass the data-parallel part: mesh['dp'], or the "
            "full mesh with dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)."
        )
    _check_fixed_groups(mesh, spmd, compiled)
    if mesh.device_type == "meta":
        raise ValueError(
            f"fully_shard cannot shard over {mesh}: a meta-device mesh runs no collectives. Build the mesh on "
            "the device you train on (init_device_mesh('cuda' or 'cpu', ...)); the parameters may stay on meta "
            "until model.to_empty()."
        )
    if mesh.device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"fully_shard got the CUDA mesh {mesh}, but CUDA is not available on this machine (torch "
            f"{torch.__version__}, CUDA build: {torch.version.cuda is not None}). On the CPU use "
            "init_device_mesh('cpu', ...) with the gloo backend."
        )


def _check_fixed_groups(mesh: DeviceMesh, spmd: bool, compiled: bool) -> None:
    """Only the replicate dim of an HSDP mesh, in eager mode, may be a group whose size changes
    (``resizable``): the shards' sizes follow the shard dim's ranks, and compiled mode's graphs
    name their groups' sizes."""
    if mesh.device_type == "meta":
        return
    for dim in range(mesh.ndim):
        pg = mesh.get_group(dim)
        if not resizable(pg) or (dim == 0 and mesh.ndim == 2 and not spmd and not compiled):
            continue
        name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else f"dim {dim}"
        where = "in compiled mode" if compiled and dim == 0 and mesh.ndim == 2 else "as a shard dimension"
        raise NotImplementedError(
            f"fully_shard: the mesh's '{name}' dimension is a {type(pg).__name__}, a process group whose size "
            f"may change between steps, which fully_shard cannot use {where}: only the replicate dimension of "
            "an HSDP mesh (replicate, shard) may be one, in eager mode (shardkit.fully_shard). Shard over a "
            "plain group (e.g. each replica group's own ranks) and put the changing group in the replicate "
            "dimension, or reduce across it with set_all_reduce_hook (shardkit.ft does this for torchft)."
        )


def check_reshard_after_forward(value: Any, mesh: DeviceMesh, spmd: bool = False, split: bool = False) -> tuple[bool | None, DeviceMesh | None]:
    """The bool (or None: decided at lazy init), and for an int R strictly between 1 and the
    world size, the (world / R, R) mesh whose dim 1 holds the post-forward shards (``split``:
    compiled mode's, ``post_forward_split``). ``spmd``: sharded over ``dp_mesh_dims``."""
    if value is None or isinstance(value, bool):
        return value, None
    if spmd:
        raise NotImplementedError("reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)")  # as FSDP2
    if not isinstance(value, int):
        raise ValueError(
            f"reshard_after_forward should be None, a bool, or an int dividing the mesh size, not {value!r}"
        )
    world = mesh.size(mesh.ndim - 1)  # the ranks parameters are sharded over
    if value < 1 or world % value != 0:
        raise ValueError(f"If passing reshard_after_forward as an int, it should be a factor of {world}, not {value}")
    if value == world:
        return True, None
    if value == 1:
        warnings.warn("reshard_after_forward=1 (int) keeps parameters unsharded after forward; use False", stacklevel=3)
        return False, None
    return True, (post_forward_split if split else _post_forward_mesh)(mesh, value)


def post_forward_split(mesh: DeviceMesh, size: int) -> DeviceMesh:
    """Compiled mode's ``reshard_after_forward=R`` (``size``): the shard dim of ``mesh`` split in
    two, ``(*other dims, shard / R, R)``: dim -1 holds R consecutive ranks (the post-forward
    shards, as eager's), dim -2 the ranks equal modulo R within one shard row. A 1-D mesh's is
    eager's own (the same process groups); collective, made once per mesh object and size."""
    if mesh.ndim == 1:
        return _post_forward_mesh(mesh, size)
    cache = mesh.__dict__.setdefault("_shardkit_post_forward_meshes", {})
    if ("split", size) not in cache:
        cache["split", size] = DeviceMesh(mesh.device_type, mesh.mesh.view(*mesh.mesh.shape[:-1], -1, size))
    return cache["split", size]


def _post_forward_mesh(mesh: DeviceMesh, size: int) -> DeviceMesh:
    """Consecutive ranks of ``mesh`` in groups of ``size`` (e.g. the GPUs of a node), made once
    per mesh object and size: creating it is collective, so every rank gets here in the same
    order (as with every fully_shard call)."""
    cache = mesh.__dict__.setdefault("_shardkit_post_forward_meshes", {})
    if size not in cache:
        cache[size] = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, size))
    return cache[size]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    handle = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, handle.current_device())
