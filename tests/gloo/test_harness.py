"""The gloo harness itself: ``pytest -k`` narrows what the spawned ranks run (the parent passes
the selected cases, the ranks run only those), and one spawn runs many modules, a module that
crashes the ranks leaving the ones after it to the next spawn; a check that hangs is killed,
each rank's stack in its output. The unit tests run in this process (make test-fast); the
others start ranks."""

from types import SimpleNamespace

import pytest

from gloo_harness import PASSED, Case, _sim_problem, select_cases, selected_cases, spawn_batch

CASES = [Case("a", "shardkit"), Case("a", "torch"), Case("b", "shardkit")]


def test_select_cases_keeps_the_named_ones_in_registration_order():
    assert select_cases(CASES, None) == CASES
    assert select_cases(CASES, ["b-shardkit", "a-torch"]) == [Case("a", "torch"), Case("b", "shardkit")]
    assert select_cases(CASES, []) == []
    with pytest.raises(ValueError, match="no such gloo cases"):
        select_cases(CASES, ["c-shardkit"])


def item(module, case=None, fixtures=("gloo_outcomes",)):
    callspec = SimpleNamespace(params={"case": case}) if case is not None else None
    return SimpleNamespace(module=module, fixturenames=list(fixtures), callspec=callspec)


def test_the_parent_passes_only_the_selected_items_cases_of_the_module():
    mine, other = object(), object()
    items = [item(other, CASES[0]), item(mine, CASES[1]), item(mine, CASES[2]), item(mine, CASES[1]),
             item(mine, None, fixtures=("tmp_path",))]  # a test of the module that runs no case
    assert selected_cases(items, mine) == ["a-torch", "b-shardkit"]
    assert selected_cases([], mine) == []
    assert selected_cases(items + [item(mine)], mine) is None  # an unparametrized item: every case


def test_a_modules_sim_counts_are_its_share_of_the_ranks_totals():
    assert _sim_problem((10, 2, 0), (30, 5, 0), "") is None
    assert "0 cross-stream edges" in _sim_problem((10, 2, 0), (30, 2, 0), "")
    assert "1 races" in _sim_problem((10, 2, 0), (30, 5, 1), "")
    assert "no simulated-streams checker" in _sim_problem((0, 0, 0), None, None)
    # pytest -k selected some cases only: one may communicate nothing, but it may not race
    assert _sim_problem((10, 2, 0), (30, 2, 0), "", narrowed=True) is None
    assert "1 races" in _sim_problem((10, 2, 0), (30, 2, 1), "", narrowed=True)


PROBE = '''
import os
from gloo_harness import Checks, run_worker

checks = Checks()


@checks("shardkit")
def first(mesh, impl):
    open(os.path.join({out!r}, "first-%d" % mesh.get_rank()), "w").close()


@checks("shardkit")
def second(mesh, impl):
    {second}
'''


@pytest.mark.subprocess
def test_spawned_ranks_run_only_the_selected_cases_and_the_modules_after_a_crash_run_again(tmp_path):
    def probe(name: str, second: str) -> str:
        (tmp_path / f"{name}.py").write_text(PROBE.format(out=str(tmp_path / name), second=second))
        (tmp_path / name).mkdir()
        return str(tmp_path / f"{name}.py")

    narrowed, crashing, after = (probe("harness_probe_narrowed", "raise AssertionError('never selected')"),
                                 probe("harness_probe_crashing", "os._exit(3)"),
                                 probe("harness_probe_after", "pass"))
    (tmp_path / "one").mkdir()
    batch = spawn_batch({narrowed: ["first-shardkit"], crashing: None, after: None}, 2, tmp_path / "one")
    assert list(batch.outcomes) == [narrowed, crashing]  # the ranks never reached `after`
    ran = batch.outcomes[narrowed]
    assert ran.per_rank == [{"first-shardkit": PASSED}] * 2  # `second` was not selected: it did not run
    assert sorted(p.name for p in (tmp_path / "harness_probe_narrowed").iterdir()) == ["first-0", "first-1"]
    ran.assert_passed(Case("first", "shardkit"))
    crashed = batch.outcomes[crashing]
    crashed.assert_passed(Case("first", "shardkit"))
    with pytest.raises(AssertionError, match="no outcome .crashed"):
        crashed.assert_passed(Case("second", "shardkit"))

    (tmp_path / "two").mkdir()
    again = spawn_batch({after: None}, 2, tmp_path / "two")
    assert again.outcomes[after].per_rank == [{"first-shardkit": PASSED, "second-shardkit": PASSED}] * 2


@pytest.mark.subprocess
def test_a_check_past_its_time_is_killed_and_each_ranks_tail_shows_where_it_hung(tmp_path):
    (tmp_path / "harness_probe_hanging").mkdir()
    hanging = tmp_path / "harness_probe_hanging.py"
    hanging.write_text(PROBE.format(out=str(tmp_path / "harness_probe_hanging"),
                                    second="import time\n    time.sleep(300)  # the hang"))
    (tmp_path / "run").mkdir()
    batch = spawn_batch({str(hanging): None}, 2, tmp_path / "run", timeout_s=8)
    outcomes = batch.outcomes[str(hanging)]
    assert outcomes.timed_out and batch.wall_s < 60
    assert outcomes.per_rank == [{"first-shardkit": PASSED}] * 2  # `second` never finished
    for tail in outcomes.stderr_tails:  # faulthandler's dump, written before the kill
        assert "harness_probe_hanging.py\", line" in tail and "in second" in tail, tail
    with pytest.raises(AssertionError, match="no outcome .timed out"):
        outcomes.assert_passed(Case("second", "shardkit"))


SLOW = '''
import time
from gloo_harness import Checks, run_worker

checks = Checks()


@checks("shardkit")
def quick(mesh, impl):
    pass


@checks("shardkit")
def slow(mesh, impl):
    time.sleep(6)


@checks("shardkit")
def slow_again(mesh, impl):
    time.sleep(6)
'''


@pytest.mark.subprocess
def test_the_time_limit_is_per_check_not_per_module(tmp_path):
    """Two checks of 6 s each under a 10 s limit: the module runs past it, no check does (a
    module of several compiling checks is slow, not hung)."""
    (tmp_path / "harness_probe_slow.py").write_text(SLOW)
    (tmp_path / "run").mkdir()
    batch = spawn_batch({str(tmp_path / "harness_probe_slow.py"): None}, 2, tmp_path / "run", timeout_s=10)
    outcomes = batch.outcomes[str(tmp_path / "harness_probe_slow.py")]
    assert not outcomes.timed_out and batch.wall_s > 12, batch.wall_s
    assert outcomes.per_rank == [{"quick-shardkit": PASSED, "slow-shardkit": PASSED, "slow_again-shardkit": PASSED}] * 2
