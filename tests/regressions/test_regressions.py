"""One minimal test per bug that once shipped with every other test green, named after the
behaviour that was wrong. In-process: one gloo rank, or the fake process group."""

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardkit
from shardkit import fully_shard
from shardkit.comm import collectives
from tests.conftest import fake_world, forget_meshes


@contextlib.contextmanager
def gloo_world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()


class TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x)


UNSHARDS = {
    "root": lambda m: m.unshard(),
    "block": lambda m: m.blocks[1].unshard(),
    "async_then_wait": lambda m: m.unshard(async_op=True).wait(),
    "async_waited_twice": lambda m: _wait_twice(m.unshard(async_op=True)),
    "async_not_waited": lambda m: m.unshard(async_op=True),  # the forward waits for it
}


def _wait_twice(handle):
    handle.wait()
    handle.wait()


# Bug: an explicit unshard() before a forward replaced the sharded parameters at lazy init by
# new ones, so AdamW stepped tensors the model no longer used (2e-2 off after 2 steps).
@pytest.mark.parametrize("how", UNSHARDS)
def test_unshard_before_forward_trains_as_the_unsharded_model(how):
    with gloo_world_of_one():
        torch.manual_seed(0)
        reference = TwoBlocks()
        model = copy.deepcopy(reference)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        sharded_before = [id(p) for p in model.parameters()]
        for _ in range(2):
            x = torch.randn(4, 8)
            UNSHARDS[how](model)
            model(x).sum().backward()
            optim.step()
            optim.zero_grad()
            reference(x).sum().backward()
            ref_optim.step()
            ref_optim.zero_grad()
        assert [id(p) for p in model.parameters()] == sharded_before  # the optimizer's parameters
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.full_tensor(), ref, rtol=0, atol=1e-6, msg=name)


# Bug: the planner's token cross-entropy default replaced the scalar-loss path: IndexError.
@pytest.mark.parametrize("factory", ["scalar", "loss_attribute", "loss_first"])
def test_planner_uses_the_loss_a_model_returns_itself(factory):
    spec = f"tests.regressions.models_returning_loss:{factory}"
    kwargs = dict(blocks=["blocks.0", "blocks.1"], seq_len=8, batch_size=2)
    planned = shardkit.plan(spec, 4, **kwargs)
    own = {"scalar": lambda out, inputs: out, "loss_attribute": lambda out, inputs: out.loss,
           "loss_first": lambda out, inputs: out[0]}[factory]
    explicit = shardkit.plan(spec, 4, loss_fn=own, **kwargs)
    assert planned.memory.peak == explicit.memory.peak > 0
    assert planned.comm == explicit.comm


def test_python_m_shardkit_plan_takes_a_model_that_returns_its_loss(capsys):
    from shardkit.__main__ import main

    assert main(["plan", "tests.regressions.models_returning_loss:scalar", "--world", "4"]) == 0
    assert "peak" in capsys.readouterr().out.lower()


# Bug: set_force_sum_reduction_for_comms(True) was accepted and did nothing (AVG stayed).
def test_force_sum_reduction_sums_in_the_collective_and_divides_after(monkeypatch):
    ops = []
    original = collectives._reduce_scatter_single

    def recording(output, input, op, **kwargs):
        ops.append(op)
        return original(output, input, op=op, **kwargs)

    monkeypatch.setattr(collectives, "_reduce_scatter_single", recording)
    with fake_world(8) as mesh:
        torch.manual_seed(0)
        model = TwoBlocks()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_force_sum_reduction_for_comms(True)  # the root's group only, as FSDP2
        with shardkit.trace() as t:
            model(torch.randn(4, 8)).sum().backward()
    by_group = {e.group: (e.op, e.divide_by) for e in t.collectives("reduce_scatter")}
    assert by_group == {"": ("sum", 8), "blocks.0": ("avg", 1), "blocks.1": ("avg", 1)}
    assert sorted(map(str, ops)) == sorted(map(str, [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.AVG]))
    ops.clear()
    with fake_world(8) as mesh2:  # a fresh model: every group forced
        torch.manual_seed(0)
        model = TwoBlocks()
        for block in model.blocks:
            fully_shard(block, mesh=mesh2)
            block.set_force_sum_reduction_for_comms(True)
        fully_shard(model, mesh=mesh2)
        model.set_force_sum_reduction_for_comms(True)
        model(torch.randn(4, 8)).sum().backward()
    assert set(map(str, ops)) == {str(dist.ReduceOp.SUM)}


