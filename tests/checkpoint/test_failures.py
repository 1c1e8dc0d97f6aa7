"""Every way ``shardkit.checkpoint`` can fail says so as a ``CheckpointError`` (an
``Exception``) naming the path, the rank and what to do; nothing in a checkpoint folder runs
code. One gloo rank, in this process."""

import errno
import json
import os
import pickle
import shutil
import tempfile
import zlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import shardkit
from shardkit import checkpoint
from shardkit.checkpoint import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    ModelMismatchError,
    UnsafeCheckpointError,
)
from tests.conftest import forget_meshes


@pytest.fixture(scope="module")
def mesh():
    with tempfile.TemporaryDirectory() as folder:  # (tmp_path_factory's folders outlive a passing run)
        store = dist.FileStore(os.path.join(folder, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        yield init_device_mesh("cpu", (1,))
        dist.destroy_process_group()
        forget_meshes()


def model(mesh, width: int = 8, extra_layer: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(4, width), nn.Linear(width, 2)] + ([nn.Linear(2, 2)] if extra_layer else [])
    m = nn.Sequential(*layers)
    for layer in m:
        shardkit.fully_shard(layer, mesh=mesh)
    shardkit.fully_shard(m, mesh=mesh)
    return m


def trained(mesh):
    m = model(mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    return m, opt


@pytest.fixture
def saved(mesh, tmp_path):
    m, opt = trained(mesh)
    path = str(tmp_path / "step_1")
    checkpoint.save(path, m, opt, step=1)
    return path, m, opt


def test_a_round_trip_loads_what_was_saved_and_the_manifest_lists_every_file(mesh, saved):
    path, m, opt = saved
    meta = json.load(open(os.path.join(path, "COMPLETE")))
    assert sorted(meta["files"]) == [".metadata", "__0_0.distcp"]
    assert set(meta["files"][".metadata"]) == {"bytes", "crc32"} and set(meta["files"]["__0_0.distcp"]) == {"bytes", "items"}
    assert len(meta["files"]["__0_0.distcp"]["items"]) > 1  # one CRC-32 per item, checked as it is read
    fresh = model(mesh)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert checkpoint.load(path, fresh, fresh_opt)["step"] == 1
    for a, b in zip(fresh.parameters(), m.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())


def test_a_flipped_bit_is_caught_naming_the_file_and_both_checksums(mesh, saved):
    path, _, _ = saved
    shard = os.path.join(path, "__0_0.distcp")
    items = json.load(open(os.path.join(path, "COMPLETE")))["files"]["__0_0.distcp"]["items"]
    offset = max(items, key=lambda o: items[o][0])  # the largest item
    length, crc = items[offset]
    data = bytearray(open(shard, "rb").read())
    data[int(offset) + length // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))
    actual = zlib.crc32(bytes(data[int(offset):int(offset) + length]))
    fresh = model(mesh)
    with pytest.raises(CorruptCheckpointError) as info:
        checkpoint.load(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))
    assert str(info.value) == (
        f"{path} (rank 0): __0_0.distcp is damaged: bytes {offset}..{int(offset) + length} (one item) have CRC-32 "
        f"{actual:08x}, the save wrote {crc}. The model is partly loaded: load a good checkpoint into it. "
        "No complete checkpoint is next to it."
    )


def test_a_truncated_file_is_caught_and_the_previous_checkpoint_is_named(mesh, saved, tmp_path):
    path, m, opt = saved
    previous = str(tmp_path / "step_0")
    shutil.copytree(path, previous)
    shard = os.path.join(path, "__0_0.distcp")
    size = os.path.getsize(shard)
    os.truncate(shard, size // 2)
    with pytest.raises(CorruptCheckpointError, match=rf"__0_0.distcp is damaged: the save wrote {size} bytes, the file has {size // 2}\. "
                       rf"Do not load it\. Complete checkpoints that load would accept: {previous}\.$"):
        checkpoint.load(path, model(mesh))


def test_a_missing_file_is_named(mesh, saved):
    path, _, _ = saved
    os.remove(os.path.join(path, ".metadata"))
    with pytest.raises(CorruptCheckpointError, match=r"\(rank 0\): .metadata is missing \(the save wrote \d+ bytes\)\."):
        checkpoint.load(path, model(mesh))


def test_a_path_that_does_not_exist_says_so(mesh, tmp_path):
    path = str(tmp_path / "nowhere")
    with pytest.raises(IncompleteCheckpointError) as info:
        checkpoint.load(path, model(mesh))
    assert str(info.value) == f"{path} (rank 0): does not exist. No complete checkpoint is next to it."


def test_an_incomplete_folder_names_the_complete_neighbours(mesh, saved):
    path, m, opt = saved
    os.rename(path, path + ".old")  # killed between the two renames: the good copies are aside
    shutil.copytree(path + ".old", path + ".incomplete")
    with pytest.raises(IncompleteCheckpointError) as info:
        checkpoint.load(path, model(mesh))
    assert str(info.value) == (
        f"{path} (rank 0): does not exist. Complete checkpoints that load would accept: "
        f"{path}.incomplete, {path}.old."
    )
    os.remove(os.path.join(path + ".incomplete", "COMPLETE"))
    with pytest.raises(IncompleteCheckpointError) as info:
        checkpoint.load(path + ".incomplete", model(mesh))
    assert str(info.value) == (
        f"{path}.incomplete (rank 0): is not a complete shardkit checkpoint: it has no COMPLETE marker. "
        f"A save into it was interrupted. Complete checkpoints that load would accept: {path}.old."
    )


def test_a_garbage_marker_names_the_path(mesh, saved):
    path, _, _ = saved
    open(os.path.join(path, "COMPLETE"), "w").write("{not json")
    with pytest.raises(CorruptCheckpointError, match=rf"^{path} \(rank 0\): its COMPLETE marker is not what a save writes \(Expecting property name"):
        checkpoint.load(path, model(mesh))


def test_another_model_lists_missing_unexpected_and_reshaped_keys(mesh, saved):
    path, _, _ = saved
    with pytest.raises(ModelMismatchError) as info:
        checkpoint.load(path, model(mesh, width=6, extra_layer=True))
    assert str(info.value) == (
        f"{path} (rank 0): was saved from another model; missing from the checkpoint: ['2.bias', '2.weight']; "
        "other shapes: ['0.bias: checkpoint (8,), model (6,)', '0.weight: checkpoint (8, 4), model (6, 4)', "
        "'1.weight: checkpoint (2, 8), model (2, 6)']."
    )
    smaller = nn.Sequential(nn.Linear(4, 8))
    shardkit.fully_shard(smaller, mesh=mesh)
    with pytest.raises(ModelMismatchError, match=r"not in the model: \['1.bias', '1.weight'\]\.$"):
        checkpoint.load(path, smaller)


class Payload:
    """What an attacker pickles: unpickling it would create a file."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (exec, (f"open({self.target!r}, 'w').write('ran')",))


def test_a_malicious_metadata_runs_nothing_and_names_the_refused_global(mesh, saved, tmp_path):
    path, _, _ = saved
    target = str(tmp_path / "pwned")
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Payload(target), f)
    meta = json.load(open(os.path.join(path, "COMPLETE")))
    meta["files"][".metadata"] = checkpoint.manifest.checksum(os.path.join(path, ".metadata"))  # an attacker rewrites the manifest too
    json.dump(meta, open(os.path.join(path, "COMPLETE"), "w"))
    with pytest.raises(UnsafeCheckpointError) as info:
        checkpoint.load(path, model(mesh))
    assert not os.path.exists(target)
    assert str(info.value) == (
        f"{path} (rank 0): .metadata asks to import builtins.exec, which a checkpoint never needs; nothing was run. "
        "Load only checkpoints you trust to be shardkit's."
    )


def test_torchs_base_exception_and_a_full_disk_come_out_as_checkpoint_errors(mesh, saved, tmp_path, monkeypatch):
    path, m, opt = saved
    # A key the checkpoint lacks, past our own check (the optimizer's): torch raises its
    # CheckpointException, a BaseException; load turns it into a CheckpointError (an Exception).
    other_opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    other_opt.step()
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path, m, other_opt)
    assert str(info.value) == (
        f"{path} (rank 0): loading failed: RuntimeError: Missing key in checkpoint state_dict: "
        "optim.state.0.weight.momentum_buffer. (on ranks [0]; the cause holds each rank's traceback)"
    )
    assert isinstance(info.value, Exception) and type(info.value.__cause__).__name__ == "CheckpointException"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.FileSystemWriter, "write_data", full)
    target = str(tmp_path / "step_2")
    with pytest.raises(CheckpointError, match=rf"^{target} \(rank 0\): saving failed: OSError: \[Errno 28\] No space left on device \(on ranks \[0\];"):
        checkpoint.save(target, m, opt, step=2)
    assert checkpoint.latest(str(tmp_path)) == os.path.join(str(tmp_path), "step_1")  # the last good one


def test_latest_returns_the_newest_complete_checkpoint(mesh, tmp_path):
    m, opt = trained(mesh)
    assert checkpoint.latest(str(tmp_path)) is None
    for step in (100, 300, 200):
        checkpoint.save(str(tmp_path / f"step_{step}"), m, opt, step=step)
    os.mkdir(tmp_path / "step_400.incomplete")  # a save killed early: no marker
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_300")


def test_an_async_save_returns_a_future_and_publishes_when_done(mesh, tmp_path):
    m, opt = trained(mesh)
    path = str(tmp_path / "async")
    future = checkpoint.save(path, m, opt, step=7, async_save=True)
    assert future.result(timeout=60) is None
    assert checkpoint.read_marker(path)["step"] == 7 and ".metadata" in checkpoint.read_marker(path)["files"]
    fresh = model(mesh)
    checkpoint.load(path, fresh)
    for a, b in zip(fresh.parameters(), m.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())


def test_a_second_save_waits_for_the_asynchronous_one_before_it(mesh, tmp_path):
    m, opt = trained(mesh)
    first = checkpoint.save(str(tmp_path / "a"), m, opt, step=1, async_save=True)
    checkpoint.save(str(tmp_path / "a"), m, opt, step=2)  # the same path: never two writers
    assert first.done() and first.exception() is None
    assert checkpoint.read_marker(str(tmp_path / "a"))["step"] == 2
