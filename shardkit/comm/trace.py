"""A record of every phase change and collective, for tests and for users.

``with shardkit.trace() as t: ...`` collects events from every shardkit group in this
process; ``t.format()`` renders one line per event (stable enough to pin schedules with
expecttest), ``t.format(times=True)`` adds when each happened, and ``t.summary()`` counts
calls and bytes per collective kind. ``comm/timeline.py`` turns the traces of all ranks into
one Perfetto timeline. With no trace active, recording costs one truthiness check.

Events, one line each: ``phase`` (a rule of the schedule fired), ``unshard`` / ``reshard``, a
collective issued (``all_gather``, ``reduce_scatter``, ``all_reduce``; ``all_to_all`` from a
matrix optimizer's step, ``shardkit/optim/owners.py``), and ``wait``: the
runtime waited for a collective and took its results (copy-out, or the gradients handed to
``.grad``). Every collective gets exactly one ``wait`` line, so a trace pins when each one is
finished as well as when it is issued.

Times are ``time.perf_counter_ns()`` on the host. A collective has three: ``t`` when it was
issued, ``wait_ns`` when the runtime started waiting for it, and ``done_ns`` when it
completed (CPU: the work's completion callback; CUDA: a timing event on its side stream,
read through ``done_at`` once the trace ends; ``comm/streams.py`` sets both). On CUDA
``wait_ns`` too is read off a timing event (``wait_at``): when the compute stream reached
the wait, so that ``exposed_ns`` is device time the compute stream spent waiting.
``done_ns - wait_ns``, when positive, is communication the compute did not hide.

Setting ``SHARDKIT_TRACE=<folder>`` traces the whole run (``comm/timeline.py``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")  # all_to_all: optimizers (shardkit.optim)
MAX_EVENTS = 1_000_000  # per trace; later events are counted in ``Trace.dropped``, not kept


@dataclass(slots=True)
class Record:
    """One thing that happened: a phase change, an unshard/reshard, or a collective."""

    kind: str  # "phase", "unshard", "reshard", "wait", or one of COLLECTIVES
    group: str  # the group's module FQN ("" for the root module)
    detail: str = ""  # "pre_forward: IDLE -> FORWARD" for phases; "via all_reduce"; a wait's collective
    dtype: torch.dtype | None = None
    numel: int = 0  # elements of the whole (unsharded side) buffer of a collective
    world: int = 1  # ranks taking part in a collective
    mesh_dim: str = ""  # the mesh dimension a collective runs over ("dp", "shard", "replicate", ...)
    op: str = ""  # a reduction's ReduceOp ("sum", "avg"; not shown in the line)
    divide_by: float = 1.0  # a reduction: what the result is divided by after it (not shown)
    t: int = 0  # perf_counter_ns when it happened (a collective: when it was issued)
    wait_ns: int = 0  # a collective: when a hook started waiting for it (0: not yet)
    done_ns: int = 0  # a collective: when it completed (0: not yet)
    done_at: Callable[[], int] | None = None  # CUDA: reads done_ns off a timing event (``resolve``)
    wait_at: Callable[[], int] | None = None  # CUDA: reads wait_ns off a timing event

    @property
    def exposed_ns(self) -> int:
        """How long a hook waited for this collective: the communication compute did not hide."""
        return max(0, self.done_ns - self.wait_ns) if self.wait_ns and self.done_ns else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the collective's unsharded-side buffer (all-gather output, reduce-scatter input)."""
        return self.numel * self.dtype.itemsize if self.dtype is not None else 0

    def __str__(self) -> str:
        name = self.group or "<root>"
        if self.kind in COLLECTIVES:
            dtype = str(self.dtype).removeprefix("torch.")
            via = f" {self.detail}" if self.detail else ""
            return f"{self.kind} {name} {dtype} numel={self.numel} world={self.world} mesh={self.mesh_dim}{via}"
        if self.kind == "wait":
            return f"wait {self.detail} {name}"
        if self.detail:
            return f"{self.kind} {name} {self.detail}"
        return f"{self.kind} {name}"


@dataclass
class CollectiveStats:
    calls: int = 0
    nbytes: int = 0  # unsharded-side buffer bytes, summed
    wire_nbytes: int = 0  # bytes each rank sends: (world - 1) / world of the buffer, twice that
    # for an all-reduce (and for a reduce-scatter done as one, "via all_reduce", HSDP on gloo)
    exposed_ns: int = 0  # time hooks spent waiting for these collectives (not hidden by compute)


