import contextlib

import pytest
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """An in-process fake process group: collectives return at once and move no data."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def mesh8() -> DeviceMesh:
    with fake_world(8, rank=0) as mesh:
        yield mesh


class TanhStack(nn.Module):
    """inp, then ``n_blocks`` of Linear + Tanh in ``blocks`` (one group each when sharded), then out."""

    def __init__(self, n_blocks: int, dim: int) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n_blocks))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)
