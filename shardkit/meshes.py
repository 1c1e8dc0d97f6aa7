"""The mesh ``fully_shard`` uses: the default one, what it accepts, and what it derives from it
(the device, the smaller mesh of ``reshard_after_forward=R``)."""

from __future__ import annotations

import os
import warnings
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


def check_mesh(mesh: Any) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"fully_shard expects mesh to be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}; "
            "build one with init_device_mesh('cpu' or 'cuda', (world_size,))."
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1-D DeviceMesh (FSDP) or a 2-D one (HSDP: replicate, shard), got a "
            f"{mesh.ndim}-D mesh {mesh}. With tensor parallel, pass the data-parallel part: mesh['dp']."
        )
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


def check_reshard_after_forward(value: Any, mesh: DeviceMesh) -> tuple[bool | None, DeviceMesh | None]:
    """The bool (or None: decided at lazy init), and for an int R strictly between 1 and the
    world size, the (world / R, R) mesh whose dim 1 holds the post-forward shards."""
    if value is None or isinstance(value, bool):
        return value, None
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
    return True, _post_forward_mesh(mesh, value)


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
