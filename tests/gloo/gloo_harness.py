"""Run test modules' checks on real gloo ranks, spawned once for many modules.

Starting ranks costs seconds (each sets up its process group, imports shardkit and the test
module: longer than most modules' checks take), so a test module registers its checks with
``Checks`` and the module-scoped fixture ``gloo_outcomes`` (conftest.py) asks for the
outcomes of its module. The first such request starts ``world`` worker processes
(``start_rank``: forked from one process that imported torch once, as ``python
gloo_harness.py`` would run) that run the checks of every gloo module pytest selected with
the same world, one module after the other (a ``Batch``); each later module then finds its
outcomes ready. Only the cases
pytest selected run (``pytest -k`` narrows the spawned ranks' work too).

Each worker runs the checks in order and writes one JSON file of outcomes ("passed" or a
traceback) after each check, so a crash or a hang still leaves the outcomes so far. A
module that crashes or hangs the ranks (``TIMEOUT_S`` per check) gets the outcomes it had;
the modules after it run in a fresh spawn. Each pytest item then asserts one check's
outcome on every rank.

A check must keep the ranks in step: it makes every pass/fail decision on values that are
equal on all ranks (all-reduced losses, full tensors) or after its last collective, and it
communicates only over its own mesh, a fresh process group. A check that raises on one rank
only leaves the other blocked on that group until CHECK_TIMEOUT_S; then the ranks meet
again on the default group and go on with the next check.

A module also runs on its own as a script, ``python <module> <out_dir> <init_file>`` with
RANK and WORLD_SIZE set (``run_worker``): every check, or the cases named in the JSON list
of SHARDKIT_GLOO_CASES.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import multiprocessing
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

CHECK_TIMEOUT_S = 10  # a check's collective that another rank never joins raises after this long
# ... in a module of torch.compile checks (``Checks(compiling=True)``): each rank compiles a graph
# when it first runs it (AOTAutograd: the backward at the first backward), and under make
# test's load two ranks' compiles of one graph ended more than 10 s apart, so the first to reach
# the graph's next collective timed out waiting for the other (seen in a clean make test)
COMPILING_CHECK_TIMEOUT_S = 40
SYNC_TIMEOUT_S = 60  # ranks wait this long for each other between checks: longer than the above
TIMEOUT_S = 150  # a check that runs longer is killed with its ranks (the first includes start-up; compiling checks take 2-2.5x their time alone under make test's load)
PASSED = "passed"
IMPLS = ("shardkit", "torch")  # torch: torch.distributed.fsdp.fully_shard, to validate the check
CASES_ENV = "SHARDKIT_GLOO_CASES"  # run_worker: a JSON list of case names to run (default all)
FIXTURE = "gloo_outcomes"  # the fixture of a test item that asserts a case's outcome (conftest.py)


@dataclass(frozen=True)
class Case:
    check: str
    impl: str

    def __str__(self) -> str:
        return f"{self.check}-{self.impl}"


# ``SHARDKIT_STREAMS=sim`` (make test's second run): shardkit takes its CUDA path over simulated
# streams that check every access (shardkit/comm/sim.py). Only shardkit's cases run then; each
# module must leave accesses checked, cross-stream edges and no race (see Outcomes).
SIM = os.environ.get("SHARDKIT_STREAMS") == "sim"
SIM_SUMMARY = re.compile(r"sim streams: (\d+) accesses checked, (\d+) cross-stream edges, (\d+) races")


class Checks:
    """A registry of ``fn(mesh, impl)`` checks, each run once per implementation given.
    ``sim=False``: not under simulated streams (torch.compile does not trace under the
    checker's dispatch mode). ``compiling``: the checks compile graphs, and their collectives
    wait ``COMPILING_CHECK_TIMEOUT_S`` for the other ranks instead of ``CHECK_TIMEOUT_S``."""

    def __init__(self, compiling: bool = False) -> None:
        self._fns: dict[str, tuple[Callable[[DeviceMesh, str], None], tuple[str, ...]]] = {}
        self.collective_timeout_s = COMPILING_CHECK_TIMEOUT_S if compiling else CHECK_TIMEOUT_S

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


def select_cases(cases: list[Case], names: Iterable[str] | None) -> list[Case]:
    """The ``cases`` named in ``names`` (``str(case)``), in their registration order; all of
    them for None. A name that is no case is an error (a stale selection)."""
    if names is None:
        return list(cases)
    wanted = set(names)
    unknown = wanted - {str(c) for c in cases}
    if unknown:
        raise ValueError(f"no such gloo cases: {sorted(unknown)}; known: {[str(c) for c in cases]}")
    return [c for c in cases if str(c) in wanted]


# Worker side -----------------------------------------------------------------------------
# A worker's plan: [{"file": <test module>, "cases": [<case name>, ...] or null (all)}, ...].
# Its JSON file (out_dir/rank<R>.json) after each step:
#   {"current": <file>, "modules": {<file>: {"outcomes": {case: outcome}, "done": bool,
#       "narrowed": bool (some cases only), "seconds": float, "sim": <summary> (SIM only),
#       "error": <traceback> (only where the module did not import)}}}


def run_worker(checks: Checks) -> None:
    """Entry point of a module run as a script: ``python <test module> <out_dir> <init_file>``;
    the cases named in SHARDKIT_GLOO_CASES (a JSON list), else all."""
    names = json.loads(os.environ[CASES_ENV]) if os.environ.get(CASES_ENV) else None
    module_file = str(Path(sys.modules["__main__"].__file__).resolve())
    _run_plan(Path(sys.argv[1]), sys.argv[2], [(module_file, lambda: (checks, select_cases(checks.cases(), names)))])


def _main(out_dir: Path, init_file: str) -> None:
    """Entry point of a batch rank (``start_rank``, or ``python gloo_harness.py <out_dir>
    <init_file>``), the plan in out_dir/plan.json."""
    plan = json.loads((out_dir / "plan.json").read_text())
    _run_plan(out_dir, init_file, [(e["file"], lambda e=e: _load(e["file"], e["cases"])) for e in plan])


def _load(module_file: str, names: list[str] | None) -> tuple[Checks, list[Case]]:
    """A test module's checks and the cases to run. The module is imported under its own name
    (the one pytest gives a module of a folder without __init__.py, the folder on sys.path),
    so that its classes pickle by that name."""
    path = Path(module_file).resolve()
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    module = importlib.import_module(path.stem)
    if Path(module.__file__).resolve() != path:
        raise ImportError(f"{path.stem} is already {module.__file__}, not {path}")
    found = [v for v in vars(module).values() if isinstance(v, Checks)]
    if len(found) != 1:
        raise TypeError(f"{path} holds {len(found)} Checks registries, not one")
    return found[0], select_cases(found[0].cases(), names)


def _run_plan(out_dir: Path, init_file: str, steps: list[tuple[str, Callable[[], tuple[Checks, list[Case]]]]]) -> None:
    """Run each step's module: ``load()`` gives its checks and the cases to run."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=SYNC_TIMEOUT_S),
    )
    report: dict = {"current": None, "modules": {}}
    path = out_dir / f"rank{rank}.json"
    for module_file, load in steps:
        module = report["modules"][module_file] = {"outcomes": {}, "done": False}
        report["current"] = module_file
        _write_json(path, report)  # the parent's clock for this module starts now
        start = time.monotonic()
        try:
            checks, cases = load()
            module["narrowed"] = len(cases) < len(checks.cases())  # pytest selected some cases only
        except Exception:  # the module does not import: its cases report why
            module["error"] = traceback.format_exc()
            checks, cases = None, []
        in_step = True
        for case in cases:
            case_start, case_cpu = time.monotonic(), time.process_time()
            # A fresh process group per check: a collective left unmatched by a failing check
            # cannot pair with the next check's, and only times out on its own group.
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=checks.collective_timeout_s))
            mesh = DeviceMesh.from_group(group, "cpu")
            try:
                checks.run(case, mesh)
                module["outcomes"][str(case)] = PASSED
            except Exception:
                module["outcomes"][str(case)] = traceback.format_exc()
            module["seconds"] = time.monotonic() - start
            module.setdefault("case_seconds", {})[str(case)] = time.monotonic() - case_start
            module.setdefault("case_cpu", {})[str(case)] = time.process_time() - case_cpu
            _write_json(path, report)
            in_step = _ranks_in_step(f"{module_file}::{case}", world)
            if not in_step:
                break
        if not in_step:
            break
        module["seconds"] = time.monotonic() - start
        if SIM:
            module["sim"] = _sim_summary()
        module["done"] = True
        _write_json(path, report)
        if not _ranks_in_step(f"{module_file} done", world):
            break
    dist.destroy_process_group()


