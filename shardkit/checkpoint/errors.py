"""One exception family for every failure of ``save`` and ``load``.

Each is an ``Exception`` (torch's ``CheckpointException`` derives from ``BaseException``, so
``except Exception`` in a training loop would miss it) that names the checkpoint's path and
the rank it happened on, with the cause chained (``raise ... from``)."""

from __future__ import annotations


class CheckpointError(Exception):
    def __init__(self, path: str, rank: int, message: str) -> None:
        super().__init__(f"{path} (rank {rank}): {message}")
        self.path, self.rank = path, rank


class IncompleteCheckpointError(CheckpointError):
    """The folder has no ``COMPLETE`` marker (a save into it did not finish), or does not exist."""


class CorruptCheckpointError(CheckpointError):
    """A file's bytes are not what the save wrote (checksum or size), or the marker is unreadable."""


class UnsafeCheckpointError(CheckpointError):
    """``.metadata`` asks to run code that a checkpoint never needs (a refused global)."""


class ModelMismatchError(CheckpointError):
    """The checkpoint was saved from another model: missing or unexpected keys, other shapes."""
