"""``shardkit.clip_grad_norm_`` on the fake process group: the all-reduces it issues, one per
process group the gradients are sharded over, each over the ranks of their sharded mesh dims
(never a Replicate() dim), on shardkit's parameters and on FSDP2's, where torch's own clip
raises; and its errors. The values are checked on gloo (tests/gloo/test_clip_four_ranks.py).

Both implementations run in one fake world, on the same mesh objects: a mesh equal to one of
an earlier (destroyed) fake world came back there as that very object, with the flattened
groups of that world, which no longer resolve."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import shardkit
from shardkit.models.llama import Llama, LlamaConfig, tp_plan
from tests.conftest import fake_world
from tests.gloo.moe_spmd_models import D, SpmdStack, is_expert, moe_block

IMPLS = {"shardkit": shardkit.fully_shard, "fsdp2": torch_fully_shard}


class AllReduces(TorchDispatchMode):
    """The ranks of every c10d all-reduce's process group, in order, whoever issues it."""

    def __init__(self) -> None:
        super().__init__()
        self.ranks: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == "c10d::allreduce_":
            self.ranks.append(dist.get_process_group_ranks(dist.ProcessGroup.unbox(args[1])))
        return func(*args, **kwargs or {})


def clip(model: nn.Module, norm_type: float = 2.0) -> tuple[list[tuple], list[list[int]]]:
    """``clip_grad_norm_`` on ``model``: its all-reduces as the trace has them (world, mesh
    dims, op), and the ranks of each."""
    with shardkit.trace() as t, AllReduces() as seen:
        norm = shardkit.clip_grad_norm_(model.parameters(), 1.0, norm_type)
    assert type(norm) is torch.Tensor and norm.shape == ()
    return [(e.world, e.mesh_dim, e.op) for e in t.collectives("all_reduce")], seen.ranks


def test_moe_experts_and_dense_layers_share_one_all_reduce_where_torchs_clip_raises():
    with fake_world(4, 3):
        dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        ep_efsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
        experts = FSDPMeshInfo(ep_efsdp["efsdp"], shard_mesh_dim=0)
        for impl, fully_shard in IMPLS.items():
            block = moe_block(ep_efsdp["ep"])
            fully_shard(block, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(None, experts) if is_expert(p) else None)
            block(torch.randn(4, D)).sum().backward()
            with pytest.raises(Exception) as raised:
                torch.nn.utils.clip_grad_norm_(block.parameters(), 1.0)
            assert "must have the same mesh" in f"{raised.value} {raised.value.__cause__}", impl
            # the experts over (efsdp, ep) and the rest over dp: both every rank, one process group
            assert clip(block) == ([(4, "dp+efsdp*ep", "sum")], [[0, 1, 2, 3]]), impl
            assert clip(block, math.inf) == ([(4, "dp+efsdp*ep", "max")], [[0, 1, 2, 3]]), impl


def test_fsdp_with_tp_all_reduces_over_dp_and_over_dp_x_tp():
    with fake_world(8, 5):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        for impl, fully_shard in IMPLS.items():
            torch.manual_seed(0)
            model = Llama(LlamaConfig())
            for block in model.layers:
                parallelize_module(block, mesh["tp"], tp_plan())
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
            model(torch.randint(0, 64, (2, 8))).sum().backward()
            # the norms and embeddings: Shard(0) over dp (rank 5's dp group: 1, 5); the tp weights:
            # (_StridedShard or Shard, Shard) over both dims: all 8 ranks
            assert clip(model) == ([(2, "dp", "sum"), (8, "dp*tp", "sum")], [[1, 5], list(range(8))]), impl


def test_hsdp_sums_over_the_shard_dim_only_and_plain_parameters_add_locally():
    with fake_world(8, 5):
        mesh = DeviceMesh("cpu", torch.arange(8).view(2, 4), mesh_dim_names=("replicate", "shard"))
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        shardkit.fully_shard(model[0], mesh=mesh)  # model[1] stays plain
        model(torch.randn(3, 4)).sum().backward()
        assert isinstance(model[0].weight.grad, DTensor) and not isinstance(model[1].weight.grad, DTensor)
        assert clip(model, 1.0) == ([(4, "shard", "sum")], [[4, 5, 6, 7]])


def test_full_spmd_mesh_all_reduces_per_set_of_sharded_dims():
    with fake_world(8, 5):  # rank 5 is (1, 0, 1) on (replicate, shard, tp)
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        model = SpmdStack(mesh, n_dp=2)
        dims = shardkit.DataParallelMeshDims(shard="shard", replicate="replicate")
        for block in model.blocks:
            shardkit.fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
        model(torch.randn(4, D)).sum().backward()
        assert [str(p.grad.placements) for p in model.blocks[0].parameters()] == [
            "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))", "(Replicate(), Shard(dim=0), Shard(dim=1))",
            "(Replicate(), Shard(dim=0), Replicate())"]
        # w1, w2 over (shard, tp); b over shard alone; never over replicate
        assert clip(model) == ([(4, "shard*tp", "sum"), (2, "shard", "sum")], [[4, 5, 6, 7], [5, 7]])


def test_a_mesh_without_dim_names_all_reduces_dim_by_dim():
    with fake_world(4, 2):
        mesh = init_device_mesh("cpu", (2, 2))
        p = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0), Shard(1)]))
        q = nn.Parameter(distribute_tensor(torch.randn(4), mesh, [Replicate(), Replicate()]))  # no collective
        p.grad, q.grad = torch.ones_like(p), torch.ones_like(q)
        assert clip(nn.ParameterList([p, q])) == ([(2, "dim0*dim1", "sum")] * 2, [[0, 2], [2, 3]])


def test_a_partial_gradient_and_a_norm_type_of_zero_raise():
    with fake_world(2, 0):
        mesh = init_device_mesh("cpu", (2,))
        p = nn.Parameter(distribute_tensor(torch.randn(4), mesh, [Replicate()]))
        p.grad = DTensor.from_local(torch.ones(4), mesh, [Partial()])
        with pytest.raises(ValueError, match="Partial gradient is not reduced yet"):
            shardkit.clip_grad_norm_([p], 1.0)
        with pytest.raises(ValueError, match="norm_type must be positive or inf, got 0.0"):
            shardkit.grad_norm([p], 0)
