"""The ``COMPLETE`` marker: what a save publishes, and what ``load`` checks before reading.

The marker is JSON (no code): the step, your ``extra``, the world size, and the manifest, every
file the save wrote with its size and CRC-32. CRC-32 (zlib, in C) catches every flipped bit and
every truncation at a few GB/s; it guards against damage, not against an attacker, who could
rewrite the manifest too (``trust.py`` is what keeps a crafted file from running code).
"""

from __future__ import annotations

import json
import os
import zlib

from shardkit.checkpoint.errors import CorruptCheckpointError, IncompleteCheckpointError

MARKER = "COMPLETE"
CHUNK = 8 << 20


def checksum(path: str) -> dict:
    """``{"bytes": n, "crc32": "xxxxxxxx"}`` of one file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": f"{crc:08x}"}


def own_files(folder: str, rank: int) -> dict[str, dict]:
    """The checksums of the files this rank wrote (DCP names them ``__<rank>_<i>.distcp``)."""
    mine = sorted(n for n in os.listdir(folder) if n.startswith(f"__{rank}_") and n.endswith(".distcp"))
    return {name: checksum(os.path.join(folder, name)) for name in mine}


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
    """The first of ``names`` whose bytes differ from the manifest, described; None if all match."""
    for name in names:
        expected = meta["files"][name]
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing (the save wrote {expected['bytes']} bytes)."
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
