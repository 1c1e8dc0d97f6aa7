"""The race rules of ``comm/sim.py``: what each op touches, and a ledger of it per storage.

``op_accesses`` reads an aten op's schema: an argument marked mutable (``Tensor(a!)``) is
written, any other tensor argument is read, outputs that alias no input are new memory; view
ops and metadata queries touch no data. c10d's collectives carry no mutation marks, so a
table says which of their arguments they write. A tensor subclass (DTensor) counts through
its inner tensors.

``Ledger`` keeps, per storage, the stream that allocated it, its last write and the reads
since, each as (stream name, that stream's clock), and raises ``StreamRace`` when an access
or a reuse of freed memory is not ordered after what another stream did (see sim.py).
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

# The arguments each c10d op writes.
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


def op_accesses(func, args: tuple, kwargs: dict, out) -> tuple[list, list, list]:
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
    """Plain tensors in ``value`` (a tensor subclass counts through its inner tensors; a
    sparse one, which has no storage of its own, not at all)."""
    if isinstance(value, torch.Tensor):
        if is_traceable_wrapper_subclass(value):
            return [t for name in value.__tensor_flatten__()[0] for t in _plain(getattr(value, name))]
        return [value] if value.layout == torch.strided else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _plain(v)]
    return []


class StreamRace(RuntimeError):
    """Two simulated streams use one buffer without an order between them."""


def ordered(stream: Any, other: str, q: int) -> bool:
    """Whether ``stream`` is now ordered after step ``q`` of stream ``other``."""
    return other == stream.name or stream.clock.get(other, 0) >= q


@dataclass
class Buffer:
    """What the ledger knows of one storage."""

    label: str
    allocated_on: Any  # the stream whose next allocations may reuse it once freed
    last_write: tuple[str, int] | None = None  # (stream, its clock at the write)
    reads: dict[str, int] = field(default_factory=dict)  # stream -> its clock at its last read since

    def uses(self) -> list[tuple[str, int, str]]:
        """Every access to order against: (stream, clock, "write"/"read")."""
        out = [(s, q, "read") for s, q in self.reads.items()]
        return out + ([(*self.last_write, "write")] if self.last_write else [])


class Ledger:
    def __init__(self) -> None:
        self.accesses = self.races = 0
        self.buffers: dict[int, Buffer] = {}  # id(storage) -> buffer, while the storage lives
        self.freed: dict[str, list[tuple[Buffer, list]]] = {}  # allocating stream -> freed memory in use elsewhere
        self.lock = threading.RLock()  # frees may arrive from a collective's thread

    def buffer(self, t: torch.Tensor, stream: Any) -> Buffer | None:
        storage = t.untyped_storage()
        if storage.device.type == "meta":
            return None
        buffer = self.buffers.get(id(storage))
        if buffer is None:  # made where we could not see it: on the current stream
            buffer = self._track(storage, f"a {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} tensor", stream)
        return buffer

    def _track(self, storage, label: str, stream: Any) -> Buffer:
        buffer = self.buffers[id(storage)] = Buffer(label, stream)
        weakref.finalize(storage, self._dropped, id(storage), buffer)
        return buffer

    def allocate(self, storage, label: str, stream: Any) -> None:
        """New memory on ``stream``, which the allocator may take from memory freed there."""
        if storage.device.type == "meta":
            return
        self._check_reuse(stream)
        buffer = self.buffers.get(id(storage))
        if buffer is None:
            self._track(storage, label, stream)
        else:  # a storage resized up again
            buffer.allocated_on, buffer.last_write, buffer.reads = stream, None, {}

    def access(self, t: torch.Tensor, stream: Any, write: bool, op: Any) -> None:
        buffer = self.buffer(t, stream)
        if buffer is None:
            return
        self.accesses += 1
        q = stream.clock[stream.name]
        if buffer.last_write and not ordered(stream, *buffer.last_write):
            self._race(buffer, stream, ("write" if write else "read", op), (*buffer.last_write, "write"))
        if write:
            for other, rq in buffer.reads.items():
                if not ordered(stream, other, rq):
                    self._race(buffer, stream, ("write", op), (other, rq, "read"))
            buffer.last_write, buffer.reads = (stream.name, q), {}
        else:
            buffer.reads[stream.name] = q

    # Frees -------------------------------------------------------------------------------------
    def _dropped(self, key: int, buffer: Buffer) -> None:
        """The storage died: its memory goes back to the allocator."""
        with self.lock:
            if self.buffers.get(key) is buffer:
                del self.buffers[key]
            self._freed_memory(buffer)

    def free(self, storage) -> None:
        """``untyped_storage().resize_(0)``: its memory goes back to the allocator."""
        buffer = self.buffers.get(id(storage))
        if buffer is not None:
            self._freed_memory(buffer)
            buffer.last_write, buffer.reads = None, {}

    def _freed_memory(self, buffer: Buffer) -> None:
        """Remember the uses on other streams that the allocating stream has not waited for:
        its next allocation must be ordered after them."""
        stream = buffer.allocated_on
        pending = [use for use in buffer.uses() if not ordered(stream, use[0], use[1])]
        if pending:
            self.freed.setdefault(stream.name, []).append((buffer, pending))

    def _check_reuse(self, stream: Any) -> None:
        freed, self.freed[stream.name] = self.freed.get(stream.name), []
        for buffer, pending in freed or ():
            for other, q, what in pending:
                if not ordered(stream, other, q):
                    self._race_free(buffer, stream, other, what)

    # Errors ------------------------------------------------------------------------------------
    def _race(self, buffer: Buffer, stream: Any, now: tuple[str, Any], earlier: tuple[str, int, str]) -> None:
        self.races += 1
        (kind, op), (other, _, earlier_kind) = now, earlier
        raise StreamRace(
            f"shardkit sim streams: {kind} of {buffer.label} on stream '{stream.name}' ({op}) is not "
            f"ordered after its {earlier_kind} on stream '{other}'.\nMissing edge: {other} -> "
            f"{stream.name}: stream '{stream.name}' must wait (wait_event / wait_stream) for an event "
            f"recorded on '{other}' after that {earlier_kind}."
        )

    def _race_free(self, buffer: Buffer, stream: Any, other: str, what: str) -> None:
        self.races += 1
        raise StreamRace(
            f"shardkit sim streams: the memory of {buffer.label} was freed while stream '{other}' may "
            f"still use it (its {what} there is not ordered before stream '{stream.name}'), and stream "
            f"'{stream.name}', which allocated it, has allocated again: the caching allocator may "
            f"hand the memory out to new work.\nMissing edge: {other} -> {stream.name}: keep a "
            f"reference to the buffer until stream '{stream.name}' has waited for '{other}'."
        )
