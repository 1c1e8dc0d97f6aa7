"""A record of every phase change and collective, for tests and for users.

``with shardkit.trace() as t: ...`` collects events from every shardkit group in this
process; ``t.format()`` renders one line per event (stable enough to pin schedules with
expecttest) and ``t.summary()`` counts calls and bytes per collective kind. With no trace
active, recording costs one truthiness check.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(frozen=True)
class Event:
    """One thing that happened: a phase change, an unshard/reshard, or a collective."""

    kind: str  # "phase", "unshard", "reshard", or one of COLLECTIVES
    group: str  # the group's module FQN ("" for the root module)
    detail: str = ""  # "pre_forward: IDLE -> FORWARD" for phases
    dtype: torch.dtype | None = None
    numel: int = 0  # elements of the whole (unsharded side) buffer of a collective
    world: int = 1  # ranks taking part in a collective

    @property
    def nbytes(self) -> int:
        """Bytes of the collective's unsharded-side buffer (all-gather output, reduce-scatter input)."""
        return self.numel * self.dtype.itemsize if self.dtype is not None else 0

    def __str__(self) -> str:
        name = self.group or "<root>"
        if self.kind in COLLECTIVES:
            dtype = str(self.dtype).removeprefix("torch.")
            return f"{self.kind} {name} {dtype} numel={self.numel} world={self.world}"
        if self.detail:
            return f"{self.kind} {name} {self.detail}"
        return f"{self.kind} {name}"


@dataclass
class CollectiveStats:
    calls: int = 0
    nbytes: int = 0  # unsharded-side buffer bytes, summed
    wire_nbytes: int = 0  # bytes each rank sends: (world - 1) / world of the buffer, twice that
    # for an all-reduce (and for a reduce-scatter done as one, "via all_reduce", on gloo)


class Trace:
    """Events recorded while this trace was active, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def collectives(self, kind: str | None = None) -> list[Event]:
        wanted = (kind,) if kind else COLLECTIVES
        return [e for e in self.events if e.kind in wanted]

    def summary(self) -> dict[str, CollectiveStats]:
        """Calls and bytes per collective kind (every kind present, zero if unused)."""
        stats = {kind: CollectiveStats() for kind in COLLECTIVES}
        for e in self.collectives():
            s = stats[e.kind]
            s.calls += 1
            s.nbytes += e.nbytes
            passes = 2 if e.kind == "all_reduce" or e.detail == "via all_reduce" else 1
            s.wire_nbytes += passes * e.nbytes * (e.world - 1) // e.world
        return stats

    def format(self, kinds: tuple[str, ...] | None = None) -> str:
        """One line per event; ``kinds`` keeps only those kinds."""
        return "\n".join(str(e) for e in self.events if kinds is None or e.kind in kinds)

    def clear(self) -> None:
        self.events.clear()


# The traces currently recording (a stack, so nested ``trace()`` blocks both see events).
_active: list[Trace] = []


def record(kind: str, group: str, detail: str = "", **collective) -> None:
    """Append an event to every active trace; free when none is active."""
    if _active:
        event = Event(kind, group, detail, **collective)
        for t in _active:
            t.events.append(event)


def is_recording() -> bool:
    return bool(_active)


@contextlib.contextmanager
def trace() -> Iterator[Trace]:
    """Record shardkit's phase changes and collectives in this process.

    Example::

        with shardkit.trace() as t:
            model(x).sum().backward()
        print(t.format())
        print(t.summary()["all_gather"].calls)
    """
    t = Trace()
    _active.append(t)
    try:
        yield t
    finally:
        _active.remove(t)
