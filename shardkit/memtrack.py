"""Count the bytes of live tensor storages, per process, while a block of code runs.

``MemTracker`` is a ``TorchDispatchMode``: every aten op that runs inside ``with tracker:``
shows it its input and output tensors, and the tracker remembers each distinct storage it
sees (by the storage object, so views and ``.data`` count once; a DTensor counts its local
tensor). It then follows each storage for as long as it lives:

- **frees**: torch keeps one Python object per storage for the storage's whole life (it is
  handed back and forth between Python and C++), so a weakref callback on that object fires
  exactly when the memory is released, wherever the last reference was dropped.
- **resizes**: ``tensor.resize_`` and ``set_`` are aten ops, so we re-read the size of every
  storage an op touched after it ran. ``untyped_storage().resize_(n)`` is *not* an aten op
  (shardkit frees and refills unsharded parameters this way, see
  ``dtensor/sharded_param.py``), so while a tracker is active we wrap
  ``torch.UntypedStorage.resize_`` to report it at once. ``mark()`` and the exit re-read
  every size as well, so a resize made some other way still shows in ``current_bytes``
  (though not in the peak it may have caused).

What it does not see: memory that C++ code allocates without an aten op (gloo's scratch
buffers inside a collective, kernel workspaces, allocator rounding and caching), and tensors
that exist before the block and are never used in it, unless handed to ``track()``. CPU
autograd runs backward on the calling thread, so its allocations (gradients, the temporaries
of every backward formula) are seen; backward ops on another thread's device queue (CUDA)
are not. These are tensor bytes, not what the operating system reports (RSS).

Example::

    tracker = MemTracker().track(model, optimizer)  # what is alive already
    with tracker:
        tracker.mark("start")
        loss = model(x).sum()
        tracker.mark("forward")           # peak_bytes of the forward, current_bytes after it
        loss.backward()
        tracker.mark("backward")
        optimizer.step()
        tracker.mark("step")
    print(tracker.peak_bytes, tracker.phase_peak("backward"), tracker.current_bytes)
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass, is_traceable_wrapper_subclass_type

OTHER = "other"  # the category of a storage nobody labelled


@dataclass(frozen=True)
class Mark:
    """What ``MemTracker.mark(label)`` saw: the interval since the previous mark, and now."""

    label: str
    current_bytes: int  # live bytes at the mark
    peak_bytes: int  # the highest live bytes since the previous mark (or the entry)
    peak_by_category: dict[str, int] = field(default_factory=dict)  # the breakdown at that peak
    current_by_category: dict[str, int] = field(default_factory=dict)


class LiveStorage(NamedTuple):
    nbytes: int
    category: str
    origin: str  # the op that first showed it to us ("track", "resize_" for direct resizes)


class _Entry:
    __slots__ = ("ref", "nbytes", "category", "origin")

    def __init__(self, ref: weakref.ref, nbytes: int, category: str, origin: str) -> None:
        self.ref, self.nbytes, self.category, self.origin = ref, nbytes, category, origin


class MemTracker(TorchDispatchMode):
    """Live tensor bytes of this process: now, at their peak, and per phase between marks.

    ``device`` (a device type such as ``"cpu"``) restricts the count to storages there; by
    default every device but ``meta`` counts. Storages first seen by an op get the category
    ``default_category`` (``"other"`` unless you set it, e.g. per phase); ``track(...,
    category=...)`` labels storages, and the peaks keep their breakdown by category.
    See the module docstring for what is and is not seen.
    """

    def __init__(self, device: str | None = None) -> None:
        super().__init__()
        self.device = device
        self.default_category = OTHER
        self.marks: list[Mark] = []
        self._entries: dict[int, _Entry] = {}  # id(storage) -> entry; removed when the storage dies
        self._by_category: Counter[str] = Counter()
        self._current = 0
        self._peak = self._mark_peak = 0
        self._peak_by_category: dict[str, int] = {}
        self._mark_peak_by_category: dict[str, int] = {}
        # Frees arrive from whichever thread drops the last reference (a collective's thread too).
        self._lock = threading.RLock()

    # Reading ------------------------------------------------------------------------------
    @property
    def current_bytes(self) -> int:
        return self._current

    @property
    def peak_bytes(self) -> int:
        """The highest live bytes since construction (or ``reset_peak()``)."""
        return self._peak

    @property
    def peak_by_category(self) -> dict[str, int]:
        return dict(self._peak_by_category)

    def by_category(self) -> dict[str, int]:
        """Live bytes now, per category (categories with no bytes left out)."""
        with self._lock:
            return {k: v for k, v in self._by_category.items() if v}

    def category(self, t: torch.Tensor) -> str | None:
        """The category of the storage holding ``t`` (None if we do not track it)."""
        entry = next((self._entries.get(id(storage)) for storage in _storages(t)), None)
        return None if entry is None else entry.category

    def live_storages(self) -> list[LiveStorage]:
        """Every live tracked storage, largest first: to find out what holds the bytes."""
        with self._lock:
            live = [LiveStorage(e.nbytes, e.category, e.origin) for e in self._entries.values() if e.nbytes]
        return sorted(live, key=lambda s: -s.nbytes)

    def phase_peak(self, label: str) -> int:
        """The highest ``peak_bytes`` over the marks named ``label`` (e.g. every step's "backward")."""
        peaks = [m.peak_bytes for m in self.marks if m.label == label]
        if not peaks:
            raise KeyError(f"no mark named {label!r}; marks so far: {sorted({m.label for m in self.marks})}")
        return max(peaks)

    # Marking -------------------------------------------------------------------------------
    def mark(self, label: str) -> Mark:
        """Close the interval since the previous mark under ``label``: record its peak and the
        bytes live now, then start the next interval from here."""
        self._refresh_sizes()
        with self._lock:
            mark = Mark(label, self._current, self._mark_peak, dict(self._mark_peak_by_category), self.by_category())
            self._mark_peak, self._mark_peak_by_category = self._current, self.by_category()
        self.marks.append(mark)
        return mark

    def reset_peak(self) -> None:
        """Start the overall peak (and the current interval's) again from the live bytes now."""
        with self._lock:
            self._peak = self._mark_peak = self._current
            self._peak_by_category = self._mark_peak_by_category = self.by_category()

    # Tracking ------------------------------------------------------------------------------
    def track(self, *objs: Any, category: str | None = None) -> MemTracker:
        """Count tensors that are alive already (and label them with ``category``).

        Takes tensors (DTensors count their local tensor), modules (parameters as
        ``"parameter"``, their ``.grad`` as ``"gradient"``, buffers as ``"buffer"``),
        optimizers (their state as ``"optimizer_state"``), and lists, tuples and dicts of
        these. ``category`` overrides those names. Tracking again relabels.
        """
        for obj in objs:
            if isinstance(obj, nn.Module):
                params = list(obj.parameters())
                self.track(params, category=category or "parameter")
                self.track([p.grad for p in params if p.grad is not None], category=category or "gradient")
                self.track(list(obj.buffers()), category=category or "buffer")
            elif isinstance(obj, torch.optim.Optimizer):
                self.track(list(obj.state.values()), category=category or "optimizer_state")
            else:
                for t in _tensors(obj):
                    self._see(t, "track", category)
        return self

    def _see(self, t: torch.Tensor, origin: str, category: str | None = None) -> None:
        for storage in _storages(t):
            if self.device is None or storage.device.type == self.device:
                self._see_storage(storage, origin, category)

    def _see_storage(self, storage: torch.UntypedStorage, origin: str, category: str | None) -> None:
        with self._lock:
            entry = self._entries.get(id(storage))
            if entry is None:
                key = id(storage)
                ref = weakref.ref(storage, lambda _, key=key: self._forget(key))
                entry = self._entries[key] = _Entry(ref, 0, category or self.default_category, origin)
            elif category is not None and category != entry.category:
                self._by_category[entry.category] -= entry.nbytes
                self._by_category[category] += entry.nbytes
                entry.category = category
            self._set_size(entry, storage.nbytes())

    def _set_size(self, entry: _Entry, nbytes: int) -> None:
        if nbytes == entry.nbytes:
            return
        delta, entry.nbytes = nbytes - entry.nbytes, nbytes
        self._current += delta
        self._by_category[entry.category] += delta
        if delta > 0:
            if self._current > self._mark_peak:
                self._mark_peak, self._mark_peak_by_category = self._current, self.by_category()
            if self._current > self._peak:
                self._peak, self._peak_by_category = self._current, self.by_category()

    def _forget(self, key: int) -> None:
        """The weakref callback: the storage is being freed."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._current -= entry.nbytes
                self._by_category[entry.category] -= entry.nbytes

    def _refresh_sizes(self) -> None:
        """Re-read every tracked storage's size (catches resizes made behind our back)."""
        with self._lock:
            for entry in list(self._entries.values()):
                storage = entry.ref()
                if storage is not None:
                    self._set_size(entry, storage.nbytes())

    def _saw_resize(self, storage: torch.UntypedStorage) -> None:
        """``UntypedStorage.resize_`` ran (on any storage: one we did not know starts now)."""
        kind = storage.device.type
        if kind != "meta" and (self.device is None or kind == self.device):
            self._see_storage(storage, "resize_", None)

    # The dispatch mode ---------------------------------------------------------------------
    # Higher-order operators too (a compiled graph's ``with_effects``, shardkit.compiled's trace
    # op): run like any op, their tensors seen.
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # DTensor and friends unwrap; their local ops come back here
        out = func(*args, **(kwargs or {}))
        origin = getattr(func, "__name__", str(func))
        for t in _tensors((args, kwargs, out)):
            self._see(t, origin)
        return out

    def __enter__(self) -> MemTracker:
        _install_resize_hook(self)
        self._refresh_sizes()  # resizes made while we were not looking
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _remove_resize_hook(self)
        self._refresh_sizes()


# Helpers ----------------------------------------------------------------------------------
def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested lists, tuples and dict values."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages that hold ``t``'s data: a wrapper subclass's (DTensor's) inner tensors'."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):  # DTensor also lists its device mesh
                yield from _storages(inner)
    elif t.layout == torch.strided and t.device.type != "meta":
        storage = t.untyped_storage()
        if storage.device.type != "meta":  # fake tensors report a real device, keep meta storage
            yield storage


# ``UntypedStorage.resize_`` bypasses the dispatcher: while any tracker is active we wrap it.
_active: list[MemTracker] = []
_original_resize = torch.UntypedStorage.resize_


def _resize_and_report(storage: torch.UntypedStorage, size: int):
    result = _original_resize(storage, size)
    for tracker in list(_active):
        tracker._saw_resize(storage)
    return result


def _install_resize_hook(tracker: MemTracker) -> None:
    _active.append(tracker)
    torch.UntypedStorage.resize_ = _resize_and_report


def _remove_resize_hook(tracker: MemTracker) -> None:
    _active.remove(tracker)
    if not _active:
        torch.UntypedStorage.resize_ = _original_resize
