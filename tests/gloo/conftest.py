import os
from pathlib import Path

import pytest

from gloo_harness import FIXTURE, TIMEOUT_S, Outcomes, selected_cases, spawn_batch

WORLD = 2


class GlooRuns:
    """The session's gloo modules, each run once: the first module asked for spawns the ranks
    for it and every pending module of the same world after it (gloo_harness.spawn_batch); a
    module the ranks never reached (one before it crashed or hung) runs in the next spawn."""

    def __init__(self, session, tmp_path_factory) -> None:
        self.tmp_path_factory = tmp_path_factory
        # file -> (world, the selected cases), in the order of the tests
        self.pending: dict[str, tuple[int, list[str] | None]] = {}
        for item in session.items:
            module = getattr(item, "module", None)
            if module is not None and FIXTURE in getattr(item, "fixturenames", ()) and _key(module) not in self.pending:
                self.pending[_key(module)] = (_world(module), selected_cases(session.items, module))
        self.done: dict[str, Outcomes] = {}
        self.spawns: list[tuple[int, list[str], float]] = []  # (world, modules, seconds)

    def outcomes(self, module) -> Outcomes:
        key = _key(module)
        if key not in self.pending and key not in self.done:  # not among the session's items: all cases
            self.pending[key] = (_world(module), None)
        while key not in self.done:
            world = self.pending[key][0]
            batch = [key] + [k for k, (w, _) in self.pending.items() if w == world and k != key]
            result = spawn_batch({k: self.pending[k][1] for k in batch}, world, self.tmp_path_factory.mktemp("gloo"), TIMEOUT_S)
            self.spawns.append((world, list(result.outcomes), result.wall_s))
            for k, outcomes in result.outcomes.items():
                self.done[k] = outcomes
                del self.pending[k]
        return self.done[key]


def _key(module) -> str:
    return str(Path(module.__file__).resolve())


def _world(module) -> int:
    return getattr(module, "GLOO_WORLD", WORLD)  # a module may set its own


@pytest.fixture(scope="session")
def gloo_runs(request, tmp_path_factory) -> GlooRuns:
    runs = GlooRuns(request.session, tmp_path_factory)
    request.config.stash[_RUNS] = runs
    return runs


@pytest.fixture(scope="module")
def gloo_outcomes(request, gloo_runs) -> Outcomes:
    """The requesting module's checks, run on WORLD gloo ranks (a module may set its own
    GLOO_WORLD), together with the other selected gloo modules; see gloo_harness.py."""
    return gloo_runs.outcomes(request.module)


_RUNS = pytest.StashKey[GlooRuns]()


def pytest_terminal_summary(terminalreporter, config):
    """With --durations: each gloo spawn's time, and each module's share of it in the ranks
    (pytest's own durations put a whole spawn on the first module's setup)."""
    runs = config.stash.get(_RUNS, None)
    if runs is None or config.option.durations is None:
        return
    terminalreporter.write_sep("=", "gloo spawns (seconds in the ranks per module)")
    for world, modules, seconds in runs.spawns:
        terminalreporter.write_line(f"{seconds:7.2f}s spawn of {world} ranks, {len(modules)} modules")
        for key in modules:
            module_s = runs.done[key].seconds
            shown = f"{module_s:7.2f}s" if module_s is not None else "      ?"
            terminalreporter.write_line(f"  {shown} {os.path.relpath(key, config.rootpath)}")
            done = runs.done[key]
            for case, case_s in sorted(done.case_seconds.items(), key=lambda kv: -kv[1]):
                if case_s >= 1.0:  # the cases worth a look
                    terminalreporter.write_line(f"    {case_s:7.2f}s {case}  ({done.case_cpu.get(case, 0.0):.1f} CPU-s in all ranks)")
