"""The meshes a fuzzer's specs name, made once per process group."""

from torch.distributed.device_mesh import init_device_mesh


def make_meshes(world: int) -> dict:
    meshes = {"1d": init_device_mesh("cpu", (world,))}
    if world % 2 == 0:
        meshes["hsdp"] = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        meshes["hsdp1"] = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    if world % 8 == 0:  # HSDP x TP: fully_shard over (dp_replicate, dp_shard), the blocks' lin tensor parallel on tp
        full = init_device_mesh("cpu", (2, world // 4, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        meshes["hsdp_tp"], meshes["hsdp_tp:tp"] = full["dp_replicate", "dp_shard"], full["tp"]
    return meshes
