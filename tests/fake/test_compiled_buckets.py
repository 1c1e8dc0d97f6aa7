"""Compiled mode buckets a group by eager mode's rule (shardkit/compiled/group.py,
``make_buckets``): ONE all-gather per group (bytes where the param dtypes differ), one
reduce-scatter per reduce dtype in eager mode's order, and frozen parameters beside trainable
ones left out of the reductions (LoRA: a frozen base, a trainable adapter). The same
collectives, dtypes and bytes as eager shardkit's trace, in order, on the fake process group
(world 8), with and without nested compile regions; each parameter's gradient dtype (or None)
as eager mode's. Numerics of mixed-dtype groups: the fuzzer (tests/fuzz, ``Spec.mixed``)."""

import pytest
import torch
import torch.nn as nn

import shardkit
import shardkit.compiled
from shardkit import MixedPrecisionPolicy
from shardkit.compiled import region
from tests.conftest import fake_world

BF16, FP32 = torch.bfloat16, torch.float32


class Mixed(nn.Module):
    """A base layer (bf16 or fp32) and an fp32 adapter in one group."""

    def __init__(self, base_dtype: torch.dtype) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16).to(base_dtype)
        self.adapter = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.base(x.to(self.base.weight.dtype)).float() + self.adapter(x)


CASES = {  # name -> (base dtype, policy, frozen base)
    "bf16-fp32": (BF16, None, False),
    "bf16-fp32-policy-bf16-fp32": (BF16, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32), False),
    "bf16-fp32-reduce-fp32": (BF16, MixedPrecisionPolicy(reduce_dtype=FP32), False),
    "lora-policy-bf16-fp32": (BF16, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32), True),
    "lora-fp32": (FP32, None, True),
}


def _run(mode: str, case: str, mesh, blocks: int) -> tuple[list, dict]:
    base_dtype, policy, frozen = CASES[case]
    torch.manual_seed(0)
    model = nn.Sequential(*(Mixed(base_dtype) for _ in range(blocks)))
    fully_shard = shardkit.fully_shard if mode == "eager" else shardkit.compiled.fully_shard
    kwargs = {} if policy is None else dict(mp_policy=policy)
    for block in model:
        if frozen:
            block.base.requires_grad_(False)
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    run = model if mode == "eager" else torch.compile(model, backend="aot_eager", fullgraph=True)
    x = torch.randn(4, 16)
    run(x).sum().backward()  # (a step first: the trace of a step in steady state)
    with shardkit.trace() as forward:
        loss = run(x).sum()
    with shardkit.trace() as backward:
        loss.backward()
    # backward's all-gathers (a block gathered again) are left out: compiled mode's are not
    # traced (tests/fake/test_compiled_graphs.py, the trace and timeline)
    trace = [(e.kind, e.group, e.dtype, e.nbytes) for t in (forward, backward) for e in t.collectives() if t is forward or e.kind != "all_gather"]
    return trace, {n: None if p.grad is None else p.grad.dtype for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", CASES)
def test_a_group_of_mixed_dtypes_or_frozen_parameters_has_eager_modes_collectives(case):
    with fake_world(8) as mesh:
        torch._dynamo.reset()
        eager, compiled = _run("eager", case, mesh, 1), _run("compiled", case, mesh, 1)
    assert compiled == eager
    gathers = [c for c in eager[0] if c[0] == "all_gather"]
    assert len(gathers) == 1  # one all-gather for the group, whatever its dtypes


@pytest.mark.parametrize("case", ["lora-fp32", "bf16-fp32", "lora-policy-bf16-fp32"])
def test_blocks_as_regions_have_eager_modes_collectives_too(monkeypatch, case):
    """Four such blocks as nested compile regions: the collectives traced around each region
    call (its one all-gather, its reductions) are eager mode's too."""
    monkeypatch.setattr(region, "REGIONS_FROM", 4)
    with fake_world(8) as mesh:
        torch._dynamo.reset()
        eager, compiled = _run("eager", case, mesh, 4), _run("compiled", case, mesh, 4)
        assert [block._shardkit_state.region for block in _compiled_blocks(case, mesh)] == [True] * 4
    assert compiled == eager


def _compiled_blocks(case: str, mesh) -> list[nn.Module]:
    """The blocks of ``_run``'s model of four blocks, sharded in compiled mode (not run)."""
    base_dtype, policy, frozen = CASES[case]
    model = nn.Sequential(*(Mixed(base_dtype) for _ in range(4)))
    for block in model:
        block.base.requires_grad_(not frozen)
        shardkit.compiled.fully_shard(block, mesh=mesh, **({} if policy is None else dict(mp_policy=policy)))
    shardkit.compiled.fully_shard(model, mesh=mesh, **({} if policy is None else dict(mp_policy=policy)))
    return list(model)
