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
and keeps per storage the last write and the reads since. It raises ``StreamRace`` on

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
import functools
import itertools
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from shardkit.comm.trace import COLLECTIVES

COMPUTE = "compute"
# c10d ops carry no mutation marks in their schemas: the arguments each one writes.
_C10D_WRITES = {
    "_allgather_base_": {"output_tensor"},
    "_reduce_scatter_base_": {"output_tensor"},
    "allreduce_": {"tensors"},
    "allgather_": {"output_tensors"},
    "allgather_into_tensor_coalesced_": {"outputs"},
    "reduce_scatter_": {"output_tensors"},
    "reduce_scatter_tensor_coalesced_": {"outputs"},
    "broadcast_": {"tensors"},
}
# Ops that read metadata only.
_NO_ACCESS = {"sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "record_stream"}


class StreamRace(RuntimeError):
    """Two simulated streams use one buffer without an order between them."""


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


@dataclass
class _Buffer:
    """What the checker knows of one storage."""

    label: str
    allocated_on: SimStream
    last_write: tuple[str, int] | None = None  # (stream, its clock at the write)
    reads: dict[str, int] = field(default_factory=dict)  # stream -> its clock at its last read since

    def uses(self) -> list[tuple[str, int, str]]:
        """Every access to order against: (stream, clock, "write"/"read")."""
        out = [(s, q, "read") for s, q in self.reads.items()]
        return out + ([(*self.last_write, "write")] if self.last_write else [])


class Checker(TorchDispatchMode):
    """The simulated streams and the race checker (see the module docstring).

    Used as ``torch.cuda`` by ``DeviceStreams``: ``Stream``, ``Event``, ``current_stream``,
    ``stream``, ``synchronize``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.compute = self.current = SimStream(self, COMPUTE)
        self.accesses = self.edges = self.races = 0
        self._names = itertools.count()
        self._buffers: dict[int, _Buffer] = {}  # id(storage) -> buffer, while the storage lives
        self._freed: dict[str, list[tuple[_Buffer, list]]] = {}  # allocating stream -> freed, still in use elsewhere
        self._lock = threading.RLock()  # frees may arrive from a collective's thread

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

    @staticmethod
    def ordered(stream: SimStream, other: str, q: int) -> bool:
        return other == stream.name or stream.clock.get(other, 0) >= q

    def label(self, t: torch.Tensor, text: str) -> None:
        """Name the buffer holding ``t`` in errors (``comm/streams.py`` names a collective's buffers)."""
        buffer = self._buffer(t)
        if buffer is not None:
            buffer.label = text

    def summary(self) -> str:
        return f"sim streams: {self.accesses} accesses checked, {self.edges} cross-stream edges, {self.races} races"

    # Accesses ----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        reads, writes, fresh = _accesses(func, args, kwargs, out)
        if reads or writes or fresh:
            stream = self.current
            stream.clock[stream.name] += 1
            with self._lock:
                for t in fresh:
                    self.allocate(t.untyped_storage(), f"the output of {func}")
                for t in reads:
                    self._access(t, stream, write=False, op=func)
                for t in writes:
                    self._access(t, stream, write=True, op=func)
        return out

    def _buffer(self, t: torch.Tensor) -> _Buffer | None:
        storage = t.untyped_storage()
        if storage.device.type == "meta":
            return None
        buffer = self._buffers.get(id(storage))
        if buffer is None:  # made where the checker could not see it: on the current stream
            buffer = self._track(storage, f"a {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} tensor", self.current)
        return buffer

    def _track(self, storage, label: str, stream: SimStream) -> _Buffer:
        buffer = self._buffers[id(storage)] = _Buffer(label, stream)
        weakref.finalize(storage, self._dropped, id(storage), buffer)
        return buffer

    def allocate(self, storage, label: str) -> None:
        """New memory on the current stream, which the allocator may take from memory freed there."""
        if storage.device.type == "meta":
            return
        stream = self.current
        self._check_reuse(stream)
        buffer = self._buffers.get(id(storage))
        if buffer is None:
            self._track(storage, label, stream)
        else:  # a storage resized up again
            buffer.allocated_on, buffer.last_write, buffer.reads = stream, None, {}

    def _access(self, t: torch.Tensor, stream: SimStream, write: bool, op) -> None:
        buffer = self._buffer(t)
        if buffer is None:
            return
        self.accesses += 1
        q = stream.clock[stream.name]
        if buffer.last_write and not self.ordered(stream, *buffer.last_write):
            self._race(buffer, stream, "write" if write else "read", buffer.last_write, "write", op)
        if write:
            for other, rq in buffer.reads.items():
                if not self.ordered(stream, other, rq):
                    self._race(buffer, stream, "write", (other, rq), "read", op)
            buffer.last_write, buffer.reads = (stream.name, q), {}
        else:
            buffer.reads[stream.name] = q

    # Frees -------------------------------------------------------------------------------------
    def _dropped(self, key: int, buffer: _Buffer) -> None:
        """The storage died: its memory goes back to the allocator."""
        with self._lock:
            if self._buffers.get(key) is buffer:
                del self._buffers[key]
            self._freed_memory(buffer)

    def free(self, storage) -> None:
        """``untyped_storage().resize_(0)``: its memory goes back to the allocator."""
        buffer = self._buffers.get(id(storage))
        if buffer is not None:
            self._freed_memory(buffer)
            buffer.last_write, buffer.reads = None, {}

    def _freed_memory(self, buffer: _Buffer) -> None:
        """Remember the uses on other streams that the allocating stream has not waited for:
        its next allocation must be ordered after them."""
        stream = buffer.allocated_on
        pending = [(s, q, what) for s, q, what in buffer.uses() if not self.ordered(stream, s, q)]
        if pending:
            self._freed.setdefault(stream.name, []).append((buffer, pending))

    def _check_reuse(self, stream: SimStream) -> None:
        freed = self._freed.get(stream.name)
        if not freed:
            return
        self._freed[stream.name] = []
        for buffer, pending in freed:
            for s, q, what in pending:
                if not self.ordered(stream, s, q):
                    self._race_free(buffer, stream, s, what)

    # Errors ------------------------------------------------------------------------------------
    def _race(self, buffer: _Buffer, stream: SimStream, kind: str, earlier: tuple, earlier_kind: str, op) -> None:
        self.races += 1
        other = earlier[0]
        raise StreamRace(
            f"shardkit sim streams: {kind} of {buffer.label} on stream '{stream.name}' ({op}) is not "
            f"ordered after its {earlier_kind} on stream '{other}'.\nMissing edge: {other} -> "
            f"{stream.name}: stream '{stream.name}' must wait (wait_event / wait_stream) for an event "
            f"recorded on '{other}' after that {earlier_kind}."
        )

    def _race_free(self, buffer: _Buffer, stream: SimStream, other: str, what: str) -> None:
        self.races += 1
        raise StreamRace(
            f"shardkit sim streams: the memory of {buffer.label} was freed while stream '{other}' may still use it "
            f"(its {what} there is not ordered before stream '{stream.name}'), and stream "
            f"'{stream.name}', which allocated it, has allocated again: the caching allocator may "
            f"hand the memory out to new work.\nMissing edge: {other} -> {stream.name}: keep a "
            f"reference to the buffer until stream '{stream.name}' has waited for '{other}'."
        )


@functools.lru_cache(maxsize=None)
def _schema(func) -> tuple[tuple[tuple[str, bool], ...], bool, bool]:
    """Per op, once: (argument name, written?) for each argument, whether it is a view (no
    access), and whether its outputs are new memory."""
    name = func._schema.name.split("::")[-1]
    if func.namespace == "c10d":
        writes = _C10D_WRITES.get(name, set())
        return tuple((a.name, a.name in writes) for a in func._schema.arguments), False, False
    if name in _NO_ACCESS or func.is_view:
        return (), True, False
    args = tuple((a.name, bool(a.alias_info and a.alias_info.is_write)) for a in func._schema.arguments)
    fresh = not any(r.alias_info for r in func._schema.returns)
    return args, False, fresh


def _accesses(func, args: tuple, kwargs: dict, out) -> tuple[list, list, list]:
    """The plain tensors ``func`` read, wrote, and allocated."""
    spec, view, fresh = _schema(func)
    if view:
        return [], [], []
    reads, writes = [], []
    for i, (name, written) in enumerate(spec):
        value = args[i] if i < len(args) else kwargs.get(name)
        (writes if written else reads).extend(_plain(value))
    return reads, writes, (_plain(out) if fresh else [])


def _plain(value) -> list[torch.Tensor]:
    """Plain tensors in ``value`` (a tensor subclass counts through its inner tensors)."""
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            return [t for name in value.__tensor_flatten__()[0] for t in _plain(getattr(value, name))]
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _plain(v)]
    return []


# Activation ----------------------------------------------------------------------------------
_active: list[Checker] = []
_resize = torch.UntypedStorage.resize_


def _resize_checked(storage, size):
    """``untyped_storage().resize_`` (how shardkit frees and refills unsharded parameters) is
    not an aten op: while a checker runs, a resize to 0 is a free, a resize up an allocation."""
    checker = _active[-1] if _active else None
    if checker is None or size == storage.nbytes():
        return _resize(storage, size)
    with checker._lock:
        if size == 0:
            checker.free(storage)
        result = _resize(storage, size)
        if size > 0:
            checker.allocate(storage, "a resized storage")
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
        atexit.register(lambda: print(checker.summary(), flush=True))


_from_environment()
