"""A shard dim of one rank (one process, HSDP with one rank per replica): nothing to all-gather
or reduce-scatter, so shardkit issues neither, as FSDP2 (its all-reduce over the replicas
stays). The c10d ops of a step on the fake process group, FSDP2 beside shardkit, over meshes x
knobs; then the numbers of one gloo process against the unsharded model."""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

import shardkit
from tests.conftest import forget_meshes


class C10dOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.startswith("c10d::"):
            self.seen[func._schema.name.removeprefix("c10d::")] += 1
        return func(*args, **kwargs or {})


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8, bias=False), nn.Linear(8, 1))  # [2]: one piece, gathered in place


def sharded(fully_shard, mp_cls, mesh, knob: str) -> nn.Module:
    kwargs = {"mp_policy": mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if knob == "bf16" else {}
    if knob == "no reshard":
        kwargs["reshard_after_forward"] = False
    m = model()
    fully_shard(m[0], mesh=mesh, **kwargs)
    fully_shard(m[2], mesh=mesh, **kwargs)
    fully_shard(m, mesh=mesh, **kwargs)
    for group in (m[0], m[2], m):  # (both setters are per group)
        if knob == "divide factor":
            group.set_gradient_divide_factor(3.0)
        if knob == "force sum":
            group.set_force_sum_reduction_for_comms(True)
    return m


MESHES = {"one process": (1, (1,), None), "hsdp 2x1": (2, (2, 1), ("replicate", "shard")), "hsdp 4x1": (4, (4, 1), ("replicate", "shard"))}
KNOBS = ["plain", "bf16", "no reshard", "divide factor", "force sum", "no sync, then sync"]


@pytest.mark.parametrize("knob", KNOBS)
@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_a_one_rank_shard_dim_issues_fsdp2s_collectives(mesh_name, knob):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world, shape, names = MESHES[mesh_name]
    seen = {}
    for impl, fully_shard, mp_cls in (("fsdp2", torch_fully_shard, TorchMP), ("shardkit", shardkit.fully_shard, shardkit.MixedPrecisionPolicy)):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            m = sharded(fully_shard, mp_cls, init_device_mesh("cpu", shape, mesh_dim_names=names), knob)
            with C10dOps() as ops, shardkit.trace() as t:
                for sync in ([False, True] if knob.startswith("no sync") else [True]):
                    m.set_requires_gradient_sync(sync)
                    m(torch.randn(4, 8)).sum().backward()
            seen[impl] = ops.seen
        finally:
            dist.destroy_process_group()
            forget_meshes()
    assert seen["shardkit"] == seen["fsdp2"], seen
    assert set(seen["shardkit"]) <= {"allreduce_"}, seen
    assert not t.collectives("all_gather") and not t.collectives("reduce_scatter"), t.format()


@pytest.mark.parametrize("knob", ["plain", "bf16", "divide factor", "no reshard"])
def test_one_gloo_process_trains_as_the_unsharded_model(knob):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        ref, m = model(), sharded(shardkit.fully_shard, shardkit.MixedPrecisionPolicy, mesh, knob)
        ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            ref(x).sum().backward()
            m(x).float().sum().backward()  # (bf16: the policy casts the input)
            for (name, p), q in zip(m.named_parameters(), ref.parameters()):
                want = q.grad / 3.0 if knob == "divide factor" else q.grad
                tol = dict(atol=2e-2, rtol=2e-2) if knob == "bf16" else dict(atol=0, rtol=0)
                torch.testing.assert_close(p.grad.full_tensor(), want, **tol, msg=lambda s: f"step {step}, {name}: {s}")
            if knob == "divide factor":
                for q in ref.parameters():
                    q.grad /= 3.0
            ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
        # each step reached the shards (not only the unsharded buffers a forward copies them into)
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), q.detach(), **tol, msg=lambda s: f"{name} after 3 steps: {s}")
    finally:
        dist.destroy_process_group()
        forget_meshes()
