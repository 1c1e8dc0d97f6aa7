"""``shardkit.checkpoint.load_pretrained`` / ``save_pretrained`` on 4 gloo ranks, with
shardkit's parameters and with FSDP2's.

Every load check: rank 0 writes the unsharded reference's state dict with
``safetensors.torch.save_file``; every rank loads that file into its sharded model (whose
weights were first poisoned with NaN, so that an element left unread shows); the full
tensors then equal the file's bit for bit, and no collective ran during the load (the
collectives audit of tests/dtype_audit.py, widened to every c10d op):

- HSDP 2x2 on the uneven Stack (7 + 6 rows; a shard that holds no row at all);
- FSDP x TP 2x2 on the Llama (``_StridedShard``), from a bfloat16 file: the load casts;
- per-parameter meshes: an MoE block, the experts over (ep 2, efsdp 2), the rest over dp 4;
- a Llama built on the meta device, HSDP 2x2 and FSDP x TP 2x2: materialized shard by shard,
  every local tensor this rank's piece; a forward then matches the reference's.

``save_pretrained`` round trips from the FSDP x TP Llama, the MoE block and the tied GPT:
the files and the index hold exactly the reference state dict (a tied weight once, under its
first key), ``load_pretrained`` of the folder into a fresh sharded model is bit-identical, and
no rank's file holds more than about half of the bytes, and no key is in two files (under
FSDP x TP the dp-only tensors have an owner in each tp coordinate's copy of the dp mesh: one
writes).
"""

import copy
import json
import math
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Stack, shard_blocks_then_root, small_gpt
from moe_spmd_models import is_expert, moe_block

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from shardkit.checkpoint.pretrained import INDEX, load_pretrained, save_pretrained  # noqa: E402
from tests.dtype_audit import Audit  # noqa: E402

GLOO_WORLD = 4
checks = Checks()


# Helpers ------------------------------------------------------------------------------------
class AnyCollective(Audit):
    """The dtype audit's record of collectives (``seen``), and beside it the name of every
    c10d op dispatched at all (``ops``): barriers, broadcasts and object collectives too."""

    def __init__(self, *meshes: DeviceMesh) -> None:
        super().__init__(*meshes)
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name.startswith(("c10d::", "_c10d_functional::")):
            self.ops.append(func._schema.name)
        return super().__torch_dispatch__(func, types, args, kwargs)


def on_all_ranks(mesh: DeviceMesh, problems: list[str]) -> list[str]:
    """Every rank's problems (rank-local findings), so that the ranks fail together."""
    out = [None] * mesh.size()
    dist.all_gather_object(out, problems, group=mesh.get_group())
    return [f"rank {r}: {p}" for r, ps in enumerate(out) for p in ps]


def shared_tmpdir(mesh: DeviceMesh) -> str:
    holder = [tempfile.mkdtemp(dir="/tmp", prefix="pretrained-") if mesh.get_local_rank() == 0 else None]
    dist.broadcast_object_list(holder, group=mesh.get_group(), group_src=0)
    return holder[0]


def cleanup(mesh: DeviceMesh, folder: str) -> None:
    dist.barrier(group=mesh.get_group())  # nobody reads it any more
    if mesh.get_local_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)


def write_reference(mesh: DeviceMesh, ref: torch.nn.Module, folder: str, dtype: torch.dtype | None = None) -> tuple[str, dict]:
    """Rank 0 writes ``ref``'s state dict (cast to ``dtype``) to ``folder``/model.safetensors;
    every rank returns the path and the file's tensors, read back whole."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    if mesh.get_local_rank() == 0:
        state = {k: v.detach().to(dtype or v.dtype).clone().contiguous() for k, v in ref.state_dict().items()}
        save_file(state, path)
    dist.barrier(group=mesh.get_group())
    return path, load_file(path)


def poison(model: torch.nn.Module) -> None:
    """NaN in every floating-point element this rank holds: whatever the load leaves unread shows."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            local = t._local_tensor if isinstance(t, DTensor) else t
            if local.is_floating_point() and local.device.type != "meta":
                local.fill_(math.nan)


