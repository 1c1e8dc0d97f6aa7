"""Placements, local shapes and collective counts on a fake process group (no values)."""

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline
from torch.distributed.tensor import DTensor, Shard

import shardkit
from shardkit import FSDPModule, fully_shard
from shardkit.dtensor.placements import chunk_sizes
from shardkit.eager.param_group import Holding
from tests.conftest import fake_world


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 3 * dim)
        self.down = nn.Linear(3 * dim, dim)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dim: int = 13, n_blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(5, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n_blocks))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def sharded_net(mesh, **kwargs) -> Net:
    torch.manual_seed(0)
    net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(net, mesh=mesh)
    return net


def step(net: Net) -> shardkit.Trace:
    with shardkit.trace() as t:
        net(torch.randn(2, 5)).sum().backward()
    return t


@pytest.mark.parametrize("world", [2, 4, 8, 64])
@pytest.mark.parametrize("rank_of", ["first", "last"])
def test_params_are_shard0_dtensors_with_chunk_sizes(world, rank_of):
    rank = 0 if rank_of == "first" else world - 1
    torch.manual_seed(0)
    shapes = {n: p.shape for n, p in Net().named_parameters()}
    with fake_world(world, rank) as mesh:
        net = sharded_net(mesh)
        for name, p in net.named_parameters():
            assert isinstance(p, nn.Parameter) and isinstance(p, DTensor), name
            assert p.placements == (Shard(0),) and p.device_mesh == mesh
            assert p.shape == shapes[name]
            rows = chunk_sizes(shapes[name][0], world)[rank]
            assert p.to_local().shape == (rows, *shapes[name][1:]), name
        assert isinstance(net, FSDPModule) and isinstance(net, Net)
        assert all(isinstance(b, FSDPModule) for b in net.blocks)


@pytest.mark.parametrize("world", [2, 8, 64])
def test_one_all_gather_and_one_reduce_scatter_per_group(world):
    with fake_world(world) as mesh:
        net = sharded_net(mesh)
        counts = {}
        for e in step(net).collectives():
            counts[(e.kind, e.group)] = counts.get((e.kind, e.group), 0) + 1
        blocks = [f"blocks.{i}" for i in range(3)]
        # Blocks gather in forward and again in backward; the root keeps its parameters.
        assert counts == {
            ("all_gather", ""): 1,
            **{("all_gather", b): 2 for b in blocks},
            **{("reduce_scatter", b): 1 for b in blocks},
            ("reduce_scatter", ""): 1,
        }


def test_reshard_after_forward_false_skips_backward_all_gathers():
    with fake_world(8) as mesh:
        kept = step(sharded_net(mesh, reshard_after_forward=False)).summary()
    with fake_world(8) as mesh:
        freed = step(sharded_net(mesh, reshard_after_forward=True)).summary()
    assert (kept["all_gather"].calls, freed["all_gather"].calls) == (4, 7)
    assert kept["reduce_scatter"].calls == freed["reduce_scatter"].calls == 4


