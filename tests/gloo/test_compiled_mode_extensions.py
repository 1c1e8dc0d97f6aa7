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
from gloo_parity import full
from test_extensions import STEPS, float8_training

checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)


@checks("shardkit", sim=False)
def torchao_float8_weights_gather_one_byte_per_element_and_match_eager_bit_for_bit(mesh, impl):
    """Each float8 weight's fsdp_pre_all_gather casts its shard to float8 (the scale from the
    amax all-reduced over the ranks) and the graph all-gathers those bytes; fsdp_post_all_gather
    makes the Float8TrainingTensor the matmul reads, and its high-precision gradient is
    reduce-scattered with the group's. Resharded after forward (the blocks) or not (the root,
    and every group with False): the same losses and parameters as eager shardkit, bit for bit."""
    for reshard in (None, False):
        eager_model, eager = float8_training(mesh, shardkit.fully_shard, reshard_after_forward=reshard)
        torch._dynamo.reset()
        with shardkit.trace() as t:
            model, compiled = float8_training(mesh, shardkit.compiled.fully_shard, backend="aot_eager", reshard_after_forward=reshard)
        assert [torch.equal(a, b) for a, b in zip(compiled, eager)] == [True] * STEPS, (reshard, compiled, eager)
        for (name, p), q in zip(model.named_parameters(), eager_model.parameters()):
            assert torch.equal(full(p.detach()), full(q.detach())), (reshard, name)
        # per block and step, ONE uint8 all-gather, as eager mode's: its 2 float8 weights, 32 x 64
        # one-byte elements each, and its LayerNorm's 2 x 64 fp32 (4 bytes each)
        gathers = [(e.group, str(e.dtype), e.numel) for e in t.collectives("all_gather") if e.group == "0"]
        assert gathers == [("0", "torch.uint8", 2 * 32 * 64 + 2 * 64 * 4)] * STEPS, gathers


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_mode_extensions(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
