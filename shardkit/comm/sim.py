"""Simulated CUDA streams on the CPU, and a checker of their ordering (``SHARDKIT_STREAMS=sim``).

GPUs are rare where shardkit is built, yet its CUDA stream ordering must hold. With
``SHARDKIT_STREAMS=sim`` (or inside ``with sim.checking():``) the runtime takes its CUDA code
path on the CPU (``comm/streams.py``'s ``DeviceStreams``) over the streams and events of a
``Checker`` instead of ``torch.cuda``'s. The work itself runs at once, in program order; what is
simulated is the order the GPU would guarantee. As in torch's CUDA sanitizer
(``torch.cuda._sanitizer``), every stream has a vector clock: its own entry counts the ops
issued on it, an event snapshots the clock of the stream it is recorded on, and
``wait_event`` / ``wait_stream`` merge that snapshot into the waiting stream's clock. An op on
stream ``s`` is ordered after an access made on stream ``t`` at step ``q`` iff
``s.clock[t] >= q``.

The checker is a ``TorchDispatchMode``: it sees every aten op, with the stream it runs on,
and keeps per storage the last write and the reads since (``comm/accesses.py``). It raises
``StreamRace`` on

- a read on one stream not ordered after the last write on another;
- a write not ordered after the last write, or a read, on another stream;
- memory reused while another stream may still use it. The caching allocator gives freed
  memory (last reference dropped, or ``untyped_storage().resize_(0)``) to the next allocation
  *on the stream that allocated it*; so at each allocation on a stream we check that every
  other stream's use of the memory freed there is ordered before it. A reference kept until
  the allocating stream has waited (a collective's ``Handle``) is what makes that hold.

The error names the buffer (group, collective and which buffer, as ``comm/streams.py``
labels them), both streams and the missing edge. ``SHARDKIT_STREAMS=sim`` prints, at exit,
``sim streams: N accesses checked, M cross-stream edges, K races``.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import sys
import time
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardkit.comm.accesses import Ledger, StreamRace, op_accesses  # noqa: F401 (StreamRace: raised from here)
from shardkit.comm.trace import COLLECTIVES

COMPUTE = "compute"
class SimStream:
    """A simulated stream: its vector clock, and the methods of a CUDA stream that shardkit uses."""

    def __init__(self, checker: "Checker", name: str) -> None:
        self.checker, self.name = checker, name
        self.clock: dict[str, int] = {name: 0}

    def wait_event(self, event: "SimEvent") -> None:
        self.checker.merge(self, event)

    def wait_stream(self, other: "SimStream") -> None:
        self.checker.merge(self, SimEvent(self.checker, stream=other))

    def record_event(self, event: "SimEvent | None" = None) -> "SimEvent":
        event = event or SimEvent(self.checker)
        event.record(self)
        return event

    def query(self) -> bool:
        return True  # the work ran when it was issued

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"stream {self.name}"


class SimEvent:
    """A simulated event: a snapshot of one stream's clock, with a CUDA event's methods."""

    def __init__(self, checker: "Checker", enable_timing: bool = False, stream: SimStream | None = None) -> None:
        self.checker = checker
        self.stream: str | None = None
        self.clock: dict[str, int] = {}
        self.host_ns = 0  # the work before it ran at once: it completed when recorded
        if stream is not None:
            self.record(stream)

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream or self.checker.current
        self.stream, self.clock = stream.name, dict(stream.clock)
        self.host_ns = time.perf_counter_ns()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: "SimEvent") -> float:
        return (other.host_ns - self.host_ns) / 1e6  # milliseconds, as CUDA's


class Checker(TorchDispatchMode):
    """The simulated streams and the race checker (see the module docstring).

    Used as ``torch.cuda`` by ``DeviceStreams``: ``Stream``, ``Event``, ``current_stream``,
    ``stream``, ``synchronize``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = SimStream(self, COMPUTE)
        self.edges = 0
        self.ledger = Ledger()
        self._names = itertools.count()

    @property
    def accesses(self) -> int:
        return self.ledger.accesses

    @property
    def races(self) -> int:
        return self.ledger.races

    # torch.cuda's interface ------------------------------------------------------------------
    def Stream(self, device=None, priority: int = 0) -> SimStream:
        # ``DeviceStreams`` makes its side streams in the order of COLLECTIVES.
        n = next(self._names)
        suffix = f" #{n // len(COLLECTIVES) + 1}" if n >= len(COLLECTIVES) else ""
        return SimStream(self, COLLECTIVES[n % len(COLLECTIVES)] + suffix)

    def Event(self, enable_timing: bool = False, **_) -> SimEvent:
        return SimEvent(self)

    def current_stream(self, device=None) -> SimStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def synchronize(self) -> None:
        pass

    # Ordering ----------------------------------------------------------------------------------
    def merge(self, stream: SimStream, event: SimEvent) -> None:
        if event.stream is not None and event.stream != stream.name:
            self.edges += 1
        for name, q in event.clock.items():
            if stream.clock.get(name, 0) < q:
                stream.clock[name] = q

    def name_buffers(self, buffers: dict, what) -> None:
        """Name a collective's buffers (a tensor or a list of them, by name) in race reports."""
        for name, value in buffers.items():
            for t in value if isinstance(value, list) else [value]:
                buffer = self.ledger.buffer(t, self.current) if t is not None else None
                if buffer is not None:
                    buffer.label = f"the {name} of {what.kind} {what.group_name or '<root>'}"

    def summary(self) -> str:
        return f"sim streams: {self.accesses} accesses checked, {self.edges} cross-stream edges, {self.races} races"

    # Accesses ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        reads, writes, fresh = op_accesses(func, args, kwargs, out)
        if reads or writes or fresh:
            stream, ledger = self.current, self.ledger
            stream.clock[stream.name] += 1
            with ledger.lock:
                for t in fresh:
                    ledger.allocate(t.untyped_storage(), f"the output of {func}", stream)
                for t in reads:
                    ledger.access(t, stream, False, func)
                for t in writes:
                    ledger.access(t, stream, True, func)
        return out

