"""shardkit.compiled on 2 gloo ranks with its repeated blocks as nested compile regions
(shardkit/compiled/region.py): eager shardkit's bits with aot_eager, the unsharded model's
numbers with inductor. (Graphs, keys and memory on the fake process group:
tests/fake/test_compiled_regions.py.)"""

import pytest
import torch

from compiled_parity import assert_same_bits, regions, shard, train
from gloo_harness import Checks, run_worker
from gloo_parity import Parity, gpt_batches, gpt_loss, small_gpt

checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)


@checks("shardkit", sim=False)
def blocks_as_regions_match_eager_shardkit_bit_for_bit(mesh, impl):
    """The blocks as one nested compile region (its subgraph called once per block): inductor
    (whose CPU code for a region called twice gave wrong gradients with buffer reuse on) gives
    the unsharded model's numbers; aot_eager gives eager shardkit's bits with a divide factor on
    one block, no reshard after forward and accumulation without sync. (Regions with the
    default settings against eager's bits: test_four_ranks_compiled.py and
    test_compiled_mode_kept.py, with their settings; without torch.compile, the fuzzer's.)"""
    with regions():
        inductor, _ = train(mesh, "compiled", "inductor")
        assert [b._shardkit_state.region for b in inductor.model._orig_mod.blocks] == [True, True]
        inductor.assert_params_match()
        runs = {}
        for mode, backend in (("eager", None), ("compiled", "aot_eager")):
            torch._dynamo.reset()
            p = Parity.build(small_gpt, shard(mode, mesh), mesh, "compiled", loss_of=gpt_loss)
            sharded = p.model
            sharded.blocks[1].set_gradient_divide_factor(3.0)  # one block only: the regions' key tells them apart
            sharded.set_reshard_after_forward(False)
            if backend is not None:
                p.model = torch.compile(p.model, backend=backend, fullgraph=True)
                assert [b._shardkit_state.region for b in sharded.blocks] == [True, True]
            for step in range(2):
                for i, batch in enumerate(gpt_batches(2, seed=20 + step)):
                    sharded.set_requires_gradient_sync(i == 1)
                    p.forward_backward(batch)
                    if i == 0:  # nothing reduced yet: no .grad, as in eager mode (not a region's zeros)
                        assert [n for n, q in sharded.named_parameters() if q.grad is not None] == [], (mode, step)
                p.optimizer_step()
            runs[mode] = p
        assert_same_bits(runs["compiled"], runs["eager"], "regions: divide factor 3 on one block, no reshard, accumulation")


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_regions_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
