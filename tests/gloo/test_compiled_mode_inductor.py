"""shardkit.compiled on 2 gloo ranks with the default backend, inductor, and shardkit's overlap
pass."""

import pytest

from compiled_parity import train
from gloo_harness import Checks, run_worker
from gloo_parity import one_block_gpt

checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)


@checks("shardkit", sim=False)
def inductor_with_its_overlap_trains_like_the_unsharded_model(mesh, impl):
    """The default backend, with shardkit's overlap pass ordering its scheduler (each group's
    all-gather issued during the previous group's compute, reduce-scatters waited for late):
    a wait placed after an op that reads its collective would read a buffer gloo is still
    filling, and the gradients would not match. One block and the root: two groups whose
    collectives the pass moves against each other's compute (inductor's C++ kernels are most of
    this check; the order with two blocks: tests/fake/test_compiled_overlap.py)."""
    from shardkit.compiled import overlap

    before = overlap.REORDERED[0]
    compiled, losses = train(mesh, "compiled", "inductor", build=one_block_gpt)
    compiled.assert_params_match()  # against the unsharded model, after 3 steps
    assert overlap.REORDERED[0] > before  # the pass ran on the graphs and moved collectives


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_mode_with_inductor_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
