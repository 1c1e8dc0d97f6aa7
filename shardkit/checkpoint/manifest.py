"""The ``COMPLETE`` marker: what a save publishes, and what ``load`` checks before reading.

The marker is JSON (no code): the step, your ``extra``, the world size, and the manifest: every
file the save wrote with its size, and a CRC-32 per item of each ``.distcp`` file (summed as it
is written, checked as ``load`` reads it) or of the whole file (``.metadata``). CRC-32 (zlib, in
C, ~4 GB/s here) catches every flipped bit and burst; sizes catch truncation. It guards against
damage, not against an attacker, who could rewrite the manifest too (``trust.py`` is what
keeps a crafted file from running code).
"""

from __future__ import annotations

import json
import mmap
import os
import zlib
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystem

from shardkit.checkpoint.errors import CorruptCheckpointError, IncompleteCheckpointError

MARKER = "COMPLETE"


def checksum(path: str) -> dict:
    """``{"bytes": n, "crc32": "xxxxxxxx"}`` of one file, read through a memory map (no copy:
    twice as fast as reading it into Python)."""
    size = os.path.getsize(path)
    crc = 0
    if size:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            crc = zlib.crc32(mapped)
    return {"bytes": size, "crc32": f"{crc:08x}"}


class _Summing:
    """A write stream that keeps a CRC-32 per item of what passes through it (the bytes are
    already in memory: no second read; DCP asks ``tell()`` before and after each item it
    writes). Seeking back would invalidate them: then the file is read back whole instead."""

    def __init__(self, stream, sums: dict, name: str) -> None:
        self._stream, self._sums, self._name = stream, sums, name
        self._size, self._sequential = 0, True
        self._items: dict[str, list] = {}  # offset -> [length, crc32]
        self._item_start, self._item_crc = 0, 0

    def write(self, data) -> int:
        self._item_crc = zlib.crc32(data, self._item_crc)
        self._size += memoryview(data).nbytes
        return self._stream.write(data)

    def tell(self) -> int:
        position = self._stream.tell()
        if position == self._size:  # an item may end here
            self._end_item()
        return position

    def _end_item(self) -> None:
        if self._size > self._item_start:
            self._items[str(self._item_start)] = [self._size - self._item_start, f"{self._item_crc:08x}"]
            self._item_start, self._item_crc = self._size, 0

    def seek(self, *args):
        position = self._stream.seek(*args)
        self._sequential = self._sequential and position == self._size
        return position

    def close_sums(self) -> None:
        self._end_item()  # the last one
        if self._sequential:
            self._sums[self._name] = {"bytes": self._size, "items": self._items}

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


class SummingFileSystem(FileSystem):
    """DCP's local file system, summing every file it writes (``sums``: name -> checksum)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, dict] = {}

    @contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            summing = _Summing(stream, self.sums, os.path.basename(str(path)))
            yield summing
            summing.close_sums()


def own_files(folder: str, rank: int, sums: dict | None = None) -> dict[str, dict]:
    """The checksums of the files this rank wrote (DCP names them ``__<rank>_<i>.distcp``):
    from ``sums`` (made while writing) where there, else read back."""
    mine = sorted(n for n in os.listdir(folder) if n.startswith(f"__{rank}_") and n.endswith(".distcp"))
    sums = sums or {}
    return {name: sums.get(name) or checksum(os.path.join(folder, name)) for name in mine}


def write(folder: str, meta: dict) -> None:
    with open(os.path.join(folder, MARKER), "w") as f:
        json.dump(meta, f)


def read(path: str, rank: int) -> dict:
    """What ``save`` recorded, or an error that says what is wrong and what would load."""
    if not os.path.isdir(path):
        raise IncompleteCheckpointError(path, rank, f"does not exist.{hint(path)}")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        why = " A save into it was interrupted." if path.endswith(".incomplete") or os.path.isdir(path + ".incomplete") else ""
        raise IncompleteCheckpointError(path, rank, f"is not a complete shardkit checkpoint: it has no {MARKER} marker.{why}{hint(path)}")
    try:
        with open(marker) as f:
            meta = json.load(f)
        if not isinstance(meta, dict):
            raise ValueError(f"a {type(meta).__name__}, not an object")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(path, rank, f"its {MARKER} marker is not what a save writes ({exc}).{hint(path)}") from exc
    return meta


def verify(path: str, meta: dict, names: list[str], rank: int) -> str | None:
    """The first of ``names`` that is missing, has another size, or (where the manifest has no
    per-item checksums, which ``trust.SafeReader`` checks as it reads) another CRC-32,
    described; None if all match."""
    for name in names:
        expected = meta["files"][name]
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing (the save wrote {expected['bytes']} bytes)."
        size = os.path.getsize(file)
        if "items" in expected:  # its items are checked as they are read; here only the size
            if size != expected["bytes"]:
                return f"{name} is damaged: the save wrote {expected['bytes']} bytes, the file has {size}."
            continue
        actual = checksum(file)
        if actual != expected:
            return (
                f"{name} is damaged: the save wrote {expected['bytes']} bytes with CRC-32 {expected['crc32']}, "
                f"the file has {actual['bytes']} bytes with CRC-32 {actual['crc32']}."
            )
    return None


def complete(path: str) -> dict | None:
    """The marker of a complete checkpoint folder, or None."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def latest(root: str, *, skip: tuple[str, ...] = ()) -> str | None:
    """The newest complete checkpoint among the folders in ``root`` (by saved step, then by
    save time), or None. A restart script: ``path = checkpoint.latest("ckpt")``."""
    found = []
    skip = tuple(os.path.abspath(p) for p in skip)
    for name in os.listdir(root) if os.path.isdir(root) else ():
        if os.path.abspath(os.path.join(root, name)) in skip:
            continue
        meta = complete(os.path.join(root, name))
        if meta is not None:
            step = meta.get("step")
            found.append((step if isinstance(step, int) else -1, meta.get("time") or 0, not name.endswith((".old", ".incomplete")), name))
    return os.path.join(root, max(found)[3]) if found else None


def hint(path: str) -> str:
    """The complete checkpoints next to ``path`` that ``load`` would accept."""
    base = path.removesuffix(".incomplete").removesuffix(".old")
    near = [p for p in (base, base + ".incomplete", base + ".old") if p != path and complete(p) is not None]
    newest = latest(os.path.dirname(base) or ".", skip=(path, *near))  # the previous step, say
    if newest is not None:
        near.append(newest)
    if not near:
        return " No complete checkpoint is next to it."
    return " Complete checkpoints that load would accept: " + ", ".join(near) + "."
