"""shardkit under torch.distributed.pipelining, next to torch's FSDP2: pp_worker.py on 4 gloo
ranks (a (pp=2, dp=2) mesh) runs GPipe, 1F1B and Interleaved1F1B with each implementation's
fully_shard on "dp" and checks the parameters after 2 SGD steps against an unsharded reference;
rank 0 also counts its collectives on the dp side (the second step: the first also runs torch's
metadata inference). One torchrun for all 6 cases."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("pp_worker.py")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
TOLERANCE = 1e-5
TIMEOUT_S = 300  # the worker gives up on a stuck case by itself (a 20 s group timeout, a 150 s watchdog)


@pytest.fixture(scope="module")
def cases() -> dict:
    """{(impl, schedule): rank 0's JSON line} of one torchrun of the worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", str(WORKER)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # its own session, so that a timeout ends torchrun's ranks too, not torchrun alone
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[test_pipeline] torchrun killed after {TIMEOUT_S} s"
    found = {}
    for line in out.splitlines():
        if line.startswith("{"):
            case = json.loads(line)
            found[case["impl"], case["schedule"]] = case
    found["_log"] = f"rc={proc.returncode}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-4000:]}"
    return found


def _case(cases: dict, impl: str, schedule: str) -> dict:
    case = cases.get((impl, schedule))
    assert case is not None, f"no line for {impl} {schedule}\n{cases['_log']}"
    assert case["ok"], f"{impl} {schedule} failed: {case['error']}\n{cases['_log']}"
    return case


@pytest.mark.parametrize("impl", ["fsdp2", "shardkit"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_parameters_match_the_unsharded_reference(cases, impl, schedule):
    case = _case(cases, impl, schedule)
    assert case["max_diff"] <= TOLERANCE, case
    if impl == "shardkit":  # what makes pipelining drive it as it drives FSDP2
        assert case["is_torch_fsdp_module"], case


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shardkit_collectives_per_step_at_most_fsdp2s(cases, schedule):
    ours, theirs = _case(cases, "shardkit", schedule), _case(cases, "fsdp2", schedule)
    shown = {k: (ours[k], theirs[k]) for k in ("all_gathers", "reductions", "groups_with_params", "step_counts")}
    assert ours["all_gathers"] <= theirs["all_gathers"], shown
    assert ours["reductions"] <= theirs["reductions"], shown
    # the gradients accumulate unreduced over the microbatches: one reduction per group with
    # parameters per step (pipelining's REDUCE_GRAD), not one per microbatch
    assert ours["groups_with_params"] > 0, shown
    assert ours["reductions"] == ours["groups_with_params"], shown
