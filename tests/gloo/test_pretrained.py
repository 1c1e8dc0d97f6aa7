"""``shardkit.checkpoint.load_pretrained`` / ``save_pretrained`` on 2 gloo ranks, with shardkit's
and FSDP2's parameters: safetensors read straight into the shards (bit-identical to the file,
no collective, each rank reading only its rows), meta-built models, casts, key maps, tied
weights, the errors of a mismatched or damaged file, the Hugging Face layout written back
(each tensor whole on one rank only), and a tiny Llama saved by transformers that loads and
trains as transformers' own single-process model. (4 ranks, HSDP, FSDP x TP, per-parameter
meshes: test_pretrained_four_ranks.py.)
"""

import functools
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import shardkit
from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Stack, full, shard_blocks_then_root, small_gpt
from shardkit.checkpoint import CorruptCheckpointError, ModelMismatchError, load_pretrained, save_pretrained

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.dtype_audit import Audit  # noqa: E402

checks = Checks()


_folders: list[str] = []  # made by the running check; removed when it passes (kept to look into when it fails)


def shared_tmpdir(mesh) -> str:
    holder = [tempfile.mkdtemp(dir="/tmp", prefix="pretrained-") if mesh.get_local_rank() == 0 else None]
    dist.broadcast_object_list(holder, group=mesh.get_group(), group_src=0)
    _folders.append(holder[0])
    return holder[0]


def removes_its_folders(check):
    @functools.wraps(check)
    def run(mesh, impl):
        _folders.clear()
        check(mesh, impl)
        dist.barrier(group=mesh.get_group())  # nobody reads them any more
        if mesh.get_local_rank() == 0:
            for folder in _folders:
                shutil.rmtree(folder, ignore_errors=True)
        _folders.clear()

    return run


def written(mesh, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> str:
    """``tensors`` in one safetensors file, written by rank 0; its path on every rank."""
    path = os.path.join(shared_tmpdir(mesh), name)
    if mesh.get_local_rank() == 0:
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, path)
    dist.barrier(group=mesh.get_group())
    return path


