"""The differential fuzzer on 2 gloo ranks, a fixed-seed budget (``make fuzz`` runs it for as
long as it is asked): random call sequences over the public API train shardkit, torch's
FSDP2 and the unsharded model side by side, checking losses, parameters and gradients after
every call (tests/fuzz/gloo_fuzz.py)."""

import os

import pytest

from tests.fuzz.fuzz import spawn_gloo

pytestmark = pytest.mark.subprocess

SEED = int(os.environ.get("FUZZ_SEED", "20261201"))
EXAMPLES = int(os.environ.get("FUZZ_GLOO_EXAMPLES", "60"))


def test_random_call_sequences_train_as_the_unsharded_model_and_fsdp2(tmp_path):
    repro = tmp_path / "fuzz-repro.json"
    env = {"FUZZ_SEED": str(SEED), "FUZZ_EXAMPLES": str(EXAMPLES), "FUZZ_S": "0", "FUZZ_REPRO": str(repro)}
    result, tails = spawn_gloo(env, timeout_s=240, stream=False)
    assert result is not None, f"the fuzzer's ranks crashed or hung:\n{tails}"
    assert result["failure"] is None, f"{result['failure']}\nrepro:\n{repro.read_text() if repro.exists() else '(none)'}"
    assert result["examples"] >= EXAMPLES
