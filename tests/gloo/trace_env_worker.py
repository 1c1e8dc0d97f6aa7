"""Two training steps of a small sharded model, run by test_trace_env.py under torchrun with
SHARDKIT_TRACE=<folder>: shardkit itself writes each rank's trace there at exit."""

import gc

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from shardkit import fully_shard

STEPS = 2


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), *(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3)), nn.Linear(16, 1))
    for block in model[1:4]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        model(torch.randn(4, 8, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    del model, optimizer  # free the mesh (and its process group) before gloo tears down
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
