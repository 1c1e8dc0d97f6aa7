"""FSDP2's full SPMD meshes (``dp_mesh_dims``) and per-parameter meshes
(``ShardPlacementResult``) on the fake process group: placements, shard sizes and the
collectives, equal to torch FSDP2's on the same model, and the errors for bad input."""

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.utils._python_dispatch import TorchDispatchMode

import shardkit
from tests.conftest import fake_world
from tests.gloo.moe_spmd_models import D, SpmdStack, is_expert, moe_block


class Collectives(TorchDispatchMode):
    """(kind, ranks, all-gather numel) of every c10d collective, whoever issues it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("c10d::"):
            kind = name.removeprefix("c10d::").rstrip("_")
            size = lambda g: dist.ProcessGroup.unbox(g).size()  # noqa: E731
            if kind == "_allgather_base":
                self.seen[("all_gather", size(args[2]), args[0].numel())] += 1
            elif kind in ("_reduce_scatter_base", "alltoall_base"):
                self.seen[("reduce_scatter", size(args[2]))] += 1
            elif kind == "allreduce":
                self.seen[("all_reduce", size(args[1]))] += 1
        return func(*args, **kwargs or {})


def spmd_3d(fully_shard, dims_cls, rank=5):
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    model = SpmdStack(mesh, n_dp=2)
    dims = dims_cls(shard="dp_shard", replicate="dp_replicate")
    for block in model.blocks:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    return model


def describe(model) -> str:
    return "\n".join(
        f"{name} {tuple(p.shape)} {p.device_mesh.mesh_dim_names} {p.placements} local {tuple(p.to_local().shape)}"
        for name, p in model.named_parameters()
    )


def one_step(model) -> Counter:
    with Collectives() as c:
        model(torch.randn(4, D)).sum().backward()
    return c.seen


def test_3d_mesh_with_dp_mesh_dims_places_and_gathers_as_fsdp2():
    # FSDP2 first: it wants the parameters' mesh to be the very mesh object it is given, and
    # DTensor hands out an equal mesh of an earlier (fake) world it has seen.
    with fake_world(8, 5):
        theirs = spmd_3d(torch_fully_shard, TorchDims)
        theirs_text, theirs_collectives = describe(theirs), one_step(theirs)
    with fake_world(8, 5):
        ours = spmd_3d(shardkit.fully_shard, shardkit.DataParallelMeshDims)
        ours_text, ours_collectives = describe(ours), one_step(ours)
        grad = ours.blocks[0].w1.grad
        assert grad.placements == ours.blocks[0].w1.placements and grad.to_local().shape == ours.blocks[0].w1.to_local().shape
    assert ours_text == theirs_text
    assert_expected_inline(ours_text, """\
blocks.0.w1 (16, 8) ('dp_replicate', 'dp_shard', 'tp') (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)) local (4, 8)
blocks.0.w2 (8, 16) ('dp_replicate', 'dp_shard', 'tp') (Replicate(), Shard(dim=0), Shard(dim=1)) local (4, 8)
blocks.0.b (8,) ('dp_replicate', 'dp_shard', 'tp') (Replicate(), Shard(dim=0), Replicate()) local (4,)
blocks.1.w1 (16, 8) ('dp_replicate', 'dp_shard', 'tp') (Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)) local (4, 8)
blocks.1.w2 (8, 16) ('dp_replicate', 'dp_shard', 'tp') (Replicate(), Shard(dim=0), Shard(dim=1)) local (4, 8)
blocks.1.b (8,) ('dp_replicate', 'dp_shard', 'tp') (Replicate(), Shard(dim=0), Replicate()) local (4,)""")
    # The all-gathers by size and group, the reduce-scatters over dp_shard and the HSDP
    # all-reduces over dp_replicate: the same in both. Per block: w1 and w2 are (8, 8) tp-local,
    # (4, 8) per dp_shard rank, b (4,): 68 elements from each of 2 ranks; gathered in forward
    # and again in backward.
    assert ours_collectives == theirs_collectives, (ours_collectives, theirs_collectives)
    assert ours_collectives == Counter({("all_gather", 2, 136): 4, ("reduce_scatter", 2): 2, ("all_reduce", 2): 2})


def test_flattened_shard_dims_as_fsdp2():
    """Several shard dims are flattened into one (dp_shard and cp here)."""
    def build(fully_shard, dims_cls):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
        model = SpmdStack(mesh, n_dp=2)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims_cls(shard=("dp_shard", "cp")))
        return model

    with fake_world(8, 3):  # FSDP2 first (see above)
        theirs = build(torch_fully_shard, TorchDims)
        theirs_text, theirs_collectives = describe(theirs), one_step(theirs)
    with fake_world(8, 3):
        ours = build(shardkit.fully_shard, shardkit.DataParallelMeshDims)
        ours_text = describe(ours)
        assert ours_text == theirs_text
        assert one_step(ours) == theirs_collectives
    assert "('dp_shard_cp', 'tp')" in ours_text


def test_errors_name_the_problem():
    with fake_world(8, 0):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        with pytest.raises(ValueError, match="Mesh dim name 'dp' not found"):
            shardkit.fully_shard(SpmdStack(mesh, n_dp=2), mesh=mesh, dp_mesh_dims=shardkit.DataParallelMeshDims(shard="dp"))
        with pytest.raises(ValueError, match="'w1' of Linear|plain tensor"):
            shardkit.fully_shard(torch.nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=shardkit.DataParallelMeshDims(shard="dp_shard"))
        with pytest.raises(NotImplementedError, match="reshard_after_forward as int"):
            shardkit.fully_shard(SpmdStack(mesh, n_dp=2), mesh=mesh, reshard_after_forward=2,
                                 dp_mesh_dims=shardkit.DataParallelMeshDims(shard="dp_shard"))
        with pytest.raises(ValueError, match="'w1' of SpmdBlock: expected Replicate\\(\\) on the data-parallel dim 'tp'"):
            shardkit.fully_shard(SpmdStack(mesh, n_dp=2), mesh=mesh,
                                 dp_mesh_dims=shardkit.DataParallelMeshDims(shard="tp", replicate="dp_replicate"))


def moe(fully_shard, rank=3):
    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    ep_efsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
    experts_mesh = FSDPMeshInfo(ep_efsdp["efsdp"], shard_mesh_dim=0)
    block = moe_block(ep_efsdp["ep"])
    fully_shard(block, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(None, experts_mesh) if is_expert(p) else None)
    return block


def test_moe_experts_on_their_own_mesh_as_fsdp2():
    with fake_world(4, 3):
        ours = moe(shardkit.fully_shard)
        ours_text = describe(ours)
        with shardkit.trace() as t:
            ours(torch.randn(4, D)).sum().backward()
    with fake_world(4, 3):
        theirs = moe(torch_fully_shard)
        assert ours_text == describe(theirs)
    assert_expected_inline(ours_text, """\
