"""``load_pretrained`` / ``save_pretrained`` in one process (no process group): the safetensors
files they read and write against the safetensors package's own reader and writer (shardkit
needs no package for them), every dtype, reads of scattered positions (``_StridedShard``) run
by run, prefix maps, damaged files. (Sharded models: tests/gloo/test_pretrained*.py.)"""

import json
import os
import sys

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardkit.checkpoint import CheckpointError, CorruptCheckpointError, ModelMismatchError, load_pretrained, save_pretrained
from shardkit.checkpoint import pretrained

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
          torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


class Holder(nn.Module):
    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            self.register_buffer(name, t)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def some(dtype: torch.dtype, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(shape))
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def test_save_pretrained_writes_what_safetensors_reads_for_every_dtype_and_shape(tmp_path):
    tensors = {f"t{i}": some(dtype, shape) for i, (dtype, shape) in enumerate(
        [(d, (3, 5)) for d in DTYPES] + [(torch.float32, ()), (torch.float32, (0, 4)), (torch.bfloat16, (7,))])}
    save_pretrained(Holder(tensors), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # one rank: one file, no index
    read = load_file(tmp_path / "model.safetensors")
    assert read.keys() == tensors.keys()
    for k, v in tensors.items():
        assert read[k].dtype == v.dtype and read[k].shape == v.shape and torch.equal(bits(read[k]), bits(v)), k
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    back = Holder({k: torch.zeros_like(v) for k, v in tensors.items()})
    load_pretrained(back, str(tmp_path))
    assert all(torch.equal(bits(getattr(back, k)), bits(v)) for k, v in tensors.items())


def test_save_pretrained_casts_floating_tensors_only_and_writes_tied_weights_once(tmp_path):
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    model.register_buffer("steps", torch.tensor([3]))
    save_pretrained(model, str(tmp_path), dtype=torch.bfloat16)
    read = load_file(tmp_path / "model.safetensors")
    assert sorted(read) == ["0.weight", "steps"]
    assert read["0.weight"].dtype == torch.bfloat16 and read["steps"].dtype == torch.int64


def test_scattered_positions_are_read_run_by_run(tmp_path):
    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    save_file({"w": full}, tmp_path / "f.safetensors")
    assert pretrained._runs([0, 1, 4, 5, 7]) == [range(0, 2), range(4, 6), range(7, 8)]
    (entry,) = pretrained._entries(str(tmp_path / "f.safetensors")).values()
    with open(tmp_path / "f.safetensors", "rb") as f:
        for index in [(torch.tensor([0, 1, 4, 5]), torch.tensor([1, 3, 4])), (slice(2, 5), slice(0, 6)),
                      (slice(0, 8), slice(3, 6)), (torch.tensor([1, 6]), slice(0, 6)), (slice(7, 8), torch.tensor([0, 5]))]:
            want = full[index[0]][:, index[1]]
            out = torch.empty(want.shape)
            pretrained._read_piece(f.fileno(), entry, index, out)
            assert torch.equal(out, want), index


def test_a_prefix_map_takes_the_longest_prefix_and_unmapped_keys_stay():
    rename = pretrained._mapper({"model.": "", "model.layers.": "blocks."})
    assert rename("model.layers.0.w") == "blocks.0.w" and rename("model.norm.w") == "norm.w" and rename("lm_head.w") == "lm_head.w"


def test_an_index_naming_a_missing_file_and_a_folder_without_weights_raise(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="names model-00001-of-00002.safetensors, which is not in"):
        load_pretrained(nn.Linear(2, 2), str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CorruptCheckpointError, match="is not a safetensors index"):
        load_pretrained(nn.Linear(2, 2), str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="holds neither model.safetensors.index.json nor model.safetensors"):
        load_pretrained(nn.Linear(2, 2), str(empty))


def test_a_key_in_two_files_of_an_index_is_corrupt(tmp_path):
    save_file({"weight": torch.zeros(2, 2)}, tmp_path / "a.safetensors")
    save_file({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, tmp_path / "b.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"weight": "a.safetensors", "bias": "b.safetensors"}}))
    with pytest.raises(CorruptCheckpointError, match="key 'weight' is in both"):
        load_pretrained(nn.Linear(2, 2), str(tmp_path))


def test_unexpected_keys_name_what_the_key_map_made_of_them(tmp_path):
    save_file({"0.weight": torch.zeros(2, 2), "0.bias": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ModelMismatchError) as raised:
        load_pretrained(nn.Sequential(nn.Linear(2, 2)), str(tmp_path), key_map={"0.": "first."})
    assert "0.weight (as first.weight)" in str(raised.value), raised.value


def test_shardkit_reads_and_writes_the_format_itself_without_the_safetensors_package(monkeypatch, tmp_path):
    save_file({"weight": torch.ones(2, 2), "bias": torch.arange(2.0)}, tmp_path / "model.safetensors")
    monkeypatch.setitem(sys.modules, "safetensors", None)  # import safetensors would fail
    model = nn.Linear(2, 2)
    load_pretrained(model, str(tmp_path))
    assert torch.equal(model.weight.detach(), torch.ones(2, 2)) and torch.equal(model.bias.detach(), torch.arange(2.0))
    save_pretrained(model, str(tmp_path / "out"))
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_a_file_cut_inside_a_tensor_after_its_header_was_read_is_named(tmp_path):
    save_file({"w": torch.ones(64)}, tmp_path / "model.safetensors")
    entries = pretrained._entries(str(tmp_path / "model.safetensors"))
    os.truncate(tmp_path / "model.safetensors", os.path.getsize(tmp_path / "model.safetensors") - 16)
    with open(tmp_path / "model.safetensors", "rb") as f, pytest.raises(CorruptCheckpointError, match="ended inside tensor w"):
        pretrained._read_piece(f.fileno(), entries["w"], (slice(0, 64),), torch.empty(64))