def test_all_gather_bytes_are_padded_parameter_bytes():
    with fake_world(8) as mesh:
        net = sharded_net(mesh)
        t = step(net)
    block = Block(13)
    # Each parameter is padded to 8 * ceil(rows / 8) rows.
    padded = sum(8 * -(-p.shape[0] // 8) * p[0].numel() for p in block.parameters())
    gathers = [e for e in t.collectives("all_gather") if e.group == "blocks.0"]
    assert [e.numel for e in gathers] == [padded, padded]
    assert [e.dtype for e in gathers] == [torch.float32] * 2


def test_outside_steps_module_holds_sharded_params_and_state_dict_is_sharded():
    with fake_world(4) as mesh:
        net = sharded_net(mesh)
        step(net)
        assert all(isinstance(p, DTensor) for p in net.parameters())
        state = net.state_dict()
        torch.manual_seed(0)
        assert list(state) == list(Net().state_dict())
        assert all(isinstance(v, DTensor) for v in state.values())


def test_schedule_of_three_blocks_is_pinned():
    with fake_world(2) as mesh:
        net = sharded_net(mesh)
        t = step(net)
    assert_expected_inline(t.format(kinds=("all_gather", "reduce_scatter", "unshard", "reshard")), """\
all_gather <root> float32 numel=140 world=2 mesh=dim0
unshard <root>
all_gather blocks.0 float32 numel=1148 world=2 mesh=dim0
unshard blocks.0
reshard blocks.0
all_gather blocks.1 float32 numel=1148 world=2 mesh=dim0
unshard blocks.1
reshard blocks.1
all_gather blocks.2 float32 numel=1148 world=2 mesh=dim0
unshard blocks.2
reshard blocks.2
all_gather blocks.2 float32 numel=1148 world=2 mesh=dim0
unshard blocks.2
all_gather blocks.1 float32 numel=1148 world=2 mesh=dim0
reduce_scatter blocks.2 float32 numel=1160 world=2 mesh=dim0
reshard blocks.2
unshard blocks.1
all_gather blocks.0 float32 numel=1148 world=2 mesh=dim0
reduce_scatter blocks.1 float32 numel=1160 world=2 mesh=dim0
reshard blocks.1
unshard blocks.0
reduce_scatter blocks.0 float32 numel=1160 world=2 mesh=dim0
reshard blocks.0
reduce_scatter <root> float32 numel=148 world=2 mesh=dim0
reshard <root>""")


@pytest.mark.parametrize("update", ["foreach_adamw", "fused_adamw", "in_place_add"])
def test_root_kept_unsharded_is_gathered_again_after_params_change(update):
    with fake_world(4) as mesh:
        net = sharded_net(mesh)
        step(net)
        sharded = list(net.parameters())  # what an optimizer holds
        with torch.no_grad():
            net(torch.randn(2, 5))  # the root keeps its parameters unsharded
        assert all(isinstance(p, DTensor) for p in net.parameters())  # outside forward/backward
        with shardkit.trace() as unchanged, torch.no_grad():
            net(torch.randn(2, 5))
        if update == "in_place_add":
            with torch.no_grad():
                for p in sharded:
                    p.add_(1.0)
        else:
            torch.optim.AdamW(sharded, lr=0.1, **{update.split("_")[0]: True}).step()
        with shardkit.trace() as changed, torch.no_grad():
            net(torch.randn(2, 5))
    root_gathers = lambda t: [e for e in t.collectives("all_gather") if e.group == ""]
    assert len(root_gathers(unchanged)) == 0
    assert len(root_gathers(changed)) == 1


def test_reset_iter_state_recovers_from_an_exception_mid_forward():
    class Boom(Exception):
        pass

    with fake_world(4) as mesh:
        net = sharded_net(mesh)
        calls = {"n": 0}

        def explode_once(module, args):
            calls["n"] += 1
            if calls["n"] == 1:
                raise Boom

        handle = net.blocks[1].register_forward_pre_hook(explode_once)
        with pytest.raises(Boom):
            net(torch.randn(2, 5))
        with pytest.raises(RuntimeError, match="root"):
            net.blocks[0].reset_iter_state()
        net.reset_iter_state()
        assert all(isinstance(p, DTensor) for p in net.parameters())
        counts = step(net).summary()
        handle.remove()
    assert (counts["all_gather"].calls, counts["reduce_scatter"].calls) == (7, 4)


def test_fsdp2_knobs_without_effect_here_are_accepted():
    with fake_world(4) as mesh:
        net = sharded_net(mesh)
        net.set_force_sum_reduction_for_comms(True)
        net.set_post_optim_event(None)
        net.set_reduce_scatter_unused_params(False)
        net.set_requires_all_reduce(False)
        net.set_reduce_scatter_divide_factor(2.0)
        assert net.__dict__["_shardkit_state"].options.gradient_divide_factor == 2.0
        assert step(net).summary()["reduce_scatter"].calls == 4


def test_default_mesh_is_every_rank_of_the_process_group():
    with fake_world(8, rank=3):
        net = Net()
        fully_shard(net)  # no mesh: all 8 ranks, on the CPU here
        weight = net.inp.weight
        assert weight.device_mesh.size() == 8 and weight.device_mesh.device_type == "cpu"
        assert weight.to_local().shape == (2, 5)  # 13 rows on 8 ranks: rank 3 holds 2
        assert step(net).summary()["all_gather"].calls == 1


@pytest.mark.parametrize("reshard", [True, False])
def test_a_first_forward_under_inference_mode_leaves_buffers_training_can_fill(reshard):
    """The unsharded buffers made at the first unshard outlive its forward: made under
    ``torch.inference_mode`` they were inference tensors, and the next training forward failed
    ("Inplace update to inference tensor outside InferenceMode"; FSDP2 2.13 fails there too).
    The numbers are checked on 2 gloo ranks (tests/gloo/test_lifecycle.py)."""
    with fake_world(4) as mesh:
        model = Net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        with torch.inference_mode():
            model(torch.randn(2, 5))
        model(torch.randn(2, 5)).sum().backward()
        assert all(isinstance(p.grad, DTensor) and not p.grad.is_inference() for p in model.parameters())


@pytest.mark.parametrize("reshard", [True, False])
def test_a_create_graph_backward_leaves_the_parameters_for_the_backward_through_it(reshard):
    """A gradient penalty: ``autograd.grad(out, x, create_graph=True)`` makes a graph that reads
    the unsharded parameters, and the loss's backward runs through it. That first backward
    keeps every group's gathered data (freeing it freed the storage the second backward read:
    "setStorage ... out of bounds for storage of size 0", as in FSDP2 2.13) while the modules
    show their sharded parameters, as after any backward; the second all-gathers nothing,
    reduce-scatters once per group and frees them all. (The first reduces too, as any backward:
    zeros, with no rank's gradient, so .grad stays None.) The numbers are checked on 2 gloo
    ranks (tests/gloo/test_lifecycle.py)."""
    with fake_world(4) as mesh:
        model = Net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh)
        x = torch.randn(2, 5, requires_grad=True)
        out = model(x)
        grad_x, = torch.autograd.grad(out.sum(), x, create_graph=True)
        assert all(isinstance(p, DTensor) and p.grad is None for p in model.parameters())  # (zeros reduced: no rank had a gradient)
        groups = [m._shardkit_state.group for m in (model, *model.blocks)]
        assert {g.holding for g in groups} == {Holding.KEPT}  # the gathered data, for the next backward
        with shardkit.trace() as second:
            (grad_x.pow(2).sum() + out.sum()).backward()
        assert not second.collectives("all_gather")
        assert sorted(e.group for e in second.collectives("reduce_scatter")) == ["", "blocks.0", "blocks.1", "blocks.2"]
        assert all(isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in model.parameters())
        assert {g.holding for g in groups} == {Holding.SHARDED}
