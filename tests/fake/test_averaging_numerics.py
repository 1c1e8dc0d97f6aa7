"""The reductions that average in the collective (``ReduceOp.AVG``, as FSDP2 on NCCL) give the
unsharded model's gradients: over one dim, and with HSDP in both collectives, also when a
backward keeps its sums without the all-reduce (``set_requires_all_reduce(False)``) and the
next reduction sums instead (``set_force_sum_reduction_for_comms``). gloo cannot average, so
this runs on torch's threaded process group with shardkit told that it averages, as NCCL."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import shardkit
import shardkit.compiled
from shardkit.comm import collectives
from shardkit.compiled.group import GraphComm
from tests.fake.test_threaded_pg import run_ranks

WORLD = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


# (mesh shape, per microbatch: (requires_all_reduce, force_sum) set on every group before its backward)
CASES = {
    "1d": ((WORLD,), [(True, False)]),
    "hsdp": ((2, 2), [(True, False)]),
    "hsdp-kept-then-averaged": ((2, 2), [(False, False), (False, False), (True, False)]),
    "hsdp-kept-averaged-then-summed": ((2, 2), [(False, False), (True, True)]),
    "hsdp-kept-summed-then-averaged": ((2, 2), [(False, True), (True, False)]),
    "hsdp-divide-factor-2": ((2, 2), [(True, False)]),  # AVG over the shard dim, SUM over the replicas
}
FACTORS = {"hsdp-divide-factor-2": 2.0}
HALVING_HOOK = ("1d", "hsdp")  # also with an all-reduce hook that halves what the collectives left


@pytest.fixture
def averaging_backend(monkeypatch):
    """Comms over more than one rank average in the collective, as on NCCL."""
    original = collectives.Comm.of.__func__

    def of(cls, *args, **kwargs):
        comm = original(cls, *args, **kwargs)
        comm.averages = comm.world > 1
        return comm

    monkeypatch.setattr(collectives.Comm, "of", classmethod(of))
    graph_of = GraphComm.of

    def graph_comm_of(mesh, dim):
        comm = graph_of(mesh, dim)
        return dataclasses.replace(comm, averages=comm.world > 1)

    monkeypatch.setattr(GraphComm, "of", staticmethod(graph_comm_of))


@pytest.mark.parametrize("case", [*CASES, *(f"{c}+halving-hook" for c in HALVING_HOOK), *(f"{c}+compiled-mode" for c in CASES)])
def test_averaging_reductions_give_the_unsharded_gradients(case, averaging_backend):
    """Compiled mode (run without torch.compile: the same ops) averages by the same rule."""
    compiled = case.endswith("+compiled-mode")
    case = case.removesuffix("+compiled-mode")
    fully_shard = shardkit.compiled.fully_shard if compiled else shardkit.fully_shard
    shape, microbatches = CASES[case.removesuffix("+halving-hook")]
    halve = case.endswith("+halving-hook")
    torch.manual_seed(0)
    reference = Net()
    g = torch.Generator().manual_seed(1)
    inputs = [[torch.randn(2, 8, generator=g) for _ in range(WORLD)] for _ in microbatches]  # [microbatch][rank]
    for batch in inputs:  # the gradient of the mean over ranks, summed over microbatches
        (sum(reference(x).sum() for x in batch) / WORLD).backward()
    factor = FACTORS.get(case)
    scale = (0.5 if halve else 1) * (WORLD / factor if factor else 1)  # a factor divides the sum over ranks
    want = {name: p.grad.clone() * scale for name, p in reference.named_parameters()}

    def rank_main(rank: int):
        names = ("replicate", "shard") if len(shape) == 2 else None
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        model = copy.deepcopy(Net())
        model.load_state_dict(reference.state_dict())
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        groups = [m for m in model.modules() if isinstance(m, shardkit.FSDPModule)]
        if factor:
            for m in groups:
                m.set_gradient_divide_factor(factor)
        if halve:
            for m in groups:
                m.set_all_reduce_hook(lambda reduced: reduced.mul_(0.5))
        with shardkit.trace() as t:
            for batch, (all_reduce, force_sum) in zip(inputs, microbatches):
                for m in groups:
                    m.set_requires_all_reduce(all_reduce, recurse=False)
                    m.set_force_sum_reduction_for_comms(force_sum)
                model(batch[rank]).sum().backward()
        got = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        ops = {e.op for e in t.collectives() if e.kind != "all_gather" and e.world > 1}
        return got, ops

    results = run_ranks(WORLD, rank_main)
    for rank, (got, ops) in enumerate(results):
        assert "avg" in ops, ops  # the averaging path ran
        for name in want:
            torch.testing.assert_close(got[name], want[name], msg=lambda m: f"{case}, rank {rank}, {name}: {m}")
