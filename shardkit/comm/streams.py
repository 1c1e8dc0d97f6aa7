"""Where collectives run and how the compute waits for them: the one file that knows the device.

Every collective is issued through ``Streams.issue(collective, inputs, launch)``, which
returns a ``Handle``: ``poll()`` says without blocking whether it has completed, ``wait()`` orders the
compute after it, and until then the handle keeps every buffer the collective uses alive.
The callers (``comm/collectives.py``) take the same steps on every device, with the copy-out
after ``wait()`` on the compute stream; only the ``Streams`` object differs:

- ``Streams`` (CPU, the fake process group): no streams. The collective starts with
  ``async_op=True`` and runs on the process group's own thread; ``wait`` blocks on its work.
- ``DeviceStreams(torch.cuda)`` (CUDA): each kind of collective has a side stream. ``issue``
  makes it wait for the compute stream, runs the copy-in and the collective there, and records
  an event; ``wait`` makes the compute stream wait for that event (no host sync).
- ``DeviceStreams(checker)`` (``SHARDKIT_STREAMS=sim`` on the CPU): the same CUDA path over
  ``comm/sim.py``'s simulated streams, which check every tensor access for races.

[Note: buffer lifetimes]
A collective is issued in one hook and waited for in a later one (a prefetched all-gather
runs while the previous group computes; a reduce-scatter runs while the next group's backward
computes). Until ``wait()``, its handle holds every buffer it reads or writes (``buffers``):

- On the CPU, the process group's thread uses them until the work completes.
- On CUDA, the side stream uses them. Memory that was allocated on the compute stream (the
  unsharded gradients a reduce-scatter reads, the post-forward shards an all-gather reads,
  an unsharded parameter gathered in place) must not go back to the caching allocator
  before the compute stream has waited for the collective: the allocator hands freed memory
  to the next allocation on the stream that allocated it, which would then overwrite what the
  side stream still reads. After ``wait()`` that order holds, so the handle lets them go. No
  ``record_stream`` anywhere.
- Every ``issue`` first makes its side stream wait for the compute stream: the copy-in sees
  the optimizer's updates and the gradients just computed, and memory that the compute
  stream read last (an all-gather output after its copy-out) is reused on the side stream
  only after that read.
- The unsharded parameters are freed only by ``reshard``, which first waits for any pending
  all-gather.

``comm/sim.py`` checks these rules on the CPU: ``SHARDKIT_STREAMS=sim``, run in CI.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from shardkit.comm import check, sim, trace

KINDS = trace.COLLECTIVES  # all_gather, reduce_scatter, all_reduce, all_to_all: one side stream each

# Copy-in and start one collective with ``async_op``; return its work and the buffers it
# made, by name (a tensor or a list of them).
Launch = Callable[[bool], "tuple[dist.Work | None, dict[str, Any]]"]


@dataclass
class Collective:
    """What is issued, for the trace, the profiler and the checker's errors."""

    kind: str  # all_gather, reduce_scatter, all_reduce: the side stream it runs on
    group_name: str
    traced: trace.Record | None = None  # while a trace records
    at_once: bool = False  # its backend's work is done once issued, whatever is_completed() says


class Handle:
    """One issued collective: ``poll()``, ``wait()``, and its buffers alive until then."""

    __slots__ = ("streams", "what", "buffers", "done", "start")

    def __init__(self, streams: "Streams", what: Collective, inputs: dict[str, Any]) -> None:
        self.streams, self.what = streams, what
        self.buffers = inputs  # by name: a tensor or a list of them
        self.done: Any = None  # CPU: the work; CUDA: an event on the side stream; None: nothing to wait for
        self.start: tuple[Handle, Launch] | None = None  # CPU: waiting for a collective to complete first

    def poll(self) -> bool:
        return self.streams.poll(self)

    def wait(self) -> None:
        self.streams.wait(self)


