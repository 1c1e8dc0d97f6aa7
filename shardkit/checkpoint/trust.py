"""What ``load`` trusts in a checkpoint folder: nothing that can run code.

torch's DCP reader unpickles ``.metadata`` with plain ``pickle.load``, and its default planner
reads non-tensor items (optimizer hyperparameters) with ``torch.load(weights_only=False)``:
a crafted checkpoint runs its own code on load. Here ``.metadata`` goes through an unpickler
that admits only DCP's metadata classes, torch dtypes and sizes, paths and plain containers,
and every item of the ``.distcp`` files through ``torch.load(weights_only=True)``. Anything
else raises ``UnsafeCheckpointError`` naming the refused global, before it runs.
"""

from __future__ import annotations

import builtins
import collections
import inspect
import io
import pathlib
import pickle
import zlib

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint._traverse import set_element  # what DCP's planner uses
from torch.distributed.checkpoint.planner import ReadItem

_BUILTINS = {"set", "frozenset", "complex", "slice", "range", "bytearray", "tuple", "list", "dict"}
_OTHERS = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # name -> torch layout
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.WindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}


class Refused(Exception):
    """A global the unpickler would not import (the caller turns it into UnsafeCheckpointError)."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _BUILTINS:
            return getattr(builtins, name)
        if (module, name) in _OTHERS:
            return _OTHERS[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == dcp_metadata.__name__:  # DCP's own metadata records and enums
            found = getattr(dcp_metadata, name, None)
            if inspect.isclass(found) and found.__module__ == module:
                return found
        raise Refused(f"{module}.{name}")


def load_metadata(data: bytes):
    return _Unpickler(io.BytesIO(data)).load()


class Damaged(Exception):
    """An item's bytes differ from what the save wrote (the caller names the checkpoint)."""


class SafeReader(FileSystemReader):
    """DCP's file reader, with ``.metadata`` read by the restricted unpickler, and every item
    checked against its CRC-32 in the manifest as it is read (no second pass over the files)."""

    def __init__(self, path: str, files: dict | None = None) -> None:
        super().__init__(path)
        self.files = files or {}  # the manifest: name -> {"items": {offset: [length, crc32]}}

    def _slice_file(self, file, sinfo: _StorageInfo):
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        expected = self.files.get(sinfo.relative_path, {}).get("items", {}).get(str(sinfo.offset))
        if expected is not None and [len(data), f"{zlib.crc32(data):08x}"] != expected:
            raise Damaged(
                f"{sinfo.relative_path} is damaged: bytes {sinfo.offset}..{sinfo.offset + sinfo.length} (one item) "
                f"have CRC-32 {zlib.crc32(data):08x}, the save wrote {expected[1]}."
            )
        return io.BytesIO(data)

    def read_metadata(self, *args, **kwargs):
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f.read())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
