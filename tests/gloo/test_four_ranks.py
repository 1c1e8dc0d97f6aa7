"""Checks that need 4 gloo ranks.

- reshard_after_forward=2: after forward each rank keeps half of every parameter, backward
  gathers among pairs of ranks, and training matches the reference.
- FSDP + tensor parallel on a 2x2 (dp, tp) mesh (eager and compiled mode), and HSDP on a 2x2
  (replicate, shard) mesh, match the reference.
"""

import contextlib

import pytest
import torch

from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Parity, Stack, gpt_batches, gpt_loss, shard_blocks_then_root, small_gpt, stack_batches
from shardkit.models.gpt import apply_fully_shard

GLOO_WORLD = 4
checks = Checks()


@checks()
def stack_with_reshard_after_forward_2_matches_reference(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh, reshard_after_forward=2), mesh, impl)
    passes = p.train(stack_batches(4))
    p.assert_params_match()
    # forward: root + 2 blocks; backward: the 2 blocks again (among 2 ranks); 3 reduce-scatters
    counts = [(s.forward.all_gather, s.backward.all_gather, s.backward.reduce_scatter) for s in passes]
    assert counts == [(3, 2, 3)] * 4, counts


@checks()
def gpt_with_reshard_after_forward_2_matches_reference(mesh, impl):
    shard = lambda m: apply_fully_shard(m, FULLY_SHARD[impl], mesh=mesh, reshard_after_forward=2)
    p = Parity.build(small_gpt, shard, mesh, impl, loss_of=gpt_loss)
    p.train(gpt_batches(3))
    p.assert_params_match()


@checks("shardkit")
def backward_all_gathers_run_among_two_ranks(mesh, impl):
    import shardkit

    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh, reshard_after_forward=2), mesh, impl)
    batch = stack_batches(1)[0]
    with shardkit.trace() as t:
        p.step(batch)
    worlds = [(e.group, e.world) for e in t.collectives("all_gather")]
    assert worlds == [("", 4), ("blocks.0", 4), ("blocks.1", 4), ("blocks.1", 2), ("blocks.0", 2)], worlds


@checks()
def fsdp_with_tensor_parallel_2x2_matches_reference(mesh, impl):
    from test_composition import train_llama_2d

    train_llama_2d(mesh, impl, dp=2, tp=2)


@checks("shardkit", sim=False)
def compiled_mode_with_tensor_parallel_2x2_matches_reference(mesh, impl):
    """shardkit.compiled on the same (dp, tp) mesh, run without torch.compile (the gather is the
    same code compiled; with fullgraph=True, aot_eager, it gave the same numbers when written:
    largest gradient difference 4.5e-08)."""
    import shardkit.compiled
    from test_composition import train_llama_2d

    train_llama_2d(mesh, impl, dp=2, tp=2, fully_shard=shardkit.compiled.fully_shard)


@checks("shardkit", sim=False)
def compiled_mode_with_hsdp_2x2_matches_reference_and_eager_bit_for_bit(mesh, impl):
    """shardkit.compiled on a (replicate 2, shard 2) mesh, the GPT compiled as one graph
    (aot_eager): all-gathered over shard, reduce-scattered over shard and all-reduced over
    replicate, as eager mode: the same bits as eager shardkit's HSDP, and the reference's numbers."""
    import shardkit.compiled
    from test_composition import mesh_2d
    from compiled_parity import assert_same_bits

    hsdp_mesh, runs = mesh_2d(2, 2), {}
    for mode, fully_shard in (("eager", shardkit.fully_shard), ("compiled", shardkit.compiled.fully_shard)):
        torch._dynamo.reset()
        p = Parity.build(small_gpt, lambda model: apply_fully_shard(model, fully_shard, mesh=hsdp_mesh), mesh, "compiled", loss_of=gpt_loss)
        if mode == "compiled":
            p.model = torch.compile(p.model, backend="aot_eager", fullgraph=True)
        p.train(gpt_batches(3))
        p.assert_params_match()
        runs[mode] = p
    assert_same_bits(runs["compiled"], runs["eager"], "HSDP 2x2")


@checks("shardkit", sim=False)
def compiled_hsdp_accumulation_without_the_all_reduce_matches_eager_bit_for_bit(mesh, impl):
    """HSDP 2x2, three microbatches a step with set_requires_all_reduce(False) on the first two
    (reduce-scattered, the sums kept, all-reduced with the third's), two steps: compiled mode
    (aot_eager; and its blocks as nested compile regions) gives eager shardkit's bits, and the
    reference's summed gradients before each step."""
    import shardkit.compiled
    from test_composition import mesh_2d
    from compiled_parity import assert_same_bits, regions

    hsdp_mesh, runs = mesh_2d(2, 2), {}
    for mode, fully_shard, as_regions in (("eager", shardkit.fully_shard, False), ("compiled", shardkit.compiled.fully_shard, False),
                                          ("regions", shardkit.compiled.fully_shard, True)):
        torch._dynamo.reset()
        with regions() if as_regions else contextlib.nullcontext():
            p = Parity.build(small_gpt, lambda model: apply_fully_shard(model, fully_shard, mesh=hsdp_mesh), mesh, "compiled", loss_of=gpt_loss)
            sharded = p.model
            if mode != "eager":
                p.model = torch.compile(p.model, backend="aot_eager", fullgraph=True)
                assert all(b._shardkit_state.region is as_regions for b in sharded.blocks)
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
    assert_same_bits(runs["regions"], runs["eager"], "HSDP 2x2 without the all-reduce, regions")


@checks()
def hsdp_2x2_matches_reference(mesh, impl):
    from test_composition import hsdp, mesh_2d

    p = Parity.build(Stack, hsdp(impl, mesh_2d(2, 2)), mesh, impl)
    p.train(stack_batches(3))
    p.assert_params_match()


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_on_four_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
