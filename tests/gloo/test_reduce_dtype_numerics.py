"""Gradients summed over tp in ``reduce_dtype`` (issue 32), on 4 gloo ranks, (dp 2, tp 2).

A LayerNorm under sequence parallel has a weight replicated over tp whose gradient is
``Partial`` there: each tp rank holds its sequence shard's part. With
``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` shardkit sums those parts in
fp32 (FSDP2 in bf16, pytorch#190626); the collectives (tests/dtype_audit.py) show it.

The fp32-reduced reference: the same bf16 parts (the same model, tensor parallel only, in
bf16, on the same rows), summed over tp and averaged over dp in fp32. shardkit's gradients
equal it up to fp32 rounding; FSDP2's are off by the bf16 sum. Both are also measured against
the fp32 unsharded model, where bf16 compute dominates either error.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor.parallel import parallelize_module

from gloo_harness import Checks, run_worker
from gloo_parity import full

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import shardkit  # noqa: E402
from tests.dtype_audit import Audit  # noqa: E402
from tests.fake.test_reduce_dtypes import SP_PLAN, SPBlock  # noqa: E402

GLOO_WORLD = 4
checks = Checks()
B, T, C = 4, 16, 16
PARTIAL = ("norm.weight", "norm.bias")  # the gradients Partial over tp


def gradients(fully_shard, mesh: DeviceMesh, x: torch.Tensor):
    """The (dp 2, tp 2) model's full gradients and its backward's collectives."""
    torch.manual_seed(0)
    model = nn.Sequential(SPBlock(C), SPBlock(C))
    mp = shardkit.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model:
        parallelize_module(block, mesh["tp"], SP_PLAN)
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    dp, tp = mesh.get_local_rank(0), mesh.get_local_rank(1)
    mine = x.chunk(2, dim=0)[dp].chunk(2, dim=1)[tp]  # (B/dp, T/tp, C): batch over dp, sequence over tp
    loss = model(mine).float().sum() * 2  # FSDP averages over dp; the reference sums the batch
    with Audit(mesh) as audit:
        loss.backward()
    return {name: full(p.grad) for name, p in model.named_parameters()}, audit


def fp32_reduced_reference(mesh: DeviceMesh, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tp-partial gradients of the model in bf16 (tensor parallel only: the same parts as
    under FSDP), summed over tp and averaged over dp in fp32."""
    torch.manual_seed(0)
    model = nn.Sequential(SPBlock(C), SPBlock(C)).to(torch.bfloat16)
    for block in model:
        parallelize_module(block, mesh["tp"], SP_PLAN)
    dp, tp = mesh.get_local_rank(0), mesh.get_local_rank(1)
    mine = x.chunk(2, dim=0)[dp].chunk(2, dim=1)[tp].to(torch.bfloat16)
    (model(mine).float().sum() * 2).backward()
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(PARTIAL):
            assert p.grad.placements[0].is_partial(), (name, p.grad.placements)
            part = p.grad._local_tensor.float()
            torch.distributed.all_reduce(part, group=mesh.get_group("tp"))
            torch.distributed.all_reduce(part, group=mesh.get_group("dp"))
            out[name] = part / 2
    return out


@checks("shardkit")
def tensor_parallel_partial_grads_are_closer_to_fp32_than_fsdp2s(mesh_1d, impl):
    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(B, T, C, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    ref = nn.Sequential(SPBlock(C), SPBlock(C))  # fp32, one process
    ref(x).sum().backward()
    expected = {name: p.grad for name, p in ref.named_parameters()}
    reduced_in_fp32 = fp32_reduced_reference(mesh, x)
    ours, our_audit = gradients(shardkit.fully_shard, mesh, x)
    theirs, their_audit = gradients(torch_fully_shard, mesh, x)
    assert {s.dtype for s in our_audit.sums() if s.mesh_dim == "tp"} == {torch.float32}
    assert {s.dtype for s in their_audit.sums() if s.mesh_dim == "tp"} == {torch.bfloat16}

    def error(grads, reference):  # over the tp-partial parameters: sum |g - reference| / sum |reference|
        names = [n for n in grads if n.endswith(PARTIAL)]
        return sum(float((grads[n] - reference[n]).abs().sum()) for n in names) / sum(float(reference[n].abs().sum()) for n in names)

    errors = {impl: (error(g, reduced_in_fp32), error(g, expected)) for impl, g in (("shardkit", ours), ("FSDP2", theirs))}
    print("tp-partial grads, relative error vs the fp32-reduced reference / vs the fp32 model: "
          + ", ".join(f"{impl} {a:.2e} / {b:.2e}" for impl, (a, b) in errors.items()))
    assert errors["shardkit"][0] < 1e-6 < errors["FSDP2"][0], errors
    # The other gradients are the same math on both (summed in fp32 over dp by both).
    for name in ours:
        if not name.endswith(PARTIAL):
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_on_four_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