# Activation ----------------------------------------------------------------------------------
_active: list[Checker] = []
_resize = torch.UntypedStorage.resize_


def _resize_checked(storage, size):
    """``untyped_storage().resize_`` (how shardkit frees and refills unsharded parameters) is
    not an aten op: while a checker runs, a resize to 0 is a free, a resize up an allocation."""
    checker = _active[-1] if _active else None
    if checker is None or size == storage.nbytes():
        return _resize(storage, size)
    with checker.ledger.lock:
        if size == 0:
            checker.ledger.free(storage)
        result = _resize(storage, size)
        if size > 0:
            checker.ledger.allocate(storage, "a resized storage", checker.current)
    return result


def current() -> Checker | None:
    """The checker the runtime's simulated streams run on, or None (real streams or none)."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def checking() -> Iterator[Checker]:
    """Simulate CUDA streams and check their ordering in this block (groups lazily initialized
    inside it take the CUDA code path on the CPU).

    Example::

        with shardkit.comm.sim.checking() as checker:
            model(x).sum().backward()
        print(checker.summary())
    """
    checker = start()
    try:
        yield checker
    finally:
        stop(checker)


def start() -> Checker:
    checker = Checker()
    checker.__enter__()
    _active.append(checker)
    torch.UntypedStorage.resize_ = _resize_checked
    return checker


def stop(checker: Checker) -> None:
    _active.remove(checker)
    checker.__exit__(None, None, None)
    if not _active:
        torch.UntypedStorage.resize_ = _resize


def _from_environment() -> None:
    mode = os.environ.get("SHARDKIT_STREAMS", "")
    if mode not in ("", "sim"):
        raise ValueError(f"SHARDKIT_STREAMS={mode!r}: the only value is 'sim' (simulated CUDA streams on the CPU)")
    if mode == "sim":
        checker = start()
        atexit.register(lambda: print(checker.summary(), file=sys.stderr, flush=True))


_from_environment()
