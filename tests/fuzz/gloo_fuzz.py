"""The differential fuzzer on real gloo ranks: numerics against the unsharded model and FSDP2.

One set of processes (2 ranks; 8 with FUZZ_MESH=hsdp_tp) runs many examples. Rank 0 drives
hypothesis and sends each example (a model spec and a call sequence) to the others; all run it in lockstep (``run_example``): after
every call the ranks exchange their verdicts, so that both stop at the same call. A failing
example is shrunk by hypothesis on rank 0 (rank 1 just runs what it is sent) and written as
JSON, replayable with ``python -m tests.fuzz.fuzz --replay FILE``.

Run as ``python -m tests.fuzz.gloo_fuzz OUT_DIR INIT_FILE`` under RANK / WORLD_SIZE, with
FUZZ_SEED, FUZZ_EXAMPLES (per round), FUZZ_S (rounds until this many seconds have passed; 0:
one round) and FUZZ_REPRO (the repro file); rank 0 writes OUT_DIR/result.json.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tests.fuzz.meshes import make_meshes
from tests.fuzz.sequences import Failure, Run, Spec, from_json, to_json

TIMEOUT_S = 60  # a collective one rank never joins raises after this long (a hang is a failure)


def run_example(spec: Spec, commands: list[tuple], meshes: dict, verbose: bool = False, stats: dict | None = None) -> str | None:
    """Run one example on every rank in lockstep; the first failure (same text on every rank), or None."""
    problem = None
    run = None
    try:
        run = Run(spec, meshes, numerics=True, compare_collectives=False)
    except Exception:
        problem = f"building the models: {traceback.format_exc(limit=6)}"
    problem = _agree(problem, "build")
    if problem is not None:
        return problem
    for i, cmd in enumerate(commands):
        try:
            run.execute(cmd)
        except Failure as e:
            problem = f"call {i} {cmd}: {e}"
        except Exception:
            problem = f"call {i} {cmd}: {traceback.format_exc(limit=8)}"
        problem = _agree(problem, cmd)
        if verbose and dist.get_rank() == 0:
            print(f"  {i:2d} {cmd}: {'ok' if problem is None else 'FAILED'}", flush=True)
        if problem is not None:
            return problem
    if stats is not None:
        stats["calls"] += sum(1 for line in run.log if line.endswith(": ok"))
        stats["skipped"] += sum(1 for line in run.log if "skipped" in line)
        torch_side = run.sides[1]
        why = "compared to the end" if torch_side.alive else re.sub(r"^\(.*?\): ", "", torch_side.why_out)[:90]
        why = f"bf16 witness, tied in one group: {why}" if torch_side.witness_only else why
        stats["fsdp2"][why] = stats["fsdp2"].get(why, 0) + 1
        stats["optim"][spec.optim] = stats["optim"].get(spec.optim, 0) + 1
    if verbose and dist.get_rank() == 0:
        for side in run.sides:
            print(f"  {side.impl}{' (bf16 witness only)' if side.witness_only else ''}: {'compared to the end' if side.alive else 'out: ' + side.why_out}")
    return None


def _agree(problem: str | None, where) -> str | None:
    """Every rank's verdict; the first rank's problem, named, if any rank has one."""
    verdicts: list = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, problem)
    for rank, p in enumerate(verdicts):
        if p is not None:
            return f"rank {rank}: {p}"
    return None


# Rank 0 drives, the others follow ---------------------------------------------------------------
def _send(message) -> None:
    dist.broadcast_object_list([message], src=0)


def _receive():
    box = [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def follow(meshes: dict) -> None:
    while True:
        message = _receive()
        if message is None:
            return
        spec, commands = message
        run_example(spec, commands, meshes)


def lead(meshes: dict, seed: int, examples: int, seconds: float, repro: str) -> dict:
    from tests.fuzz import strategies

    stats = {"examples": 0, "first_failure_at": None, "rounds": 0, "seeds": [], "failure": None, "calls": 0, "skipped": 0, "fsdp2": {}, "optim": {}}

    def check(data):
        spec = data.draw(strategies.specs(dist.get_world_size(), mesh=os.environ.get("FUZZ_MESH") or None), label="spec")
        commands = data.draw(strategies.sequences(compiled=spec.compiled_mode), label="commands")
        stats["examples"] += 1
        line = to_json(spec, commands, world=dist.get_world_size()) + "\n"  # (one line: json.dumps)
        if not stats.get("broke"):  # the example that broke the ranks stays (hypothesis's retries then fail at once)
            running(repro).write_text(line)  # left behind if the ranks die
        if os.environ.get("FUZZ_LOG"):  # every example in order: a crash caused by an earlier one replays as a .jsonl
            with open(os.environ["FUZZ_LOG"], "a") as log:
                log.write(line)
        _send((spec, commands))
        try:
            problem = run_example(spec, commands, meshes, stats=stats)
        except RuntimeError:  # a collective timed out: the ranks disagree on what runs
            stats["broke"] = True
            raise
        if problem is not None:
            if stats["first_failure_at"] is None:
                stats["first_failure_at"] = stats["examples"]
            Path(repro).write_text(to_json(spec, commands, world=dist.get_world_size()) + "\n")
            raise AssertionError(problem)

    try:
        _rounds(check, stats, seed, examples, seconds, repro)
    finally:
        _send(None)  # the follower stops, whatever happened here
    running(repro).unlink(missing_ok=True)
    return stats


def running(repro: str) -> Path:
    """Where the example being run is written first: a crash of the ranks (a segfault) leaves it
    there, to replay (fuzz.py names it)."""
    return Path(repro).with_name("fuzz-running.json")


def _rounds(check, stats: dict, seed: int, examples: int, seconds: float, repro: str) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed
    from hypothesis import strategies as st

    # Over 8 ranks a failing call can leave a tensor-parallel pair one collective apart (one rank
    # raised inside parallelize_module or a DTensor op, its partner did not), and the next example
    # then hangs: there the first failing example is the report, not shrunk.
    phases = list(Phase) if dist.get_world_size() <= 2 else [Phase.explicit, Phase.reuse, Phase.generate]
    start = time.monotonic()
    round_seed = seed
    while True:
        stats["rounds"] += 1
        stats["seeds"].append(round_seed)
        print(f"fuzz (gloo, {dist.get_world_size()} ranks): seed {round_seed}, {examples} examples", flush=True)
        test = with_seed(round_seed)(
            settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck), phases=phases)(
                given(data=st.data())(check)
            )
        )
        try:
            test()
        except AssertionError as e:
            stats["failure"] = f"seed {round_seed}: {e}\nshrunk repro: {repro} (python -m tests.fuzz.fuzz --replay {repro})"
            break
        round_seed += 1
        if time.monotonic() - start >= seconds:
            break
    stats["seconds"] = round(time.monotonic() - start, 1)


def replay(meshes: dict, path: str) -> str | None:
    """One example (a repro file), or (a ``.jsonl`` file, one example a line) many in one process,
    in order, as a fuzzing run left them: for what only a run of examples brings out."""
    if path.endswith(".jsonl"):
        for i, line in enumerate(Path(path).read_text().splitlines()):
            world, spec, commands = from_json(line)
            if dist.get_rank() == 0:
                print(f"replaying {path}:{i + 1}: {spec}", flush=True)
            problem = run_example(spec, commands, meshes)
            if problem is not None:
                return f"example {i + 1}: {problem}"
        return None
    world, spec, commands = from_json(Path(path).read_text())
    if dist.get_rank() == 0:
        print(f"replaying {path}: world {world}, {spec}", flush=True)
    return run_example(spec, commands, meshes, verbose=True)


def main(out_dir: Path, init_file: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    torch.set_num_threads(1)
    meshes = make_meshes(world)
    if os.environ.get("FUZZ_REPLAY"):
        problem = replay(meshes, os.environ["FUZZ_REPLAY"])
        result = {"failure": problem}
    elif rank == 0:
        result = lead(meshes, int(os.environ.get("FUZZ_SEED", "0")), int(os.environ.get("FUZZ_EXAMPLES", "20")),
                      float(os.environ.get("FUZZ_S", "0")), os.environ.get("FUZZ_REPRO", "fuzz-repro.json"))
    else:
        follow(meshes)
        result = None
    if rank == 0:
        (out_dir / "result.json").write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "failure"}), flush=True)
        if result.get("failure"):
            print("FAILED:", result["failure"], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
