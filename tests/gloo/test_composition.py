"""HSDP and parameters sharded on other dims: numerics on 2 gloo ranks against the reference.

HSDP at 1x2 (one replica, two shards: FSDP) and 2x1 (two replicas of one shard: DDP-like),
gradient accumulation that skips the all-reduce across replicas, and Shard(1)/Shard(2)
parameters, even (with FSDP2 too) and uneven (shardkit only: FSDP2 needs even division).
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Parity, Stack, stack_batches

checks = Checks()
STEPS = 3


def mesh_2d(replicas: int, shards: int) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(replicas * shards).view(replicas, shards), mesh_dim_names=("replicate", "shard"))


def hsdp(impl, mesh):
    def shard(model):
        for block in model.blocks:
            FULLY_SHARD[impl](block, mesh=mesh)
        FULLY_SHARD[impl](model, mesh=mesh)
    return shard


@checks()
def hsdp_1x2_matches_reference(mesh, impl):
    p = Parity.build(Stack, hsdp(impl, mesh_2d(1, 2)), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    assert p.model.inp.weight.placements == (Replicate(), Shard(0))


@checks()
def hsdp_2x1_matches_reference(mesh, impl):
    p = Parity.build(Stack, hsdp(impl, mesh_2d(2, 1)), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()


@checks()
def hsdp_accumulation_without_all_reduce_matches_one_big_batch(mesh, impl):
    p = Parity.build(Stack, hsdp(impl, mesh_2d(2, 1)), mesh, impl)
    for batch in stack_batches(STEPS):
        halves = list(zip(*(t.chunk(2) for t in batch)))  # two microbatches of the global batch
        p.model.set_requires_all_reduce(False)
        p.forward_backward(halves[0], scale=0.5)
        p.model.set_requires_all_reduce(True)
        p.forward_backward(halves[1], scale=0.5)
        p.assert_grads_match()
        p.optimizer_step()
    p.assert_params_match()


class Experts(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 6)
        self.up = nn.Parameter(torch.randn(3, 6, hidden) / 3)  # (experts, dim, hidden)
        self.blocks = nn.ModuleList()
        self.down = nn.Linear(hidden, 3)

    def forward(self, x):
        h = torch.tanh(torch.einsum("bd,edh->bh", self.inp(x), self.up))
        return self.down(h)


def shard_dims(impl, mesh):
    fn = lambda p: Shard(2) if p.dim() == 3 else Shard(1) if p.dim() == 2 else Shard(0)  # noqa: E731
    return lambda m: FULLY_SHARD[impl](m, mesh=mesh, shard_placement_fn=fn)


@checks()
def params_sharded_on_dims_1_and_2_match_reference(mesh, impl):
    p = Parity.build(lambda: Experts(hidden=4), shard_dims(impl, mesh), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    assert p.model.up.placements == (Shard(2),) and p.model.down.weight.placements == (Shard(1),)


@checks("shardkit")  # FSDP2 requires even division on dims other than 0
def uneven_shards_on_dims_1_and_2_match_reference(mesh, impl):
    p = Parity.build(lambda: Experts(hidden=5), shard_dims(impl, mesh), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    assert p.model.up.to_local().shape == (3, 6, 3 - mesh.get_local_rank())  # 5 = 3 + 2


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_composition_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