def seeded(make, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return make()


def sharded(make, impl: str, mesh, seed: int = 0) -> nn.Module:
    model = seeded(make, seed)
    shard_blocks_then_root(impl, mesh)(model)
    return model


def c10d_ops() -> Audit:
    """Records every collective issued below the dispatcher, whoever issues it."""
    return Audit()


def assert_holds(model: nn.Module, tensors: dict[str, torch.Tensor], cast=None) -> None:
    """Every tensor of the model's state dict, gathered, is the file's bit for bit."""
    for key, value in model.state_dict().items():
        want = tensors[key] if cast is None else tensors[key].to(cast)
        got = full(value)
        assert got.dtype == want.dtype and torch.equal(got, want), f"{key}: differs from the file"


class WithBuffers(Stack):
    """The Stack with a persistent buffer (in the file) and a non-persistent one (not)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.scale + self.table[:3]


@checks()
@removes_its_folders
def fsdp_loads_bit_identical_reading_only_its_rows_and_no_collective(mesh, impl):
    file_model = seeded(Stack, 1)
    tensors = file_model.state_dict()
    path = written(mesh, tensors)
    model = sharded(Stack, impl, mesh)  # other weights; uneven rows (13 = 7 + 6, and 1 + 0)
    with c10d_ops() as ops:
        result = load_pretrained(model, path)
    assert ops.seen == [], [str(s) for s in ops.seen]
    assert list(result.missing_keys) == [] and list(result.unexpected_keys) == []
    assert_holds(model, tensors)
    # each rank read its rows: the local shards are the file's rows, rank 1 holds none of blocks.1
    rows = model.blocks[1].lin.weight.to_local()
    assert rows.shape[0] == (1 if mesh.get_local_rank() == 0 else 0)
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), file_model(x))  # and computes as the file's model


@checks()
@removes_its_folders
def a_bf16_file_is_cast_to_the_parameters_dtype(mesh, impl):
    tensors = {k: v.to(torch.bfloat16) for k, v in seeded(Stack, 2).state_dict().items()}
    model = sharded(Stack, impl, mesh)
    load_pretrained(model, written(mesh, tensors))
    assert_holds(model, tensors, cast=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@checks()
@removes_its_folders
def a_meta_built_model_is_materialized_shard_by_shard(mesh, impl):
    tensors = seeded(WithBuffers, 3).state_dict()
    path = written(mesh, tensors)
    with torch.device("meta"):
        model = WithBuffers()
    shard_blocks_then_root(impl, mesh)(model)
    with pytest.warns(UserWarning, match=r"non-persistent buffers \['table'\]"):
        load_pretrained(model, path)
    assert_holds(model, tensors)
    for name, p in model.named_parameters():  # this rank's shard, not the full tensor
        assert p.device.type == "cpu" and p.to_local().shape == p.to_local().shape, name
        assert p.to_local().shape[0] <= (p.shape[0] + 1) // 2, name
    assert model.table.device.type == "meta"  # not in the file: left for the user, loudly
    model.table = torch.arange(4.0)
    x = torch.randn(2, 8)
    torch.testing.assert_close(model(x), seeded(WithBuffers, 3)(x))


@checks()
@removes_its_folders
def tied_weights_load_from_one_key_and_a_key_map_renames_prefixes(mesh, impl):
    ref = seeded(small_gpt, 4)
    assert ref.head.weight is ref.tok_emb.weight
    # the Hugging Face way: one tensor per tied set, keys under a prefix
    tensors = {f"transformer.{k}": v for k, v in ref.state_dict().items() if k != "head.weight"}
    path = written(mesh, tensors)
    model = sharded(small_gpt, impl, mesh)
    load_pretrained(model, path, key_map={"transformer.": ""})
    assert_holds(model, {k.removeprefix("transformer."): v for k, v in tensors.items()} | {"head.weight": ref.head.weight.detach()})
    assert model.head.weight is model.tok_emb.weight  # still tied
    # a function works too; None skips a key
    model = sharded(small_gpt, impl, mesh, seed=5)
    result = load_pretrained(model, path, key_map=lambda k: None if k.endswith("pos_emb.weight") else k.removeprefix("transformer."), strict=False)
    assert list(result.missing_keys) == ["pos_emb.weight"] and list(result.unexpected_keys) == []


@checks()
@removes_its_folders
def mismatched_keys_and_shapes_raise_listing_them_and_change_nothing(mesh, impl):
    tensors = dict(seeded(Stack, 6).state_dict())
    tensors["extra.weight"] = torch.zeros(2)
    del tensors["out.bias"]
    path = written(mesh, tensors)
    model = sharded(Stack, impl, mesh)
    before = {k: full(v).clone() for k, v in model.state_dict().items()}
    with pytest.raises(ModelMismatchError) as raised:
        load_pretrained(model, path)
    message = str(raised.value)
    assert "missing from the file (1): out.bias" in message and "in the file but not in the model (1): extra.weight" in message, message
    assert path in message and "strict=False" in message
    assert all(torch.equal(full(v), before[k]) for k, v in model.state_dict().items())  # nothing was read
    result = load_pretrained(model, path, strict=False)
    assert list(result.missing_keys) == ["out.bias"] and list(result.unexpected_keys) == ["extra.weight"]
    assert torch.equal(full(model.out.bias.detach()), before["out.bias"])
    assert torch.equal(full(model.inp.weight.detach()), tensors["inp.weight"])
    tensors = dict(seeded(Stack, 6).state_dict())
    tensors["inp.weight"] = torch.zeros(13, 9)
    with pytest.raises(ModelMismatchError, match=r"shapes differ: inp.weight: the file has \[13, 9\] .* the model \[13, 8\]"):
        load_pretrained(model, written(mesh, tensors), strict=False)  # a shape is an error either way


@checks()
@removes_its_folders
def a_truncated_or_corrupt_file_raises_naming_it(mesh, impl):
    path = written(mesh, seeded(Stack, 7).state_dict())
    damaged = {"truncated": path + ".cut", "garbage": path + ".bad"}
    if mesh.get_local_rank() == 0:
        data = open(path, "rb").read()
        open(damaged["truncated"], "wb").write(data[:-100])
        open(damaged["garbage"], "wb").write(b"\xff" * 64)
    dist.barrier(group=mesh.get_group())
    model = sharded(Stack, impl, mesh)
    for what, file in damaged.items():
        with pytest.raises(CorruptCheckpointError, match="truncated or corrupt") as raised:
            load_pretrained(model, file)
        assert file in str(raised.value), (what, raised.value)
    with pytest.raises(shardkit.checkpoint.CheckpointError, match="does not exist"):
        load_pretrained(model, path + ".missing")


@checks()
@removes_its_folders
def save_pretrained_writes_each_tensor_whole_on_one_rank_and_loads_back(mesh, impl):
    model = sharded(small_gpt, impl, mesh, seed=8)
    expected = {k: full(v) for k, v in model.state_dict().items() if k != "head.weight"}  # tied: its first key
    folder = shared_tmpdir(mesh)
    with shardkit.trace() as t, c10d_ops() as ops:
        save_pretrained(model, folder)
    kinds = {s.kind for s in ops.seen}
    assert "all_gather" not in kinds and "all_to_all" in kinds, [str(s) for s in ops.seen]
    assert [r.group for r in t.collectives("all_to_all")] == ["save_pretrained bucket 0 in"]
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], files
    read, sizes = {}, []
    for name in files:
        part = load_file(os.path.join(folder, name))
        sizes.append(sum(v.numel() * v.element_size() for v in part.values()))
        assert all(index["weight_map"][k] == name for k in part)
        read.update(part)
    assert index["metadata"]["total_size"] == sum(sizes)
    assert read.keys() == expected.keys() and all(torch.equal(read[k], expected[k]) for k in read)
    assert max(sizes) <= 0.6 * sum(sizes), sizes  # spread over the ranks: no rank writes the model
    with safe_open(os.path.join(folder, files[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    other = sharded(small_gpt, impl, mesh, seed=9)
    load_pretrained(other, folder)
    assert_holds(other, expected | {"head.weight": expected["tok_emb.weight"]})


@checks("shardkit", sim=False)
@removes_its_folders
def a_tiny_llama_saved_by_transformers_loads_and_trains_as_transformers_own(mesh, impl):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False)
    folder = shared_tmpdir(mesh)
    if mesh.get_local_rank() == 0:
        torch.manual_seed(10)
        LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="20KB")  # several files and an index
    dist.barrier(group=mesh.get_group())
    ref = LlamaForCausalLM.from_pretrained(folder)  # transformers' own, one process
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        FULLY_SHARD[impl](layer, mesh=mesh)
    FULLY_SHARD[impl](model, mesh=mesh)
    with pytest.warns(UserWarning, match="inv_freq"):
        load_pretrained(model, folder)
    rotary = model.model.rotary_emb  # rebuild the non-persistent buffer, as transformers does on load
    rotary.inv_freq = ref.model.rotary_emb.inv_freq.clone()
    rotary.original_inv_freq = ref.model.rotary_emb.original_inv_freq.clone()
    assert_holds(model, ref.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(11)
    for _ in range(3):
        tokens = torch.randint(0, 96, (4, 12), generator=g)
        mine = tokens.chunk(mesh.size())[mesh.get_local_rank()]
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        ref_loss = sum(ref(input_ids=t, labels=t).loss for t in tokens.chunk(mesh.size())) / mesh.size()
        ref_loss.backward()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=mesh.get_group())
        torch.testing.assert_close(mean / mesh.size(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.detach()), q.detach(), atol=1e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    # and back: transformers reads what save_pretrained wrote (config.json included)
    out = shared_tmpdir(mesh)
    save_pretrained(model, out)
    if mesh.get_local_rank() == 0:
        back = LlamaForCausalLM.from_pretrained(out)
        for (name, p), q in zip(model.named_parameters(), back.parameters()):
            assert torch.equal(full(p.detach()), q.detach()), name
    else:
        for p in model.parameters():
            full(p.detach())  # the same all-gathers as rank 0's comparison


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_pretrained_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
