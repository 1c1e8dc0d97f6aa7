"""Compiled mode's checks that need 4 gloo ranks: FSDP + tensor parallel on a 2x2 (dp, tp)
mesh; HSDP on a 2x2 (replicate, shard) mesh, with and without the all-reduce each microbatch;
reshard_after_forward=2; against the reference and bit for bit against eager shardkit. The
HSDP and reshard_after_forward=2 checks train a GPT of one block, its root traced inline and
its block as a nested compile region: what they check is per group, and every rank compiles
every graph (the 2-rank checks train two or three blocks, a block traced inline among them)."""

import pytest
import torch

from gloo_harness import Checks, run_worker
from gloo_parity import Parity, gpt_batches, gpt_loss, one_block_gpt
from shardkit.models.gpt import apply_fully_shard

GLOO_WORLD = 4
checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)


@checks("shardkit", sim=False)
def compiled_mode_with_tensor_parallel_2x2_matches_reference(mesh, impl):
    """shardkit.compiled on the same (dp, tp) mesh, run without torch.compile (the gather is the
    same code compiled; with fullgraph=True, aot_eager, it gave the same numbers when written:
    largest gradient difference 4.5e-08)."""
    import shardkit.compiled
    from test_composition import train_llama_2d

    train_llama_2d(mesh, impl, dp=2, tp=2, fully_shard=shardkit.compiled.fully_shard)


@checks("shardkit", sim=False)
def compiled_hsdp_accumulation_without_the_all_reduce_matches_eager_bit_for_bit(mesh, impl):
    """HSDP 2x2 (all-gathered and reduce-scattered over shard, all-reduced over replicate, as
    eager mode), three microbatches a step with set_requires_all_reduce(False) on the first two
    (reduce-scattered, the sums kept, all-reduced with the third's), two steps: compiled mode
    (aot_eager; the root traced inline, the block as a nested compile region) gives eager
    shardkit's bits, and the reference's summed gradients before each step."""
    import shardkit.compiled
    from test_composition import mesh_2d
    from compiled_parity import assert_same_bits, regions

    hsdp_mesh, runs = mesh_2d(2, 2), {}
    for mode, fully_shard in (("eager", shardkit.fully_shard), ("compiled", shardkit.compiled.fully_shard)):
        torch._dynamo.reset()
        with regions():
            p = Parity.build(one_block_gpt, lambda model: apply_fully_shard(model, fully_shard, mesh=hsdp_mesh), mesh, "compiled", loss_of=gpt_loss)
            sharded = p.model
            if mode != "eager":
                p.model = torch.compile(p.model, backend="aot_eager", fullgraph=True)
                assert [b._shardkit_state.region for b in sharded.blocks] == [True] and not sharded._shardkit_state.region
            for step in range(2):
                for i, batch in enumerate(gpt_batches(3, seed=30 + step)):
                    sharded.set_requires_all_reduce(i == 2)
                    p.forward_backward(batch)
                    if i < 2:
                        assert [n for n, q in sharded.named_parameters() if q.grad is not None] == [], (mode, step, i)  # nothing all-reduced yet
                p.assert_grads_match()
                p.optimizer_step()
        runs[mode] = p
    assert_same_bits(runs["compiled"], runs["eager"], "HSDP 2x2 without the all-reduce")


@checks("shardkit", sim=False)
def compiled_reshard_after_forward_2_matches_eager_bit_for_bit(mesh, impl):
    """reshard_after_forward=2 on 4 ranks: forward all-gathers each group in two steps (from the
    ranks equal modulo 2, what a rank keeps; then from its pair), backward gathers again only
    within the pair. The GPT compiled as one graph (aot_eager; the root traced inline, the
    block as a nested compile region) trains to eager shardkit's bits with the same setting,
    and to the reference's numbers; the trace shows where each all-gather ran."""
    import shardkit
    import shardkit.compiled
    from compiled_parity import assert_same_bits, regions

    runs = {}
    for mode, fully_shard in (("eager", shardkit.fully_shard), ("compiled", shardkit.compiled.fully_shard)):
        torch._dynamo.reset()
        with regions():
            p = Parity.build(one_block_gpt, lambda model: apply_fully_shard(model, fully_shard, mesh=mesh, reshard_after_forward=2), mesh, "compiled", loss_of=gpt_loss)
            sharded = p.model
            if mode != "eager":
                p.model = torch.compile(p.model, backend="aot_eager", fullgraph=True)
                assert [b._shardkit_state.region for b in sharded.blocks] == [True] and not sharded._shardkit_state.region
            batches = gpt_batches(3)
            with shardkit.trace() as t:
                p.forward_backward(batches[0])
            p.assert_grads_match()
            p.optimizer_step()
            p.train(batches[1:])
            p.assert_params_match()
        runs[mode] = p
        if mode != "eager":  # every group (the root too: apply_fully_shard gives it the setting) in two steps
            gathers = [(e.group, e.mesh_dim[-2:], e.world) for e in t.collectives("all_gather")]  # (mesh dims "<shard dim>%2", "<shard dim>/2")
            assert gathers == [(g, dim, 2) for g in ("", "blocks.0") for dim in ("%2", "/2")], gathers
    assert_same_bits(runs["compiled"], runs["eager"], "reshard_after_forward=2")


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_mode_on_four_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
