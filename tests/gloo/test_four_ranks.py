"""Checks that need 4 gloo ranks.

- reshard_after_forward=2: after forward each rank keeps half of every parameter, backward
  gathers among pairs of ranks, and training matches the reference.
- FSDP + tensor parallel on a 2x2 (dp, tp) mesh, and HSDP on a 2x2 (replicate, shard) mesh,
  match the reference.

Compiled mode's 4-rank checks are in test_four_ranks_compiled.py.
"""

import pytest

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
