"""HSDP on a 2-D mesh and parameters sharded on dims other than 0: placements, local shapes,
collective schedules (fake process group). Numerics: tests/gloo/test_composition.py."""

import torch
import torch.nn as nn
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import shardkit
from shardkit import fully_shard
from tests.conftest import fake_world


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(10, 10), nn.Tanh()) for _ in range(2))
        self.out = nn.Linear(10, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def hsdp_net(world: int, rank: int):
    torch.manual_seed(0)
    net = Net()
    mesh = DeviceMesh("cpu", torch.arange(world).view(2, world // 2), mesh_dim_names=("replicate", "shard"))
    for b in net.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def test_hsdp_2x4_placements_local_shapes_and_schedule():
    with fake_world(8, 6):  # replica 1, shard rank 2 of 4
        net = hsdp_net(8, 6)
        w = net.blocks[0][0].weight
        assert isinstance(w, DTensor) and w.placements == (Replicate(), Shard(0)) and w.device_mesh.shape == (2, 4)
        assert w.to_local().shape == (3, 10)  # 10 rows over 4 shards: 3, 3, 3, 1
        assert net.out.weight.to_local().shape == (1, 10)  # 3 rows over 4 shards: 1, 1, 1, 0
        with shardkit.trace() as t:
            net(torch.randn(4, 6)).sum().backward()
    assert_expected_inline(t.format(kinds=("all_gather", "reduce_scatter", "all_reduce")), """\
all_gather <root> float32 numel=128 world=4 mesh=shard
all_gather blocks.0 float32 numel=132 world=4 mesh=shard
all_gather blocks.1 float32 numel=132 world=4 mesh=shard
all_gather blocks.1 float32 numel=132 world=4 mesh=shard
all_gather blocks.0 float32 numel=132 world=4 mesh=shard
reduce_scatter blocks.1 float32 numel=140 world=4 mesh=shard
all_reduce blocks.1 float32 numel=35 world=2 mesh=replicate
reduce_scatter blocks.0 float32 numel=140 world=4 mesh=shard
all_reduce blocks.0 float32 numel=35 world=2 mesh=replicate
reduce_scatter <root> float32 numel=144 world=4 mesh=shard
all_reduce <root> float32 numel=36 world=2 mesh=replicate""")


def test_hsdp_without_all_reduce_keeps_sums_until_it_is_back_on():
    with fake_world(8, 0):
        net = hsdp_net(8, 0)
        net.set_requires_all_reduce(False)
        with shardkit.trace() as t:
            net(torch.randn(4, 6)).sum().backward()
        assert t.summary()["all_reduce"].calls == 0 and t.summary()["reduce_scatter"].calls == 3
        assert all(p.grad is None for p in net.parameters())  # .grad waits for the all-reduce
        net.set_requires_all_reduce(True)
        with shardkit.trace() as t:
            net(torch.randn(4, 6)).sum().backward()
        assert t.summary()["all_reduce"].calls == 3
        assert all(p.grad is not None for p in net.parameters())
        assert not net._shardkit().group.parts[0].plan.partial  # the kept sums were added and dropped


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(3, 6, 7))  # (experts, dim, hidden): shard hidden
        self.down = nn.Linear(7, 6)

    def forward(self, x):
        return self.down(torch.tanh(torch.einsum("bd,edh->bh", x, self.up)))


def test_shard_placement_fn_shards_dim_1_and_2_unevenly():
    dims = {}
    for rank in range(4):
        with fake_world(4, rank) as mesh:
            torch.manual_seed(0)
            m = Experts()
            fn = lambda p: Shard(2) if p.dim() == 3 else Shard(1) if p.shape == (6, 7) else None  # noqa: E731
            fully_shard(m, mesh=mesh, shard_placement_fn=fn)
            dims[rank] = (m.up.placements, m.up.to_local().shape, m.down.weight.placements, m.down.weight.to_local().shape,
                          m.down.bias.placements, m.down.bias.to_local().shape)
            with shardkit.trace() as t:
                m(torch.randn(2, 6)).sum().backward()
            assert m.up.grad.to_local().shape == m.up.to_local().shape
            assert m.down.weight.grad.to_local().shape == m.down.weight.to_local().shape
    # 7 over 4 ranks: 2, 2, 2, 1 (torch.chunk), padded to 2 each
    assert [d[1] for d in dims.values()] == [(3, 6, 2)] * 3 + [(3, 6, 1)]
    assert [d[3] for d in dims.values()] == [(6, 2)] * 3 + [(6, 1)]
    assert dims[0][0] == (Shard(2),) and dims[0][2] == (Shard(1),) and dims[0][4] == (Shard(0),)
    assert [e.numel for e in t.collectives("all_gather")] == [4 * (3 * 6 * 2 + 6 * 2 + 2)]
