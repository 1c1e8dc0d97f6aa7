import pytest
import torch

from shardkit.dtensor.placements import chunk_sizes, local_rows, padded_rows, row_numel


@pytest.mark.parametrize(
    "rows, world, expected",
    [
        (13, 3, [5, 5, 3]),
        (3, 8, [1, 1, 1, 0, 0, 0, 0, 0]),
        (16, 4, [4, 4, 4, 4]),
        (1, 2, [1, 0]),
        (0, 4, [0, 0, 0, 0]),
        (65, 64, [2] * 32 + [1] + [0] * 31),
    ],
)
def test_chunk_sizes_match_torch_chunk(rows, world, expected):
    assert chunk_sizes(rows, world) == expected
    chunks = torch.arange(rows).chunk(world) if rows else ()
    torch_sizes = [len(c) for c in chunks] + [0] * (world - len(chunks))
    assert chunk_sizes(rows, world) == torch_sizes


@pytest.mark.parametrize("rows, world", [(13, 3), (3, 8), (100, 7), (64, 64), (5, 64)])
def test_padded_rows_cover_every_local_shard(rows, world):
    pad = padded_rows(rows, world)
    assert pad * world >= rows
    assert (pad - 1) * world < rows
    assert all(local_rows(rows, world, r) <= pad for r in range(world))
    assert sum(local_rows(rows, world, r) for r in range(world)) == rows


def test_row_numel_is_product_of_trailing_dims():
    assert row_numel((13,)) == 1
    assert row_numel((13, 4, 5)) == 20
