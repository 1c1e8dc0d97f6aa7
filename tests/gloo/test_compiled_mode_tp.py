"""shardkit.compiled with tensor parallel on 4 gloo ranks, a (dp 2, tp 2) mesh: Llama's blocks
parallelized over tp, then sharded over dp, trained against the unsharded model. Run without
torch.compile here (compiling Llama on 4 ranks costs make test ~20 s): the gather is the same
code either way; compiled with fullgraph=True (aot_eager) it gave the same numbers when it
was written (largest gradient difference 4.5e-08 in both)."""

import pytest

import shardkit.compiled
from gloo_harness import Checks, run_worker
from test_composition import train_llama_2d

GLOO_WORLD = 4
checks = Checks()


@checks("shardkit", sim=False)
def compiled_mode_with_tensor_parallel_2x2_matches_reference(mesh, impl):
    train_llama_2d(mesh, impl, dp=2, tp=2, fully_shard=shardkit.compiled.fully_shard)


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_mode_with_tensor_parallel_on_four_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