def load_without_collectives(mesh: DeviceMesh, model: torch.nn.Module, path: str, meshes=()) -> None:
    """``load_pretrained`` with nothing missing or unexpected, and no collective while it ran."""
    with AnyCollective(mesh, *meshes) as audit:
        result = load_pretrained(model, path)
    assert result.missing_keys == [] and result.unexpected_keys == [], result
    problems = on_all_ranks(mesh, [str(s) for s in audit.seen] + audit.ops)
    assert audit.seen == [] and not problems, "collectives ran during load_pretrained:\n" + "\n".join(problems)


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as full tensors (collectives: every rank, the same order)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v.detach() for k, v in model.state_dict().items()}


def assert_bit_identical(model: torch.nn.Module, expected: dict[str, torch.Tensor], what: str = "") -> None:
    actual = full_state(model)
    assert sorted(actual) == sorted(expected), f"{what}: keys {sorted(actual)} != {sorted(expected)}"
    differ = []
    for k, t in actual.items():
        want = expected[k].to(t.dtype) if expected[k].dtype != t.dtype else expected[k]
        if t.dtype != torch.float32 or t.shape != want.shape or not torch.equal(t, want):
            differ.append(f"{k}: {t.dtype} {list(t.shape)} vs {want.dtype} {list(want.shape)}, "
                          f"max |diff| {(t.float() - want.float()).abs().max().item() if t.shape == want.shape else '-'}")
    assert not differ, f"{what}: not bit-identical to the file:\n" + "\n".join(differ)