class Streams:
    """CPU and the fake process group: collectives run on the process group's thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def issue(self, what: Collective, inputs: dict[str, Any], launch: Launch, after: Handle | None = None) -> Handle:
        """Start a collective that reads ``inputs`` (what the compute stream made, by name);
        with ``after``, once that collective has completed (an HSDP all-reduce continuing a
        reduce-scatter)."""
        handle = Handle(self, what, inputs)
        if after is None:
            self._start(handle, launch)
        else:  # started by poll() or wait(), in issue order on every rank
            handle.start = (after, launch)
        return handle

    def _start(self, handle: Handle, launch: Launch) -> None:
        what = handle.what
        with trace.label(what.kind, what.group_name):
            handle.done, made = launch(True)
        handle.buffers.update(made)
        trace.on_completion(what.traced, handle.done)

    def _start_after(self, handle: Handle) -> None:
        after, launch = handle.start
        handle.start = None
        self._block(after)
        if handle.what.traced is not None:
            handle.what.traced.t = time.perf_counter_ns()  # issued now
        self._start(handle, launch)

    def poll(self, handle: Handle) -> bool:
        if handle.start is not None:
            if not handle.start[0].poll():
                return False
            self._start_after(handle)
        work = handle.done
        return work is None or handle.what.at_once or work.is_completed()

    def wait(self, handle: Handle) -> None:
        if handle.start is not None:
            self._start_after(handle)
        trace.waiting(handle.what.traced)
        self._block(handle)
        handle.buffers = {}

    def _block(self, handle: Handle) -> None:
        if handle.done is None:
            return
        with trace.label(f"wait_{handle.what.kind}", handle.what.group_name):
            try:
                handle.done.wait()
            except Exception as exc:  # a timeout or a dead peer: say what this rank had issued
                raise check.failed(exc) from exc
        handle.done = None
        trace.done(handle.what.traced)

    def wait_host_copies(self) -> None:
        """Wait for the copies to pinned host memory the device still runs (offloaded
        gradients, at the end of backward): none on the CPU."""

    def all_gathers_wait_for(self, event: Any) -> None:
        """``set_post_optim_event``: the next all-gathers wait for the user's event (the CPU
        runs everything in program order)."""


class DeviceStreams(Streams):
    """CUDA, with ``api=torch.cuda``; its simulation on the CPU, with ``api`` a ``sim.Checker``."""

    def __init__(self, device: torch.device, api: Any) -> None:
        super().__init__(device)
        self.api = api
        # High priority: a collective waiting to start delays every rank, compute only this one.
        self.side = {kind: api.Stream(device, priority=-1) for kind in KINDS}
        # Simulated streams name a collective's buffers in their race reports.
        self._name = api.name_buffers if isinstance(api, sim.Checker) else lambda buffers, what: None
        self._reference: tuple[Any, int] | None = None  # an event and the host time it completed

    def issue(self, what: Collective, inputs: dict[str, Any], launch: Launch, after: Handle | None = None) -> Handle:
        handle = Handle(self, what, inputs)
        self._name(inputs, what)
        stream = self.side[what.kind]
        stream.wait_stream(self.api.current_stream(self.device))  # see the Note
        if after is not None and after.done is not None:
            stream.wait_event(after.done)
        with self.api.stream(stream), trace.label(what.kind, what.group_name):
            _, made = launch(False)  # synchronous on the side stream: NCCL orders it there
            handle.done = stream.record_event()
            if what.traced is not None:
                what.traced.done_at = self._device_now()
        self._name(made, what)
        handle.buffers.update(made)
        return handle

    def poll(self, handle: Handle) -> bool:
        return handle.done is None or handle.done.query()

    def wait(self, handle: Handle) -> None:
        traced = handle.what.traced
        trace.waiting(traced)
        if traced is not None:  # exposed time: from when the compute stream gets here
            traced.wait_at = self._device_now()
        if handle.done is not None:
            with trace.label(f"wait_{handle.what.kind}", handle.what.group_name):
                self.api.current_stream(self.device).wait_event(handle.done)
        handle.done, handle.buffers = None, {}

    def wait_host_copies(self) -> None:
        self.api.current_stream(self.device).synchronize()

    def all_gathers_wait_for(self, event: Any) -> None:
        self.side["all_gather"].wait_event(event)

    def _device_now(self) -> Callable[[], int]:
        """When the current stream gets to this point, on the host's clock, read later (a
        timing event; the device runs behind the host, so we time against an event recorded
        once while both were in step). For the trace only."""
        if self._reference is None:
            self.api.synchronize()
            reference = self.api.Event(enable_timing=True)
            reference.record()
            reference.synchronize()
            self._reference = (reference, time.perf_counter_ns())
        reference, host_ns = self._reference
        event = self.api.Event(enable_timing=True)
        event.record()

        def at() -> int:
            event.synchronize()
            return host_ns + int(reference.elapsed_time(event) * 1e6)

        return at


_streams: dict[tuple, Streams] = {}


def streams_for(device: torch.device) -> Streams:
    """The streams of ``device`` (shared by every group in the process): CUDA's, simulated ones
    while a ``sim`` checker runs, else the CPU's."""
    checker = sim.current()
    key = (device, id(checker))
    if key not in _streams:
        if device.type == "cuda":
            _streams[key] = DeviceStreams(device, torch.cuda)
        elif checker is not None:
            _streams[key] = DeviceStreams(device, checker)
        else:
            _streams[key] = Streams(device)
    return _streams[key]


def call_on(stream: Any, fn: Callable, *args: Any) -> None:
    """``fn(*args)`` on a user's CUDA ``stream`` (``set_all_reduce_hook(stream=...)``), ordered
    after the current stream's work and before what follows it; without one, right here."""
    if stream is None:
        fn(*args)
        return
    current = torch.cuda.current_stream(stream.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        fn(*args)
    current.wait_stream(stream)
