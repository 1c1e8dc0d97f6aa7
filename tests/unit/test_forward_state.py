"""Compiled mode's forward states (shardkit/compiled/forward_state.py): the code moves as the
table says, every other move raises, and the module docstring draws the table."""

import itertools

import pytest

from shardkit.compiled import forward_state
from shardkit.compiled.forward_state import TRANSITIONS, Act, Event, Forwarding, Gathering, IllegalGathering

STATES = [Gathering.IDLE, Gathering.EARLY, Gathering.RUNNING, Gathering.HELD]
GATHERED = {Gathering.IDLE: None, Gathering.EARLY: ["early"], Gathering.RUNNING: ["running"], Gathering.HELD: ["held"]}


def forwarding_in(state: str) -> Forwarding:
    f = Forwarding()
    f.state, f.gathered = state, GATHERED[state]
    f.marks = [] if f.gathered is None else ["mark"]
    f.scoped = state == Gathering.HELD
    return f


def move(f: Forwarding, event: Event, calls: list) -> None:
    gathering = lambda: (calls.append(1) or ["new"], ["new mark"])  # noqa: E731
    {Event.PRE_HOOK: lambda: f.pre_hook(gathering), Event.BEGIN: lambda: f.begin(gathering),
     Event.END: f.end, Event.END_IN_SCOPE: f.end, Event.CLOSE: f.close}[event]()


@pytest.mark.parametrize("state,event", list(itertools.product(STATES, Event)))
def test_each_move_is_the_table_s_and_any_other_raises(state, event):
    f, calls = forwarding_in(state), []
    f.scoped = event is Event.END_IN_SCOPE or (state == Gathering.HELD and event is not Event.END)
    before = f.gathered
    if (state, event) not in TRANSITIONS:
        with pytest.raises(IllegalGathering):
            move(f, event, calls)
        return
    move(f, event, calls)
    target, act = TRANSITIONS[(state, event)]
    assert f.state == target
    if act is Act.GATHER:
        assert calls == [1] and f.gathered == ["new"]
    elif act is Act.KEEP:
        assert calls == [] and f.gathered is before and before is not None
    else:
        assert calls == [] and f.gathered is None and f.marks == []


def test_a_spanning_group_is_held_between_its_modules_and_dropped_when_its_parent_ends():
    f, calls = Forwarding(), []
    f.open_scope()
    move(f, Event.BEGIN, calls)
    move(f, Event.END, calls)
    assert f.state == Gathering.HELD and f.gathered == ["new"]
    move(f, Event.BEGIN, calls)  # the group's second module: no second all-gather
    move(f, Event.END, calls)
    move(f, Event.CLOSE, calls)
    assert (f.state, f.gathered, f.scoped, calls) == (Gathering.IDLE, None, False, [1])


def test_the_module_docstring_draws_the_table():
    drawn = [line.strip() for line in forward_state.__doc__.splitlines() if "--" in line and ">" in line]
    assert drawn == forward_state.render_transitions().splitlines()