norm.weight (8,) ('dp',) (Shard(dim=0),) local (2,)
norm.bias (8,) ('dp',) (Shard(dim=0),) local (2,)
router.weight (4, 8) ('dp',) (Shard(dim=0),) local (1, 8)
experts.w1 (4, 8, 16) ('efsdp', 'ep') (_StridedShard(dim=0, sf=2), Shard(dim=0)) local (1, 8, 16)
experts.w2 (4, 16, 8) ('efsdp', 'ep') (_StridedShard(dim=0, sf=2), Shard(dim=0)) local (1, 16, 8)
out.weight (8, 8) ('dp',) (Shard(dim=0),) local (2, 8)
out.bias (8,) ('dp',) (Shard(dim=0),) local (2,)""")
    # One group, two meshes: one all-gather and one reduce-scatter on each, in one trace.
    assert [(e.kind, e.group, e.world, e.mesh_dim) for e in t.collectives() if e.kind in ("all_gather", "reduce_scatter")] == [
        ("all_gather", "", 4, "dp"), ("all_gather", "", 2, "efsdp"), ("reduce_scatter", "", 4, "dp"), ("reduce_scatter", "", 2, "efsdp")]
    # Each mesh's gradients averaged over its own ranks (ReduceOp.AVG where the backend has it).
    assert [(e.mesh_dim, e.op, e.divide_by) for e in t.collectives("reduce_scatter")] == [("dp", "avg", 1), ("efsdp", "avg", 1)]


def test_moe_with_shardkits_own_placement_result_and_a_device_mesh():
    with fake_world(4, 1):
        dp = init_device_mesh("cpu", (4,))
        ep_efsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
        block = moe_block(ep_efsdp["ep"])
        shardkit.fully_shard(block, mesh=dp, shard_placement_fn=lambda p: shardkit.ShardPlacementResult(torch.distributed.tensor.Shard(1), ep_efsdp["efsdp"]) if is_expert(p) else None)
        assert block.experts.w1.to_local().shape == (2, 4, 16)
        assert len(block._shardkit().group.parts) == 2


def test_share_comm_ctx_checks_its_modules():
    with fake_world(2, 0) as mesh:
        a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        shardkit.fully_shard(a, mesh=mesh)
        with pytest.raises(ValueError, match="share_comm_ctx expects a list of modules fully_shard was applied to, got Linear"):
            shardkit.share_comm_ctx([a, b])
        shardkit.fully_shard(b, mesh=mesh)
        shardkit.share_comm_ctx([a, b])
        a(torch.randn(2, 4)).sum().backward()
        b(torch.randn(2, 4)).sum().backward()
        assert a._shardkit().group.parts[0].plan.comm.streams is b._shardkit().group.parts[0].plan.comm.streams
        # torch code tells roots apart by their context (2.15's pipelining): shared here, not elsewhere
        c = torch.nn.Linear(4, 4)
        shardkit.fully_shard(c, mesh=mesh)
        ctx = lambda m: m._get_fsdp_state()._comm_ctx  # noqa: E731
        assert ctx(a) is ctx(b) and ctx(c) is not ctx(a)
