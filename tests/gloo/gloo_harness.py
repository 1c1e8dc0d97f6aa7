"""Run a test module's checks on real gloo ranks, spawned once per module.

Spawning ranks costs seconds, so a test module registers its checks with ``Checks`` and
the module-scoped fixture ``gloo_outcomes`` (conftest.py) runs the module file itself as
``world`` worker processes. Each worker runs every check in order and writes one JSON file
of outcomes ("passed" or a traceback) after each check, so a crash or a hang still leaves
the outcomes so far. Each pytest item then asserts one check's outcome on every rank.

A check must keep the ranks in step: it makes every pass/fail decision on values that are
equal on all ranks (all-reduced losses, full tensors) or after its last collective, and it
communicates only over its own mesh, a fresh process group. A check that raises on one rank
only leaves the other blocked on that group until CHECK_TIMEOUT_S; then the ranks meet
again on the default group and go on with the next check.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

CHECK_TIMEOUT_S = 10  # a check's collective that another rank never joins raises after this long
SYNC_TIMEOUT_S = 60  # ranks wait this long for each other between checks: longer than the above
PASSED = "passed"
IMPLS = ("shardkit", "torch")  # torch: torch.distributed.fsdp.fully_shard, to validate the check


@dataclass(frozen=True)
class Case:
    check: str
    impl: str

    def __str__(self) -> str:
        return f"{self.check}-{self.impl}"


# ``SHARDKIT_STREAMS=sim`` (make test's second run): shardkit takes its CUDA path over simulated
# streams that check every access (shardkit/comm/sim.py). Only shardkit's cases run then; each
# rank prints the checker's summary at exit, which the parent requires (see Outcomes).
SIM = os.environ.get("SHARDKIT_STREAMS") == "sim"
SIM_SUMMARY = re.compile(r"sim streams: (\d+) accesses checked, (\d+) cross-stream edges, (\d+) races")


class Checks:
    """A registry of ``fn(mesh, impl)`` checks, each run once per implementation given.
    ``sim=False``: not under simulated streams (torch.compile does not trace under the
    checker's dispatch mode)."""

    def __init__(self) -> None:
        self._fns: dict[str, tuple[Callable[[DeviceMesh, str], None], tuple[str, ...]]] = {}

    def __call__(self, *impls: str, sim: bool = True) -> Callable:
        def register(fn: Callable[[DeviceMesh, str], None]) -> Callable:
            if not SIM:
                self._fns[fn.__name__] = (fn, impls or IMPLS)
            elif sim and "shardkit" in (impls or IMPLS):
                self._fns[fn.__name__] = (fn, ("shardkit",))
            return fn

        return register

    def cases(self) -> list[Case]:
        return [Case(name, impl) for name, (_, impls) in self._fns.items() for impl in impls]

    def run(self, case: Case, mesh: DeviceMesh) -> None:
        self._fns[case.check][0](mesh, case.impl)


# Worker side -----------------------------------------------------------------------------
def run_worker(checks: Checks) -> None:
    """Entry point of a spawned rank: ``python <test module> <out_dir> <init_file>``."""
    out_dir, init_file = Path(sys.argv[1]), sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=SYNC_TIMEOUT_S),
    )
    outcomes: dict[str, str] = {}
    for case in checks.cases():
        # A fresh process group per check: a collective left unmatched by a failing check
        # cannot pair with the next check's, and only times out on its own group.
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=CHECK_TIMEOUT_S))
        mesh = DeviceMesh.from_group(group, "cpu")
        try:
            checks.run(case, mesh)
            outcomes[str(case)] = PASSED
        except Exception:
            outcomes[str(case)] = traceback.format_exc()
        _write_json(out_dir / f"rank{rank}.json", outcomes)
        if not _ranks_in_step(str(case), world):
            break
    dist.destroy_process_group()


def _ranks_in_step(name: str, world: int) -> bool:
    names: list[str | None] = [None] * world
    try:
        dist.all_gather_object(names, name)
    except Exception:
        return False
    return all(n == name for n in names)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)  # atomic: the parent never reads half a file


# Parent side -----------------------------------------------------------------------------
@dataclass
class Outcomes:
    """What every rank reported, plus the tail of its stderr for crashes and hangs."""

    per_rank: list[dict[str, str]]
    stderr_tails: list[str]
    timed_out: bool

    def assert_passed(self, case: Case) -> None:
        problems = []
        for rank, outcomes in enumerate(self.per_rank):
            outcome = outcomes.get(str(case))
            if outcome is None:
                why = "timed out" if self.timed_out else "crashed or stopped after ranks fell out of step"
                problems.append(f"rank {rank}: no outcome ({why}); stderr tail:\n{self.stderr_tails[rank]}")
            elif outcome != PASSED:
                problems.append(f"rank {rank}:\n{outcome}")
        if SIM and not problems:
            problems += [f"rank {rank}: {why}" for rank, why in enumerate(map(_sim_problem, self.stderr_tails)) if why]
        assert not problems, f"{case} failed\n" + "\n".join(problems)


def _sim_problem(tail: str) -> str | None:
    """What is wrong with a rank's simulated-streams summary, if anything."""
    found = SIM_SUMMARY.findall(tail)
    if not found:
        return f"printed no 'sim streams: ...' summary; output tail:\n{tail}"
    accesses, edges, races = map(int, found[-1])
    if races or not accesses or not edges:
        return f"sim streams: {accesses} accesses checked, {edges} cross-stream edges, {races} races"
    return None


def spawn_ranks(module_file: str, world: int, tmp: Path, timeout_s: float) -> Outcomes:
    """Run ``module_file`` as ``world`` gloo ranks; kill them all after ``timeout_s``."""
    env = {**os.environ, "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp / f"rank{rank}.stderr", "w+")
        cmd = [sys.executable, module_file, str(tmp), str(tmp / "init_file")]
        procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + timeout_s
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    per_rank, tails = [], []
    for rank, log in enumerate(logs):
        log.seek(0)
        tails.append(log.read()[-3000:])
        log.close()
        path = tmp / f"rank{rank}.json"
        per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    return Outcomes(per_rank, tails, timed_out)