def local_pieces_problems(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    """Where a local tensor is not this rank's piece of the file's tensor, by DTensor's own
    split (``distribute_tensor`` of the full tensor on the same placements, no communication)."""
    problems = []
    for k, t in model.state_dict().items():
        if not isinstance(t, DTensor):
            continue
        mine = distribute_tensor(expected[k].to(t.dtype), t.device_mesh, t.placements, src_data_rank=None).to_local()
        local = t._local_tensor
        if local.device.type == "meta":
            problems.append(f"{k}: still on the meta device")
        elif local.shape != mine.shape:
            problems.append(f"{k}: local shape {list(local.shape)}, this rank's shard is {list(mine.shape)} ({t.placements})")
        elif not torch.equal(local, mine):
            problems.append(f"{k}: local values are not this rank's shard ({t.placements})")
    return problems


def fsdp_tp(impl: str, model: torch.nn.Module) -> DeviceMesh:
    from torch.distributed.tensor.parallel import parallelize_module

    from shardkit.models.llama import tp_plan

    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    for block in model.layers:
        parallelize_module(block, mesh["tp"], tp_plan())
        FULLY_SHARD[impl](block, mesh=mesh["dp"])
    FULLY_SHARD[impl](model, mesh=mesh["dp"])
    return mesh


def hsdp_llama(impl: str, model: torch.nn.Module) -> DeviceMesh:
    from test_composition import mesh_2d

    mesh = mesh_2d(2, 2)
    for block in model.layers:
        FULLY_SHARD[impl](block, mesh=mesh)
    FULLY_SHARD[impl](model, mesh=mesh)
    return mesh


def llama(seed: int):
    from shardkit.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    return Llama(LlamaConfig())


def experts_sharded(impl: str):
    """The MoE block, experts over (ep, efsdp), the rest over dp; and its unsharded reference."""
    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    ep_efsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
    experts_mesh = FSDPMeshInfo(ep_efsdp["efsdp"], shard_mesh_dim=0)
    block = moe_block(ep_efsdp["ep"])
    FULLY_SHARD[impl](block, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(None, experts_mesh) if is_expert(p) else None)
    return block, (dp, ep_efsdp)


# Loading ------------------------------------------------------------------------------------
@checks()
def the_audit_sees_collectives_that_load_pretrained_must_not_issue(mesh, impl):
    """A control: the audit is not blind to what the load checks say did not run."""
    with AnyCollective(mesh) as audit:
        dist.barrier(group=mesh.get_group())
        dist.all_reduce(torch.ones(2), group=mesh.get_group())
        holder = [None]
        dist.broadcast_object_list(holder, group=mesh.get_group(), group_src=0)
    assert audit.ops and [s.kind for s in audit.seen] == ["all_reduce"], (audit.ops, audit.seen)


@checks()
def hsdp_2x2_loads_each_rank_its_rows(mesh, impl):
    from test_composition import hsdp, mesh_2d

    torch.manual_seed(0)
    ref = Stack()
    torch.manual_seed(1)
    model = Stack()
    hsdp(impl, mesh_2d(2, 2))(model)
    assert model.inp.weight.placements == (Replicate(), Shard(0))
    poison(model)
    folder = shared_tmpdir(mesh)
    path, expected = write_reference(mesh, ref, folder)
    load_without_collectives(mesh, model, path)
    problems = on_all_ranks(mesh, local_pieces_problems(model, expected))
    assert not problems, "\n".join(problems)
    assert_bit_identical(model, expected, "HSDP 2x2")
    cleanup(mesh, folder)


@checks()
def fsdp_with_tensor_parallel_2x2_loads_strided_shards_from_bfloat16(mesh, impl):
    ref, model = llama(0), llama(1)
    mesh_2d = fsdp_tp(impl, model)
    assert "_StridedShard" in str(model.layers[0].attention.wq.weight.placements), model.layers[0].attention.wq.weight.placements
    poison(model)
    folder = shared_tmpdir(mesh)
    path, expected = write_reference(mesh, ref, folder, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in expected.values())
    load_without_collectives(mesh, model, path, [mesh_2d])
    problems = on_all_ranks(mesh, local_pieces_problems(model, expected))
    assert not problems, "\n".join(problems)
    assert_bit_identical(model, {k: v.float() for k, v in expected.items()}, "FSDP x TP from bf16")
    cleanup(mesh, folder)


@checks()
def moe_experts_on_their_own_mesh_load_their_pieces(mesh, impl):
    ref = moe_block()
    model, meshes = experts_sharded(impl)
    assert model.experts.w1.device_mesh.ndim == 2 and model.out.weight.device_mesh.ndim == 1
    poison(model)
    folder = shared_tmpdir(mesh)
    path, expected = write_reference(mesh, ref, folder)
    load_without_collectives(mesh, model, path, meshes)
    problems = on_all_ranks(mesh, local_pieces_problems(model, expected))
    assert not problems, "\n".join(problems)
    assert_bit_identical(model, expected, "MoE")
    cleanup(mesh, folder)


def meta_model_loads_shard_by_shard(mesh, impl, shard):
    ref = llama(0)
    with torch.device("meta"):
        model = llama(1)
    mesh_2d = shard(impl, model)
    assert all(p.device.type == "meta" for p in model.parameters())
    folder = shared_tmpdir(mesh)
    path, expected = write_reference(mesh, ref, folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_without_collectives(mesh, model, path, [mesh_2d])
    assert any("inv_freq" in str(w.message) for w in caught), [str(w.message) for w in caught]
    problems = local_pieces_problems(model, expected)
    problems += [f"{n}: on the meta device" for n, p in model.named_parameters() if p.device.type == "meta"]
    problems += [f"{n}: not on the meta device" for n, b in model.named_buffers() if n.endswith("inv_freq") and b.device.type != "meta"]
    problems = on_all_ranks(mesh, problems)
    assert not problems, "\n".join(problems)
    assert_bit_identical(model, expected, "meta-device model")
    # The loaded values are what the sharded model computes with (its buffers after to_empty)
    for (n, b), (_, r) in zip(model.named_buffers(), ref.named_buffers()):
        owner, name = model.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]
        owner._buffers[name] = r.clone()
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(2))
    mine = tokens.chunk(2)[mesh_2d.get_local_rank(0)]  # the batch split over the first mesh dim
    out = model(mine)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    gathered = [torch.empty_like(out) for _ in range(mesh.size())]
    dist.all_gather(gathered, out.contiguous(), group=mesh.get_group())
    rows = torch.cat([gathered[r] for r in mesh_2d.mesh[:, 0].tolist()])
    torch.testing.assert_close(rows, ref(tokens).detach(), atol=1e-5, rtol=1e-5)
    cleanup(mesh, folder)