def _sim_summary() -> str | None:
    try:
        from shardkit.comm import sim

        return sim.current().summary()
    except Exception:  # no checker running: the parent says so
        return None


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
# Ranks are forked from one server process per test process (multiprocessing's forkserver,
# started by the first rank) that has imported these once: a rank then starts in a fraction of
# a second instead of importing torch and the test dependencies for seconds. The server is a
# fresh interpreter (nothing of the test process's state, no thread, no process group);
# shardkit is imported by each rank, after its environment is set (SHARDKIT_STREAMS).
PRELOAD = ["torch", "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
           "torch.distributed.checkpoint", "torch.testing", "numpy", "hypothesis", "safetensors", "transformers"]


def start_rank(target: Callable, args: tuple, env: dict[str, str], log: Path | None) -> multiprocessing.Process:
    """``target(*args)`` in a forked rank with exactly ``env`` as its environment, its stdout and
    stderr to ``log`` (None: this process's). Its ``exitcode`` is what ``python`` would return."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the server starts (a missing one is skipped)
    proc = context.Process(target=_rank_entry, args=(target, args, env, None if log is None else str(log)),
                           name=f"rank{env.get('RANK', '')}")
    proc.start()
    return proc


def _rank_entry(target: Callable, args: tuple, env: dict[str, str], log: str | None) -> None:
    os.environ.clear()
    os.environ.update(env)
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    faulthandler.enable()  # a rank that crashes (SIGSEGV, SIGABRT) leaves its stack in its log
    faulthandler.register(signal.SIGUSR1)  # _grace: where a rank hangs, in its log before it is killed
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # the server read it before the rank's env
    target(*args)


def log_tail(log: Path, chars: int) -> str:
    """The last ``chars`` characters a rank wrote to ``log`` (none: it never started), without
    the list of extension modules that faulthandler ends a crash's report with (one line that
    names every module loaded, inductor's compiled kernels too: it filled the tail and hid the
    stacks above it)."""
    if not log.exists():
        return ""
    text = re.sub(r"\nExtension modules: [^\n]*", "\n(extension modules left out)", log.read_text(errors="replace"))
    return text[-chars:]


@dataclass
class Outcomes:
    """What every rank reported for one module, plus the tail of its stderr for crashes and
    hangs, and under SHARDKIT_STREAMS=sim what is wrong with its summary, per rank."""

    per_rank: list[dict[str, str]]
    stderr_tails: list[str]
    timed_out: bool
    sim_problems: list[str | None] = field(default_factory=list)
    seconds: float | None = None  # the module's time in the ranks
    error: str | None = None  # why the module did not import in the ranks
    case_seconds: dict[str, float] = field(default_factory=dict)  # each case's time on rank 0
    case_cpu: dict[str, float] = field(default_factory=dict)  # each case's CPU time, all ranks together

    def assert_passed(self, case: Case) -> None:
        problems = []
        for rank, outcomes in enumerate(self.per_rank):
            outcome = outcomes.get(str(case))
            if outcome is None and self.error:
                problems.append(f"rank {rank}: the module did not import:\n{self.error}")
            elif outcome is None:
                why = "timed out" if self.timed_out else "crashed or stopped after ranks fell out of step"
                problems.append(f"rank {rank}: no outcome ({why}); stderr tail:\n{self.stderr_tails[rank]}")
            elif outcome != PASSED:
                problems.append(f"rank {rank}:\n{outcome}")
        if SIM and not problems:
            problems += [f"rank {rank}: {why}" for rank, why in enumerate(self.sim_problems) if why]
        assert not problems, f"{case} failed\n" + "\n".join(problems)


def _sim_counts(summary: str | None) -> tuple[int, int, int] | None:
    found = SIM_SUMMARY.findall(summary or "")
    return tuple(map(int, found[-1])) if found else None


def _sim_problem(before: tuple[int, int, int], after: tuple[int, int, int] | None, summary: str | None,
                 narrowed: bool = False) -> str | None:
    """What is wrong with a module's share of a rank's simulated-streams counts, if anything:
    a race, or no access or cross-stream edge checked at all (only races count where pytest
    selected some of the module's cases: one alone may well communicate nothing)."""
    if after is None:
        return f"no simulated-streams checker was running (summary: {summary!r})"
    accesses, edges, races = (a - b for a, b in zip(after, before))
    if races or (not narrowed and (not accesses or not edges)):
        return f"sim streams: {accesses} accesses checked, {edges} cross-stream edges, {races} races"
    return None


def selected_cases(items, module) -> list[str] | None:
    """The case names (``str(case)``) of ``module``'s selected items that assert a gloo outcome
    (``items``: the session's, after ``-k``/``-m``/node ids deselected the rest); None: run
    every case (an item not parametrized by ``case`` needs them all)."""
    names = []
    for item in items:
        if getattr(item, "module", None) is not module or FIXTURE not in getattr(item, "fixturenames", ()):
            continue
        callspec = getattr(item, "callspec", None)
        if callspec is None or "case" not in callspec.params:
            return None
        names.append(str(callspec.params["case"]))
    return list(dict.fromkeys(names))


@dataclass
class Batch:
    """One spawn of ``world`` ranks running ``modules`` (file -> case names or None) in order."""

    modules: dict[str, list[str] | None]
    world: int
    wall_s: float = 0.0
    outcomes: dict[str, Outcomes] = field(default_factory=dict)  # the modules it finished or stopped in


def spawn_batch(modules: dict[str, list[str] | None], world: int, tmp: Path, timeout_s: float = TIMEOUT_S) -> Batch:
    """Run ``modules``' checks on ``world`` gloo ranks, one module after the other; kill the
    ranks when one module runs longer than ``timeout_s``. The batch holds outcomes for every
    module it finished and for the one it stopped in (crash, hang, ranks out of step); the
    modules after that one are left out: run them again."""
    files = [str(Path(f).resolve()) for f in modules]
    (tmp / "plan.json").write_text(json.dumps([{"file": f, "cases": modules[m]} for f, m in zip(files, modules)]))
    env = {k: v for k, v in os.environ.items() if k != CASES_ENV}
    # TORCHINDUCTOR_COMPILE_THREADS=1: inductor compiles in the rank, without a pool of worker
    # processes (each importing torch) for the checks that compile with it
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    start = time.monotonic()
    logs = [tmp / f"rank{rank}.stderr" for rank in range(world)]
    procs = [start_rank(_main, (tmp, str(tmp / "init_file")), {**env, "RANK": str(rank)}, log) for rank, log in enumerate(logs)]
    timed_out = _wait(procs, tmp / "rank0.json", timeout_s)
    batch = Batch(dict(zip(files, modules.values())), world, wall_s=time.monotonic() - start)
    tails = [log_tail(log, 8000) for log in logs]
    reports = []
    for rank in range(world):
        path = tmp / f"rank{rank}.json"
        reports.append(json.loads(path.read_text())["modules"] if path.exists() else {})
    sim_before = [(0, 0, 0)] * world
    for f in files:
        mine = [r.get(f) for r in reports]
        done = all(m is not None and m["done"] for m in mine)
        error = next((m["error"] for m in mine if m and "error" in m), None)
        per_rank = [dict(m["outcomes"]) if m else {} for m in mine]
        sim_problems = []
        if SIM and done:
            after = [_sim_counts(m.get("sim")) for m in mine]
            sim_problems = [_sim_problem(b, a, m.get("sim"), m.get("narrowed", False)) for b, a, m in zip(sim_before, after, mine)]
            sim_before = [a or b for a, b in zip(after, sim_before)]
        seconds = max((m.get("seconds") or 0.0 for m in mine if m), default=None)
        case_seconds = dict(mine[0].get("case_seconds", {})) if mine[0] else {}
        case_cpu = {case: sum((m or {}).get("case_cpu", {}).get(case, 0.0) for m in mine) for case in case_seconds}
        batch.outcomes[f] = Outcomes(per_rank, tails, timed_out and not done, sim_problems, seconds, error,
                                     case_seconds=case_seconds, case_cpu=case_cpu)
        if not done:
            break  # the ranks stopped in this module: the ones after it never ran
    return batch


def _wait(procs: list[multiprocessing.Process], progress: Path, timeout_s: float) -> bool:
    """Wait for the ranks; kill them all when the check rank 0 is on has run ``timeout_s``
    (the clock restarts each time rank 0 writes its outcomes: at the start of each module and
    after each check; the first from the spawn) or one rank exits with an error. True: killed
    at a deadline."""
    current, deadline = None, time.monotonic() + timeout_s
    while True:
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            return False
        if any(c not in (None, 0) for c in codes):  # a crashed rank leaves the others waiting
            _grace(procs, SYNC_TIMEOUT_S)
            return False
        try:
            report = json.loads(progress.read_text())
            now_on = (report["current"], sum(len(m["outcomes"]) for m in report["modules"].values()))
        except (OSError, ValueError, KeyError):
            now_on = current
        if now_on != current:
            current, deadline = now_on, time.monotonic() + timeout_s
        if time.monotonic() > deadline:
            _grace(procs, 0)
            return True
        time.sleep(0.05)


def _grace(procs: list[multiprocessing.Process], seconds: float) -> None:
    """Give the other ranks ``seconds`` to notice and write their outcomes, then kill them."""
    end = time.monotonic() + seconds
    for proc in procs:
        proc.join(timeout=max(0.0, end - time.monotonic()))
    stuck = [proc for proc in procs if proc.exitcode is None]
    for proc in stuck:
        os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(0.5 if stuck else 0)
    for proc in stuck:
        proc.kill()
        proc.join()


def spawn_ranks(module_file: str, world: int, tmp: Path, timeout_s: float = TIMEOUT_S,
                cases: list[str] | None = None) -> Outcomes:
    """Run one module's checks (``cases``: the names to run, default all) on ``world`` ranks."""
    batch = spawn_batch({module_file: cases}, world, tmp, timeout_s)
    return next(iter(batch.outcomes.values()), Outcomes([{}] * world, [""] * world, False))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gloo_harness  # this file under its own name: the modules' ``Checks`` are its class

    gloo_harness._main(Path(sys.argv[1]), sys.argv[2])
