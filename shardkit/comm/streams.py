"""Where collectives run, and how their results are handed back: CUDA streams and events,
or a gloo work handle on CPU. The only file that knows about streams.

[Note: buffer lifetimes]
A collective is *issued* in one hook and *waited for* in a later one (prefetch: the next
group's all-gather runs while this group computes; the reduce-scatter of one group runs
while the previous group's backward computes). Between the two, every buffer it touches
must stay alive and must not be reused by another stream.

On CUDA each kind of collective has its own side stream (all-gather, reduce-scatter,
all-reduce). ``side(kind)`` makes the side stream wait for the compute stream (so it sees
the optimizer's updates and the gradients just computed) and makes it current; the
collective's copy-in, the collective (NCCL syncs with the current stream) and its copy-out
are all enqueued there, then ``done()`` records an event. ``wait(pending)`` makes the
compute stream wait for that event. So:

- Buffers allocated on the side stream and used only there (the all-gather input and
  output, the reduce-scatter input) are safe to drop from Python as soon as the last op
  using them is enqueued: the caching allocator reuses a block only for work on the stream
  that allocated it, which runs in order.
- Buffers allocated on the compute stream and read on a side stream (the unsharded
  gradients fed to the reduce-scatter) are kept alive by a reference in the pending
  collective until the compute stream has waited for it; only then can the allocator hand
  their memory to new compute work. No ``record_stream`` anywhere.
- The unsharded parameters (allocated on the compute stream, written by the all-gather's
  copy-out) are only freed by ``reshard``, which first waits for any pending all-gather.
- The reduced gradient shards (allocated on the reduce-scatter stream, read by the
  optimizer on the compute stream) are read only after ``wait``; the next reduce-scatter
  that could reuse their memory first waits for the compute stream, which includes the
  optimizer step and ``zero_grad``.

On CPU the collectives run on the process group's own thread (``async_op=True``) and
``wait`` blocks on the work handle; the pending object holds the input and output buffers
until then. Under the fake process group the work completes at once. The control flow is
the same on every device.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


class Streams:
    """The side streams of one device; on CPU every method is a no-op."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"
        # High priority: a collective waiting to start delays every rank, compute only this one.
        self._side = {k: torch.cuda.Stream(device, priority=-1) for k in KINDS} if self.is_cuda else {}

    @contextlib.contextmanager
    def side(self, kind: str, after: torch.cuda.Event | None = None) -> Iterator[None]:
        """Run the block on the ``kind`` side stream, ordered after the compute issued so far
        (and after the event ``after``, e.g. the reduce-scatter an all-reduce continues)."""
        if not self.is_cuda:
            yield
            return
        stream = self._side[kind]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        if after is not None:
            stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield

    def done(self, kind: str) -> torch.cuda.Event | None:
        """An event on the ``kind`` side stream after everything enqueued there so far."""
        return self._side[kind].record_event() if self.is_cuda else None

    def start_timing(self, traced) -> torch.cuda.Event | None:
        """While a trace records (``traced``, its event): a timing event on the current side
        stream, before the collective's work. CPU traces time the host wait instead."""
        if traced is None or not self.is_cuda:
            return None
        from shardkit.comm import trace

        trace.cuda_reference()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def end_timing(self, start: torch.cuda.Event | None, traced) -> None:
        """The matching end event; the trace reads both once it ends (``Trace.resolve``)."""
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            traced.cuda_events = (start, end)

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the compute stream wait for a side stream's event."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)


_streams: dict[torch.device, Streams] = {}


def streams_for(device: torch.device) -> Streams:
    """One set of side streams per device, shared by every group in the process."""
    streams = _streams.get(device)
    if streams is None:
        streams = _streams[device] = Streams(device)
    return streams
