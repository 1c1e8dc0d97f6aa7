"""``make fuzz``: the differential fuzzer for as long as it is asked, or a replay.

    python -m tests.fuzz.fuzz [--seconds 600] [--seed N]   # both tiers; prints each seed
    python -m tests.fuzz.fuzz --replay fuzz-repro.json     # one example, call by call

The first third of the time goes to the fake-process-group tier (in this process: errors and
collectives against FSDP2 at world 2..8), the rest to the gloo tier (numerics against the
unsharded model and FSDP2): two thirds of it on 2 rank processes, one third on 8 with HSDP x
TP meshes (``FUZZ_MESH=hsdp_tp``). A failure is shrunk to a minimal call
sequence, written to ``fuzz-repro-fake.json`` / ``fuzz-repro.json``, and the run stops.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gloo"))  # as tests/gloo/conftest.py has it

from gloo_harness import _grace, log_tail, start_rank  # noqa: E402

from tests.fuzz import gloo_fuzz  # noqa: E402


def spawn_gloo(env: dict, timeout_s: float, stream: bool = True, world: int = 2) -> tuple[dict | None, str]:
    """Run tests/fuzz/gloo_fuzz.py on ``world`` gloo ranks; (rank 0's result, the ranks' output tails)."""
    with tempfile.TemporaryDirectory() as tmp:
        base = {**os.environ, **env, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
        logs = [Path(tmp) / f"rank{rank}.log" for rank in range(world)]
        procs = [start_rank(gloo_fuzz.main, (Path(tmp), str(Path(tmp) / "init")), {**base, "RANK": str(rank)},
                            None if stream and rank == 0 else log) for rank, log in enumerate(logs)]
        _grace(procs, timeout_s)  # then killed
        tails = [f"--- rank {rank} (exit {proc.exitcode}) ---\n{log_tail(log, 4000)}" for rank, (proc, log) in enumerate(zip(procs, logs))]
        result_file = Path(tmp) / "result.json"
        result = json.loads(result_file.read_text()) if result_file.exists() else None
        return result, "\n".join(tails)


def fake_tier(seed: int, seconds: float, examples: int = 200) -> str | None:
    """Rounds of the fake-process-group fuzzer, a new seed each, until ``seconds`` have passed."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as with_seed
    from hypothesis import strategies as st

    from tests.fuzz import test_fake_fuzz

    start, round_seed = time.monotonic(), seed
    while time.monotonic() - start < seconds:
        print(f"fuzz (fake process group): seed {round_seed}, {examples} examples", flush=True)
        test = with_seed(round_seed)(
            settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))(
                given(data=st.data())(test_fake_fuzz.test_random_call_sequences_issue_fsdp2s_collectives.hypothesis.inner_test)
            )
        )
        try:
            test()
        except AssertionError as e:
            return f"seed {round_seed}: {e}"
        round_seed += 1
    return None


def replay(path: str) -> int:
    from tests.fuzz.sequences import from_json

    if path.endswith(".jsonl"):  # gloo examples, one a line, replayed in one run of the ranks (gloo_fuzz.replay)
        result, tails = spawn_gloo({"FUZZ_REPLAY": str(Path(path).resolve())}, timeout_s=1800)
        print(tails if result is None else f"FAILED: {result['failure']}" if result.get("failure") else "passed")
        return 1 if result is None or result.get("failure") else 0
    world, spec, commands = from_json(Path(path).read_text())
    if json.loads(Path(path).read_text()).get("tier") == "fake":
        from tests.fuzz.test_fake_fuzz import run_example

        print(f"replaying {path} on the fake process group, world {world}: {spec}")
        try:
            run_example(world, spec, commands, verbose=True)
        except AssertionError as e:
            print(f"FAILED: {e}")
            return 1
        print("passed")
        return 0
    result, tails = spawn_gloo({"FUZZ_REPLAY": str(Path(path).resolve())}, timeout_s=300, world=world)
    if result is None:
        print(tails)
        return 1
    return 1 if result.get("failure") else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=float(os.environ.get("FUZZ_S", "600")))
    parser.add_argument("--seed", type=int, default=int(os.environ.get("FUZZ_SEED", str(int(time.time()) % 100000))))
    parser.add_argument("--replay", metavar="FILE")
    args = parser.parse_args(argv)
    if args.replay:
        return replay(args.replay)
    print(f"fuzz: seed {args.seed}, {args.seconds:.0f} s (rerun: make fuzz FUZZ_SEED={args.seed} FUZZ_S={args.seconds:.0f})", flush=True)
    failure = fake_tier(args.seed, args.seconds / 3)
    if failure:
        print(f"FAILED (fake process group): {failure}")
        return 1
    # the gloo tier: half its time on 2 ranks (every mesh), the rest on 8 (HSDP x TP, each example 4x the CPU)
    tiers = [(2, {}, args.seconds * 4 / 9), (8, {"FUZZ_MESH": "hsdp_tp"}, args.seconds * 2 / 9)]
    passed = []
    for world, extra, seconds in tiers:
        env = {"FUZZ_SEED": str(args.seed), "FUZZ_S": str(seconds), "FUZZ_EXAMPLES": "50" if world == 2 else "6",
               "FUZZ_REPRO": str(ROOT / "fuzz-repro.json"), **extra}
        result, tails = spawn_gloo(env, timeout_s=seconds + 600, world=world)
        if result is None:
            crashed = ROOT / "fuzz-running.json"
            where = f"; the example running when they stopped: {crashed} (make fuzz REPLAY={crashed})" if crashed.exists() else ""
            print(f"FAILED (gloo, {world} ranks): no result{where}\n{tails}")
            return 1
        if result.get("failure"):
            return 1  # rank 0 printed it
        passed.append(f"{result['examples']} gloo examples on {world} ranks in {result['seconds']} s")
    print(f"fuzz: passed ({'; '.join(passed)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
