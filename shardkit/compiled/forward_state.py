"""Compiled mode: the states of a group's forward (forwarding.py drives them).

The states (``Gathering``), what moves them (``Event``) and what each move does (``Act``: gather,
keep what is gathered, or drop it). ``TRANSITIONS`` is the whole table, drawn here, and
``Forwarding`` the one writer of the state; an event with no row raises:

    IDLE    --pre_hook------> EARLY   gather
    EARLY   --pre_hook------> EARLY   gather
    HELD    --pre_hook------> EARLY   keep
    IDLE    --begin---------> RUNNING gather
    EARLY   --begin---------> RUNNING keep
    HELD    --begin---------> RUNNING keep
    RUNNING --end-----------> IDLE    drop
    RUNNING --end_in_scope--> HELD    keep
    IDLE    --close---------> IDLE    drop
    EARLY   --close---------> IDLE    drop
    HELD    --close---------> IDLE    drop

A call of another module of the group inside a running one (``RUNNING``) gathers nothing and
changes nothing. ``region.py`` begins and ends a group as a forward does.
"""

from __future__ import annotations

import enum
from typing import Any, Callable

import torch


class Gathering:
    """The states, as strings: a traced forward reads its group's state, and dynamo guards a
    string by its value, where an enum member (one object that every group in the state shares)
    would cost one more guard per group, that two paths reach one object."""

    IDLE = "idle"  # nothing gathered: the modules read their sharded parameters
    EARLY = "early"  # gathered by the pre-hook, before the module's own pre-hooks; its forward not yet begun
    RUNNING = "running"  # one of the group's forwards runs; the modules read the gathered tensors
    HELD = "held"  # a spanning group between its modules' forwards, inside its parent's: kept gathered


class Event(enum.Enum):
    PRE_HOOK = "pre_hook"  # the gathering pre-hook of one of the group's modules
    BEGIN = "begin"  # one of the group's forwards begins (not a nested one)
    END = "end"  # it ends (returned or raised)
    END_IN_SCOPE = "end_in_scope"  # it ends, and the parent's forward still runs: a spanning group stays gathered
    CLOSE = "close"  # the parent's forward ended: a spanning group's scope closes


class Act(enum.Enum):
    GATHER = "gather"  # all-gather now (whatever was gathered before is dropped)
    KEEP = "keep"  # what is gathered stays (gather if nothing is: a scope's first module)
    DROP = "drop"  # drop the gathered tensors


# (state, event) -> (next state, what to do): every transition there is.
TRANSITIONS: dict[tuple[str, Event], tuple[str, Act]] = {
    (Gathering.IDLE, Event.PRE_HOOK): (Gathering.EARLY, Act.GATHER),
    (Gathering.EARLY, Event.PRE_HOOK): (Gathering.EARLY, Act.GATHER),
    (Gathering.HELD, Event.PRE_HOOK): (Gathering.EARLY, Act.KEEP),
    (Gathering.IDLE, Event.BEGIN): (Gathering.RUNNING, Act.GATHER),
    (Gathering.EARLY, Event.BEGIN): (Gathering.RUNNING, Act.KEEP),
    (Gathering.HELD, Event.BEGIN): (Gathering.RUNNING, Act.KEEP),
    (Gathering.RUNNING, Event.END): (Gathering.IDLE, Act.DROP),
    (Gathering.RUNNING, Event.END_IN_SCOPE): (Gathering.HELD, Act.KEEP),
    (Gathering.IDLE, Event.CLOSE): (Gathering.IDLE, Act.DROP),
    (Gathering.EARLY, Event.CLOSE): (Gathering.IDLE, Act.DROP),
    (Gathering.HELD, Event.CLOSE): (Gathering.IDLE, Act.DROP),
}


class IllegalGathering(RuntimeError):
    """An event the table has no row for (a bug in shardkit)."""


class Forwarding:
    """One group's forward: its state, whether its parent's forward holds it (``scoped``), and
    the gathered tensors with their marks (unused.py) while it is gathered."""

    state: str  # a Gathering
    scoped: bool  # a spanning group inside its parent's running forward
    gathered: list[torch.Tensor] | None  # per parameter, the unsharded tensor the modules read
    marks: list[torch.Tensor]  # per parameter, its mark (unused.py)

    def __init__(self) -> None:
        self.state, self.scoped, self.gathered, self.marks = Gathering.IDLE, False, None, []

    @property
    def idle(self) -> bool:
        return self.state == Gathering.IDLE

    @property
    def early(self) -> bool:
        return self.state == Gathering.EARLY

    @property
    def running(self) -> bool:
        return self.state == Gathering.RUNNING

    def open_scope(self) -> None:
        """The parent's forward begins: keep what the group gathers until it ends."""
        self.scoped = True

    def pre_hook(self, gathering: Callable) -> None:
        self._move(Event.PRE_HOOK, gathering)

    def begin(self, gathering: Callable) -> None:
        self._move(Event.BEGIN, gathering)

    def end(self) -> None:
        self._move(Event.END_IN_SCOPE if self.scoped else Event.END)

    def close(self) -> None:
        self.scoped = False
        self._move(Event.CLOSE)

    def _move(self, event: Event, gathering: Any = None) -> None:
        """``TRANSITIONS``, written out: traced code reads no table (each of its entries would be
        one more object dynamo guards, reached two ways). tests/fake/test_compiled_regions.py
        drives every row and checks that this is the table."""
        state = self.state
        if event is Event.PRE_HOOK and state != Gathering.RUNNING:
            if state != Gathering.HELD:
                self.gathered, self.marks = gathering()
            self.state = Gathering.EARLY
        elif event is Event.BEGIN and state != Gathering.RUNNING:
            if state == Gathering.IDLE:
                self.gathered, self.marks = gathering()
            self.state = Gathering.RUNNING
        elif event is Event.END and state == Gathering.RUNNING:
            self.gathered, self.marks, self.state = None, [], Gathering.IDLE
        elif event is Event.END_IN_SCOPE and state == Gathering.RUNNING:
            self.state = Gathering.HELD
        elif event is Event.CLOSE and state != Gathering.RUNNING:
            self.gathered, self.marks, self.state = None, [], Gathering.IDLE
        else:
            raise IllegalGathering(f"shardkit.compiled: no gathering transition from {state.upper()} on {event.name}")


def render_transitions() -> str:
    """``TRANSITIONS`` drawn, one row each (the module docstring shows it; a test compares)."""
    width = max(len(e.value) for e in Event) + 2
    return "\n".join(f"{state.upper():<7} --{event.value:-<{width}}> {target.upper():<7} {act.value}" for (state, event), (target, act) in TRANSITIONS.items())
