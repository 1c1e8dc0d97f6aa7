"""Compiled mode with parameters that all-gather themselves (FSDP2's fsdp_pre_all_gather /
fsdp_post_all_gather): torchao's float8 training weights on 2 gloo ranks, the model compiled as
one graph (aot_eager), against eager shardkit with the same weights (itself checked against
FSDP2 bit for bit: test_extensions.py). A module of its own: the harness's time limit is per
module, and compiling comes near it under make test's load."""

import pytest
import torch

import shardkit
import shardkit.compiled
from gloo_harness import Checks, run_worker
from gloo_parity import full, mean_over_ranks
from test_extensions import STEPS, float8_model

checks = Checks()


def train_float8(mesh, fully_shard, compiled: bool, reshard_after_forward=None) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """The float8 model (2 blocks of Linear, LayerNorm, Linear) sharded per block and at the
    root, STEPS AdamW steps; the model and the losses (averaged over the ranks)."""
    torch._dynamo.reset()
    model = float8_model()
    for block in model:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, g = [], torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=g).chunk(mesh.size())[mesh.get_local_rank()]
        loss = run(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.detach(), mesh))
    return model, losses


@checks("shardkit", sim=False)
def torchao_float8_weights_gather_one_byte_per_element_and_match_eager_bit_for_bit(mesh, impl):
    """Each float8 weight's fsdp_pre_all_gather casts its shard to float8 (the scale from the
    amax all-reduced over the ranks) and the graph all-gathers those bytes; fsdp_post_all_gather
    makes the Float8TrainingTensor the matmul reads, and its high-precision gradient is
    reduce-scattered with the group's. Resharded after forward (the blocks) or not (the root,
    and every group with False): the same losses and parameters as eager shardkit, bit for bit."""
    for reshard in (None, False):
        eager_model, eager = train_float8(mesh, shardkit.fully_shard, compiled=False, reshard_after_forward=reshard)
        with shardkit.trace() as t:
            model, compiled = train_float8(mesh, shardkit.compiled.fully_shard, compiled=True, reshard_after_forward=reshard)
        assert [torch.equal(a, b) for a, b in zip(compiled, eager)] == [True] * STEPS, (reshard, compiled, eager)
        for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
            assert torch.equal(full(p.detach()), full(q.detach())), (reshard, name)
        # per block and step: its 2 float8 weights, 32 x 64 one-byte elements each, in one uint8
        # all-gather; its LayerNorm's 2 x 64 fp32 in another (eager mode: both in one)
        gathers = {(e.group, str(e.dtype), e.numel) for e in t.collectives("all_gather") if e.group.startswith("0")}
        assert gathers == {("0", "torch.uint8", 2 * 32 * 64), ("0", "torch.float32", 2 * 64)}, gathers


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_mode_extensions(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
