"""Every collective that sums gradients runs in ``reduce_dtype`` (tests/dtype_audit.py), on the
fake process group: each mixed-precision policy on FSDP, HSDP, FSDP x TP with sequence
parallel (the LayerNorm's gradient is ``Partial`` over tp), full SPMD and per-parameter
meshes, gradient accumulation without sync, and compiled mode. FSDP2 sums the tp-partial
gradient in ``param_dtype`` (pytorch#190626); shardkit casts it first."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

import shardkit
import shardkit.compiled
from shardkit.versions import REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE
from tests.conftest import fake_world
from tests.dtype_audit import Audit, narrower
from tests.gloo.moe_spmd_models import D, SpmdStack, is_expert, moe_block

bf16, fp32 = torch.bfloat16, torch.float32
POLICIES = {  # name -> (param_dtype, reduce_dtype)
    "bf16-fp32": (bf16, fp32),
    "bf16-none": (bf16, None),
    "fp32-bf16": (fp32, bf16),
    "none": (None, None),
}


def expected_reduce_dtype(param_dtype, reduce_dtype, own=fp32):
    """What the policy asks for: its reduce_dtype; else param_dtype before torch 2.15, the
    parameter's own dtype from 2.15 (shardkit follows the installed FSDP2 there)."""
    if reduce_dtype is not None:
        return reduce_dtype
    return own if REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE or param_dtype is None else param_dtype


def policy(name):
    param_dtype, reduce_dtype = POLICIES[name]
    return shardkit.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


class SPBlock(nn.Module):
    """A LayerNorm under sequence parallel, then a column- and a row-parallel Linear."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.down(F.relu(self.up(self.norm(x))))


SP_PLAN = {"norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)), "down": RowwiseParallel(output_layouts=Shard(1))}


def sp_model(fully_shard, mp, mesh):
    torch.manual_seed(0)
    model = nn.Sequential(SPBlock(), SPBlock())
    for block in model:
        parallelize_module(block, mesh["tp"], SP_PLAN)
        fully_shard(block, mesh=mesh["dp"], mp_policy=mp)
    fully_shard(model, mesh=mesh["dp"], mp_policy=mp)
    return model


def backward(model, x, mesh):
    loss = model(x).float().sum()
    with Audit(*mesh) as audit:
        loss.backward()
    return audit


def dp_tp():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


@pytest.mark.parametrize("name", POLICIES)
def test_tensor_parallel_partial_gradients_are_summed_in_reduce_dtype(name):
    with fake_world(4, 1):
        mesh = dp_tp()
        audit = backward(sp_model(shardkit.fully_shard, policy(name), mesh), torch.randn(2, 4, 16), [mesh])
        tp_sums = [s for s in audit.sums() if s.mesh_dim == "tp"]
        assert len(tp_sums) == 4, audit.seen  # per block: the norm's weight and bias, the row-parallel bias
        audit.assert_sums_in(expected_reduce_dtype(*POLICIES[name]), f"FSDP x TP, {name}")


def test_fsdp2_sums_the_tensor_parallel_partial_gradient_in_param_dtype():
    """The difference from FSDP2 this audit exists for: it all-reduces over tp in bf16."""
    with fake_world(4, 1):
        mesh = dp_tp()
        audit = backward(sp_model(torch_fully_shard, policy("bf16-fp32"), mesh), torch.randn(2, 4, 16), [mesh])
        assert {s.dtype for s in audit.sums() if s.mesh_dim == "tp"} == {bf16}
        assert {s.dtype for s in audit.sums() if s.mesh_dim == "dp"} == {fp32}


def test_accumulation_without_sync_sums_in_reduce_dtype():
    with fake_world(4, 1):
        mesh = dp_tp()
        model = sp_model(shardkit.fully_shard, policy("bf16-fp32"), mesh)
        model.set_requires_gradient_sync(False)
        first = backward(model, torch.randn(2, 4, 16), [mesh])
        model.set_requires_gradient_sync(True)
        last = backward(model, torch.randn(2, 4, 16), [mesh])
        for audit in (first, last):
            audit.assert_sums_in(fp32, "no sync")
        assert [s.mesh_dim for s in first.sums()].count("dp") == 0 and [s.mesh_dim for s in last.sums()].count("dp") == 2


def test_compiled_mode_sums_tensor_parallel_partials_in_reduce_dtype():
    with fake_world(4, 1):
        mesh = dp_tp()
        audit = backward(sp_model(shardkit.compiled.fully_shard, policy("bf16-fp32"), mesh), torch.randn(2, 4, 16), [mesh])
        assert [s.mesh_dim for s in audit.sums()].count("tp") == 4, audit.seen
        audit.assert_sums_in(fp32, "compiled mode, FSDP x TP")


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("layout", ["fsdp", "hsdp"])
def test_fsdp_and_hsdp_reduce_in_reduce_dtype(layout, name):
    with fake_world(4, 0):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)) if layout == "fsdp" else \
            init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        shardkit.fully_shard(model[0], mesh=mesh, mp_policy=policy(name))
        shardkit.fully_shard(model, mesh=mesh, mp_policy=policy(name))
        audit = backward(model, torch.randn(4, 8), [mesh])
        assert len(audit.sums()) == (2 if layout == "fsdp" else 4), audit.seen
        audit.assert_sums_in(expected_reduce_dtype(*POLICIES[name]), f"{layout}, {name}")


def test_full_spmd_and_per_parameter_meshes_reduce_in_reduce_dtype():
    mp = policy("bf16-fp32")
    with fake_world(8, 5):
        # (names of its own: DTensor hands out an equal mesh made earlier in the process, which
        # FSDP2's identity check in test_spmd_and_moe.py would then refuse)
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicas", "shards", "tp"))
        model = SpmdStack(mesh, n_dp=2)
        dims = shardkit.DataParallelMeshDims(shard="shards", replicate="replicas")
        for block in model.blocks:
            shardkit.fully_shard(block, mesh=mesh, dp_mesh_dims=dims, mp_policy=mp)
        shardkit.fully_shard(model, mesh=mesh, dp_mesh_dims=dims, mp_policy=mp)
        audit = backward(model, torch.randn(2, D), [mesh])
        assert audit.sums(), audit.seen
        audit.assert_sums_in(fp32, "full SPMD mesh")
    with fake_world(4, 3):
        dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        ep_efsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
        block = moe_block(ep_efsdp["ep"])
        placement = lambda p: shardkit.ShardPlacementResult(Shard(0), ep_efsdp["efsdp"]) if is_expert(p) else None  # noqa: E731
        shardkit.fully_shard(block, mesh=dp, shard_placement_fn=placement, mp_policy=mp)
        audit = backward(block, torch.randn(4, D), [dp, ep_efsdp])
        # (the experts' forward sums activations over ep in bf16: not gradients of parameters)
        grads = [s for s in audit.sums() if s.mesh_dim in ("dp", "efsdp")]
        assert {s.mesh_dim for s in grads} == {"dp", "efsdp"}, audit.seen
        assert not [s for s in grads if narrower(s.dtype, fp32)], audit.seen
