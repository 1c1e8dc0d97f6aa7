"""The meshes a fuzzer's specs name, made once per process group."""

from torch.distributed.device_mesh import init_device_mesh


def make_meshes(world: int) -> dict:
    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world % 2 == 0:
        meshes["hsdp"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        meshes["hsdp1"] = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    return meshes