@contextlib.contextmanager
def hsdp_two_blocks(blocks_too: bool = True):
    """TwoBlocks sharded on a (replicate 2, shard 2) mesh of the fake process group."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = TwoBlocks()
        for block in model.blocks if blocks_too else ():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield model


# Found by the fuzzer: FSDP2's set_requires_gradient_sync(v) sets requires_all_reduce(v) too;
# shardkit left a False all-reduce in place, so HSDP replicas silently kept diverged sums.
def test_set_requires_gradient_sync_sets_requires_all_reduce_as_fsdp2():
    with hsdp_two_blocks() as model:
        model.set_requires_all_reduce(False)
        model.set_requires_gradient_sync(True)
        with shardkit.trace() as t:
            model(torch.randn(4, 8)).sum().backward()
        assert len(t.collectives("all_reduce")) == 3  # one per group, over the replicas
        model.set_requires_gradient_sync(False)
        model.set_requires_gradient_sync(True)
        with shardkit.trace() as t:
            model(torch.randn(4, 8)).sum().backward()
        assert len(t.collectives("all_reduce")) == 3


# Found by the fuzzer: with HSDP, FSDP2 averages in both collectives on NCCL; shardkit summed
# and divided after (the same numbers, but not FSDP2's collectives, and an extra kernel).
def test_hsdp_reductions_average_in_both_collectives_as_fsdp2():
    with hsdp_two_blocks() as model:
        with shardkit.trace() as t:
            model(torch.randn(4, 8)).sum().backward()
    ops = [(e.kind, e.op, e.divide_by) for e in t.collectives() if e.kind != "all_gather"]
    assert sorted(ops) == [("all_reduce", "avg", 1)] * 3 + [("reduce_scatter", "avg", 1)] * 3  # nothing divided after


def _hsdp_ops(factor=None, custom=None):
    with hsdp_two_blocks(blocks_too=False) as model:
        if factor is not None:
            model.set_gradient_divide_factor(factor)
        if custom is not None:
            model.set_custom_reduce_scatter(custom)
        with shardkit.trace() as t:
            model(torch.randn(4, 8)).sum().backward()
    return [(e.kind, e.op, e.divide_by) for e in t.collectives() if e.kind != "all_gather"]


# Found by the fuzzer: FSDP2 picks its ops from a user's divide factor (AVG over the shard dim
# when the factor is its size, then a SUM over the replicas; else a pre-multiplied SUM).
def test_a_divide_factor_picks_fsdp2s_ops():
    assert _hsdp_ops() == [("reduce_scatter", "avg", 1), ("all_reduce", "avg", 1)]
    assert _hsdp_ops(factor=2.0) == [("reduce_scatter", "avg", 1), ("all_reduce", "sum", 1)]
    assert _hsdp_ops(factor=4.0) == [("reduce_scatter", "sum", 4.0), ("all_reduce", "sum", 1)]


# Found by the fuzzer: a user's reduce-scatter (set_custom_reduce_scatter) was always given SUM;
# FSDP2 gives it the op it would use itself.
def test_a_custom_reduce_scatter_gets_the_op_fsdp2_gives_it():
    from tests.gloo.extension_tensors import UserComm

    ops = []

    class Recording(UserComm):
        def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
            ops.append(op)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    assert _hsdp_ops(custom=Recording("reduce_scatter")) == [("reduce_scatter", "avg", 1), ("all_reduce", "avg", 1)]
    assert ops == [dist.ReduceOp.AVG]


class TiedAcross(nn.Module):
    """An embedding tied to a head that a fully_shard call of its own shards first (its owner):
    the root borrows the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.block(self.emb(x))))


@pytest.mark.parametrize("then", ["state_dict", "load_state_dict"])
def test_a_state_dict_of_unsharded_groups_with_a_borrowed_tied_weight_holds_live_shards(then):
    """make fuzz seed 332 (a segfault of both ranks): with set_reshard_after_backward(False) the
    groups stayed unsharded after backward; state_dict() resharded each group when its modules'
    turn came, so the root put the head's unsharded tied weight in the dict (emb.weight, a plain
    tensor) and the head's reshard, later in the same call, freed its storage: reading the
    entry crashed. Now every entry is the sharded DTensor, and a round trip keeps the values."""
    from torch.distributed.tensor import DTensor

    with fake_world(2) as mesh:
        torch.manual_seed(0)
        model = TiedAcross()
        fully_shard(model.block, mesh=mesh)
        fully_shard(model.head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_reshard_after_backward(False)
        model(torch.arange(4).view(1, 4)).sum().backward()
        if then == "load_state_dict":
            model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
        sd = model.state_dict()
        assert all(isinstance(v, DTensor) for v in sd.values()), {k: type(v).__name__ for k, v in sd.items()}
        local = sd["emb.weight"].to_local()
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size()
        assert torch.equal(local.clone(), model.head.weight.to_local())
