"""Compiled mode's set_reshard_after_backward(False) on 2 gloo ranks:
gradient accumulation whose later microbatches use what the previous backward kept instead of
all-gathering, against the unsharded model and bit for bit against eager shardkit."""

import pytest
import torch

import shardkit
from compiled_parity import assert_same_bits, regions, shard
from gloo_harness import Checks, run_worker
from gloo_parity import Parity, gpt_batches, gpt_loss, local, mixed_gpt

checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)


@checks("shardkit", sim=False)
def kept_after_backward_accumulation_matches_eager_bit_for_bit_and_gathers_again_after_a_step(mesh, impl):
    """set_reshard_after_backward(False) and three microbatches a step (sync on the last): the
    first forward all-gathers every group, the next two all-gather nothing (they use what the
    previous backward kept), and after the optimizer step the first forward all-gathers again
    (the kept parameters are stale: using them would miss the step, and the gradients would
    differ from the reference's). The second step's last microbatch turns it back on, and
    nothing stays kept. Compiled as one graph (aot_eager; block 0 and the root traced inline,
    blocks 1 and 2 as one nested compile region: gloo_parity.mixed_gpt) and eager shardkit: the
    same bits, and the reference's summed gradients before each step."""
    runs = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        with regions(2):
            p = Parity.build(mixed_gpt, shard(mode, mesh), mesh, "compiled", loss_of=gpt_loss)
            sharded = p.model
            if mode != "eager":
                p.model = torch.compile(p.model, backend="aot_eager", fullgraph=True)
                assert [b._shardkit_state.region for b in sharded.blocks] == [False, True, True]
            sharded.set_reshard_after_backward(False)
            gathered = []  # per microbatch: the groups its forward all-gathered
            for step in range(2):
                for i, batch in enumerate(gpt_batches(3, seed=50 + step)):
                    sharded.set_requires_gradient_sync(i == 2)
                    if step == 1 and i == 2:
                        sharded.set_reshard_after_backward(True)
                    with shardkit.trace() as t:  # forward: what it all-gathers
                        loss = p.loss_of(p.model, local(batch, mesh))
                    gathered.append(sorted({e.group for e in t.collectives("all_gather")}))
                    loss.backward()
                    p.loss_of(p.ref, batch).backward()
                if mode == "eager":  # its modules hold the unsharded parameters now (FSDP2's too): the gradients are the sharded ones'
                    for m in sharded.modules():
                        if isinstance(m, shardkit.FSDPModule):
                            m.reshard()
                p.assert_grads_match()
                p.optimizer_step()
            if mode != "eager":
                kept = [leaf.grad for b in sharded.modules() if hasattr(b, "_shardkit_state") for leaf in b._shardkit_state._kept.values()]
                assert kept and all(g is None for g in kept), mode
        runs[mode] = p
        groups = ["", "blocks.0", "blocks.1", "blocks.2"]
        assert gathered == [groups, [], [], groups, [], []], (mode, gathered)
    assert_same_bits(runs["compiled"], runs["eager"], "kept after backward")


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_mode_kept_after_backward(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