class Trace:
    """Events recorded while this trace was active, in order, on one rank."""

    def __init__(self) -> None:
        self.events: list[Record] = []
        self.dropped = 0  # events past MAX_EVENTS
        self.rank: int | None = dist.get_rank() if dist.is_initialized() else None  # else at the first event
        # perf_counter is per machine; the wall clock lines ranks on several machines up.
        self.start_ns = time.perf_counter_ns()
        self.start_wall_ns = time.time_ns()

    def collectives(self, kind: str | None = None) -> list[Record]:
        wanted = (kind,) if kind else COLLECTIVES
        return [e for e in self.events if e.kind in wanted]

    def summary(self) -> dict[str, CollectiveStats]:
        """Calls, bytes and exposed wait per collective kind (the model's three kinds always,
        zero if unused; ``all_to_all`` once an optimizer issued one)."""
        stats = {kind: CollectiveStats() for kind in COLLECTIVES[:3]}
        for e in self.collectives():
            s = stats.setdefault(e.kind, CollectiveStats())
            s.calls += 1
            s.nbytes += e.nbytes
            passes = 2 if e.kind == "all_reduce" or e.detail == "via all_reduce" else 1
            s.wire_nbytes += passes * e.nbytes * (e.world - 1) // e.world
            s.exposed_ns += e.exposed_ns
        return stats

    def format(self, kinds: tuple[str, ...] | None = None, times: bool = False) -> str:
        """One line per event; ``kinds`` keeps only those kinds. ``times=True`` starts each
        line with milliseconds since the trace began and ends a collective's with how long
        it was in flight and how much of that a hook waited."""
        lines = []
        for e in self.events:
            if kinds is not None and e.kind not in kinds:
                continue
            if not times:
                lines.append(str(e))
                continue
            line = f"{(e.t - self.start_ns) / 1e6:10.3f} ms  {e}"
            if e.kind in COLLECTIVES and e.done_ns:
                line += f"  (in flight {(e.done_ns - e.t) / 1e6:.3f} ms, waited {e.exposed_ns / 1e6:.3f} ms)"
            lines.append(line)
        return "\n".join(lines)

    def resolve(self) -> None:
        """Read the completion times the device still holds (CUDA timing events; this waits
        for them). A no-op on the CPU."""
        for e in self.events:
            if e.done_at is not None:
                e.done_ns, e.done_at = e.done_at(), None
            if e.wait_at is not None:
                e.wait_ns, e.wait_at = e.wait_at(), None

    def clear(self) -> None:
        self.events.clear()

    def gather(self, group: dist.ProcessGroup | None = None) -> list["Trace"] | None:
        """Every rank's trace on rank 0 of ``group`` (a collective: call it on every rank);
        None elsewhere. For ``comm.timeline.write``."""
        self.resolve()
        if not dist.is_initialized():
            return [self]
        world = dist.get_world_size(group)
        out = [None] * world if dist.get_rank(group) == 0 else None
        dist.gather_object(self, out, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
        return out

    def __getstate__(self) -> dict:
        self.resolve()
        return self.__dict__


# The traces currently recording (a stack, so nested ``trace()`` blocks both see events).
_active: list[Trace] = []


def record(kind: str, group: str, detail: str = "", **collective) -> Record | None:
    """Append an event to every active trace, and return it (None when none is active: then
    recording is free)."""
    if not _active:
        return None
    event = Record(kind, group, detail, t=time.perf_counter_ns(), **collective)
    for t in _active:
        if t.rank is None and dist.is_initialized():
            t.rank = dist.get_rank()
        if len(t.events) < MAX_EVENTS:
            t.events.append(event)
        else:
            t.dropped += 1
    return event


def is_recording() -> bool:
    return bool(_active)


def waiting(event: Record | None) -> None:
    """The runtime starts waiting for the collective of ``event``: a ``wait`` line, and its time."""
    if event is not None:
        event.wait_ns = time.perf_counter_ns()
        record("wait", event.group, event.kind)


def done(event: Record | None) -> None:
    """The collective of ``event`` has completed (the earliest report wins: a completion
    callback, or the wait returning)."""
    if event is not None:
        now = time.perf_counter_ns()
        event.done_ns = min(event.done_ns, now) if event.done_ns else now


def on_completion(event: Record | None, work) -> None:
    """CPU: note when the process group completes ``work`` (its future's callback runs on
    the communication thread), so the timeline shows when data arrived, not when a hook
    asked for it. Some work (gloo's older collectives, a user's) has no future: then the
    wait marks it done."""
    if event is not None and work is not None:
        try:
            future = work.get_future()
        except RuntimeError:
            return
        future.add_done_callback(lambda _: done(event))


def label(kind: str, name: str) -> contextlib.AbstractContextManager:
    """A ``torch.profiler`` range ``shardkit::<kind> <group>`` while a profiler runs, else nothing."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"shardkit::{kind} {name or '<root>'}")
    return _NOTHING


_NOTHING = contextlib.nullcontext()  # reusable


def start() -> Trace:
    """A trace that records until ``stop(t)`` (``trace()`` is the block form)."""
    t = Trace()
    _active.append(t)
    return t


def stop(t: Trace) -> None:
    _active.remove(t)
    t.resolve()


@contextlib.contextmanager
def trace() -> Iterator[Trace]:
    """Record shardkit's phase changes and collectives in this process.

    Example::

        with shardkit.trace() as t:
            model(x).sum().backward()
        print(t.format())
        print(t.summary()["all_gather"].calls)
    """
    t = start()
    try:
        yield t
    finally:
        stop(t)
