"""Pure sharding math: how many rows of a parameter each rank holds.

We shard dim 0 like ``torch.chunk`` (and like DTensor's ``Shard(0)``): every rank but the
last few holds ``ceil(rows / world)`` rows, the tail ranks hold fewer or none. For the
collectives every rank's shard is padded to that same ``padded_rows`` so all-gather inputs
and reduce-scatter outputs have equal sizes on every rank.
"""

from __future__ import annotations

import math


def padded_rows(rows: int, world: int) -> int:
    """Rows of every rank's padded shard: ``ceil(rows / world)``."""
    return math.ceil(rows / world) if rows else 0


def local_rows(rows: int, world: int, rank: int) -> int:
    """Rows that ``rank`` really holds (``torch.chunk`` semantics), 0 for empty tail ranks."""
    per_rank = padded_rows(rows, world)
    return max(0, min(per_rank, rows - rank * per_rank))


def chunk_sizes(rows: int, world: int) -> list[int]:
    """Rows per rank: ``chunk_sizes(13, 3) == [5, 5, 3]``, ``chunk_sizes(3, 8) == [1, 1, 1, 0, 0, 0, 0, 0]``."""
    return [local_rows(rows, world, rank) for rank in range(world)]


def row_numel(shape: tuple[int, ...]) -> int:
    """Elements in one dim-0 row of a tensor of ``shape``."""
    return math.prod(shape[1:])