@checks()
def meta_device_model_under_hsdp_loads_shard_by_shard(mesh, impl):
    meta_model_loads_shard_by_shard(mesh, impl, hsdp_llama)


@checks()
def meta_device_model_under_fsdp_with_tensor_parallel_loads_shard_by_shard(mesh, impl):
    meta_model_loads_shard_by_shard(mesh, impl, fsdp_tp)


# Saving -------------------------------------------------------------------------------------
def first_of_tied(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict, a tensor shared by several keys under its first key only."""
    seen, out = set(), {}
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen.add(id(v))
            out[k] = v.detach()
    return out


def save_round_trip(mesh, model, fresh, ref, meshes=()) -> None:
    """``model`` (sharded, the reference's weights) saved; the folder read back by safetensors
    and by ``load_pretrained`` into ``fresh`` (sharded the same way, other weights)."""
    from safetensors.torch import load_file

    folder = shared_tmpdir(mesh)
    out = os.path.join(folder, "saved")
    save_pretrained(model, out)
    expected = first_of_tied(ref)
    with open(os.path.join(out, INDEX)) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    assert sorted(os.listdir(out)) == sorted(files + [INDEX]), (os.listdir(out), files)
    read, where = {}, {}
    for name in files:
        for k, v in load_file(os.path.join(out, name)).items():
            assert k not in read, f"{k} is in both {where[k]} and {name}"
            read[k], where[k] = v, name
    assert where == weight_map, f"the index says {weight_map}, the files hold {where}"
    assert sorted(read) == sorted(expected), f"saved keys {sorted(read)} != {sorted(expected)}"
    differ = [k for k, v in expected.items() if read[k].dtype != v.dtype or not torch.equal(read[k], v)]
    assert not differ, f"saved tensors differ from the reference: {differ}"
    sizes = {name: os.path.getsize(os.path.join(out, name)) for name in files}
    assert len(files) > 1 and max(sizes.values()) <= 0.55 * sum(sizes.values()), f"unbalanced files: {sizes}"
    poison(fresh)
    load_without_collectives(mesh, fresh, out, meshes)
    assert_bit_identical(fresh, {k: v.detach() for k, v in ref.state_dict().items()}, "saved, then loaded")
    cleanup(mesh, folder)


@checks()
def save_pretrained_round_trip_from_fsdp_with_tensor_parallel(mesh, impl):
    ref, model, fresh = llama(0), llama(0), llama(1)
    mesh_2d = fsdp_tp(impl, model)
    fsdp_tp(impl, fresh)
    save_round_trip(mesh, model, fresh, ref, [mesh_2d])


@checks()
def save_pretrained_round_trip_from_moe_experts_on_their_own_mesh(mesh, impl):
    ref = moe_block()
    model, meshes = experts_sharded(impl)
    fresh, _ = experts_sharded(impl)
    save_round_trip(mesh, model, fresh, ref, meshes)


@checks()
def save_pretrained_round_trip_of_the_tied_gpt(mesh, impl):
    torch.manual_seed(0)
    ref = small_gpt()
    model = copy.deepcopy(ref)
    torch.manual_seed(1)
    fresh = small_gpt()
    for m in (model, fresh):
        shard_blocks_then_root(impl, mesh)(m)
    assert model.head.weight is model.tok_emb.weight
    assert "head.weight" not in first_of_tied(ref)
    save_round_trip(mesh, model, fresh, ref, [mesh])


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_pretrained_on_four_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
