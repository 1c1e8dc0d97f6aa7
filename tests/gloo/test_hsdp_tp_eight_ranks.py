"""HSDP x tensor parallel on 8 gloo ranks: a (dp_replicate 2, dp_shard 2, tp 2) mesh, the way
torchtitan builds it (``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard(block,
mesh=mesh["dp_replicate", "dp_shard"])``), and FSDP2's replicate-only mode.

- a Llama with sequence parallel (``SequenceParallel`` norms, Colwise/Rowwise blocks): 3 AdamW
  steps within float tolerance of the unsharded model on the whole batch, and bit for bit
  FSDP2's, in fp32 and with a bf16 / fp32 policy;
- ``SHARDKIT_CHECK``'s check mode: the ranks agree on every collective of a step; the trace
  names each collective's mesh dim;
- ``shardkit.clip_grad_norm_`` equal to torch's clip on the unsharded model;
- ``shardkit.optim.Muon`` bit-identical to torch.optim.Muon in one process, each matrix
  orthogonalized once (not once per replica);
- a DCP checkpoint saved on HSDP x TP, resumed on 1-D FSDP over the same ranks and on 4 of them
  (FSDP 2 x TP 2);
- ``save_pretrained`` from HSDP x TP: the files hold the unsharded model's state dict, each key
  once; ``load_pretrained`` of the folder into a poisoned HSDP x TP model gives every rank its
  own piece with no collective;
- ``DataParallelMeshDims(replicate="dp")``: FSDP2's bits and the unsharded model's numbers;
- compiled mode under ``torch.compile``: eager shardkit's bits.

One spawn of 8 ranks runs them all (one process per rank; the model is tiny).
"""

import copy
import math
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

import pytest
import shardkit
from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, OPTIM, TOL, assert_close, full
from shardkit.models.llama import Llama, LlamaConfig, sequence_parallel_plans, tp_plan

GLOO_WORLD = 8
STEPS = 3
checks = Checks()
CONFIG = LlamaConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, hidden=24)


def mesh_3d() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def hsdp_tp_llama(impl: str, mesh: DeviceMesh, sequence_parallel: bool = True, config: LlamaConfig = CONFIG, **kwargs) -> nn.Module:
    """torchtitan's order: tensor parallel on mesh["tp"], then fully_shard per block and the root.
    Without ``sequence_parallel``: Colwise/Rowwise blocks only (the embedding, norms and head
    plain parameters on the HSDP mesh)."""
    torch.manual_seed(0)
    model = Llama(config)
    root_plan, block_plan = sequence_parallel_plans() if sequence_parallel else ({}, tp_plan())
    parallelize_module(model, mesh["tp"], root_plan)
    dp = mesh["dp_replicate", "dp_shard"]
    for block in model.layers:
        parallelize_module(block, mesh["tp"], block_plan)
        FULLY_SHARD[impl](block, mesh=dp, **kwargs)
    FULLY_SHARD[impl](model, mesh=dp, **kwargs)
    return model


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Whole batches of 4 sequences of 8 tokens (inputs, targets): one sequence per dp rank."""
    g = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, CONFIG.vocab_size, (4, 9), generator=g) for _ in range(n)]
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def dp_index(mesh: DeviceMesh) -> int:
    """This rank's sequence: the tp ranks of one (dp_replicate, dp_shard) pair share it."""
    return mesh.get_local_rank("dp_replicate") * mesh.size(1) + mesh.get_local_rank("dp_shard")


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def assert_equal_locals(a: nn.Module, b: nn.Module, what: str) -> None:
    """Every parameter's (and gradient's) local shard ``torch.equal`` between two sharded models."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert p.placements == q.placements, f"{what} {name}: {p.placements} != {q.placements}"
        assert torch.equal(p.to_local(), q.to_local()), f"{what} {name}: {(p.to_local() - q.to_local()).abs().max()}"
        if p.grad is not None or q.grad is not None:
            assert torch.equal(p.grad.to_local(), q.grad.to_local()), f"{what} gradient {name}"


@checks("shardkit")
def llama_trains_as_the_unsharded_model_and_as_fsdp2(mesh, impl):
    """fp32 with sequence parallel: the unsharded model's numbers and FSDP2's bits. bf16 / fp32
    without it: FSDP2's bits (with it, FSDP2 sums the norms' Partial gradients over tp in bf16
    and shardkit in reduce_dtype: tests/gloo/test_reduce_dtype_numerics.py)."""
    mesh3 = mesh_3d()
    bf16 = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = {
        "fp32 sequence parallel": (True, {}, {}),
        "bf16 policy": (False, dict(mp_policy=shardkit.MixedPrecisionPolicy(**bf16)), dict(mp_policy=torch.distributed.fsdp.MixedPrecisionPolicy(**bf16))),
    }
    for run, (sequence_parallel, our_kwargs, their_kwargs) in runs.items():
        ours = hsdp_tp_llama("shardkit", mesh3, sequence_parallel, **our_kwargs)
        theirs = hsdp_tp_llama("torch", mesh3, sequence_parallel, **their_kwargs)
        torch.manual_seed(0)
        ref = Llama(CONFIG)
        w = ours.layers[0].attention.wq.weight
        assert w.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp")
        assert w.placements == (Replicate(), _StridedShard(0, split_factor=2), Shard(0)), w.placements
        assert ours.layers[0].attention.wo.weight.placements == (Replicate(), Shard(0), Shard(1))
        norm = (Replicate(), Shard(0), Replicate()) if sequence_parallel else (Replicate(), Shard(0))
        assert ours.layers[0].ffn_norm.weight.placements == norm
        opts = [torch.optim.AdamW(m.parameters(), **OPTIM) for m in (ours, theirs, ref)]
        for step, (x, y) in enumerate(batches(STEPS)):
            i = dp_index(mesh3)
            with shardkit.trace() as t:
                loss = loss_of(ours, x[i : i + 1], y[i : i + 1])
                loss.backward()
            loss_of(theirs, x[i : i + 1], y[i : i + 1]).backward()
            ref_loss = loss_of(ref, x, y)
            ref_loss.backward()
            assert_equal_locals(ours, theirs, f"{run} step {step}: FSDP2's")
            if not our_kwargs:
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                assert_close(mean / 8, ref_loss.detach(), f"loss at step {step}")
                for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
                    assert_close(full(p.grad), q.grad, f"gradient {name} at step {step}")
            # per block: all-gathers over dp_shard, then its reduce-scatter over dp_shard and all-reduce over dp_replicate
            kinds = [(e.kind, e.world, e.mesh_dim, str(e.dtype).removeprefix("torch.")) for e in t.collectives() if e.group == "layers.0"]
            dtype = "bfloat16" if our_kwargs else "float32"
            assert kinds == [("all_gather", 2, "dp_shard", dtype)] * 2 + [("reduce_scatter", 2, "dp_shard", "float32"), ("all_reduce", 2, "dp_replicate", "float32")], kinds
            for opt in opts:
                opt.step()
                opt.zero_grad()
        assert_equal_locals(ours, theirs, f"{run}: FSDP2's parameters")
        if not our_kwargs:
            for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
                torch.testing.assert_close(full(p.detach()), q.detach(), atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@checks("shardkit", sim=False)
def compiled_mode_under_torch_compile_gives_eager_shardkits_bits(mesh, impl):
    """Compiled mode on the same mesh, compiled whole (aot_eager, fullgraph): eager shardkit's
    losses and parameters bit for bit over 2 AdamW steps."""
    import shardkit.compiled

    torch._dynamo.reset()
    mesh3 = mesh_3d()
    one_block = LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, hidden=24)  # (each rank compiles)
    eager = hsdp_tp_llama("shardkit", mesh3, sequence_parallel=False, config=one_block)
    torch.manual_seed(0)
    model = Llama(one_block)
    dp = mesh3["dp_replicate", "dp_shard"]
    for block in model.layers:
        parallelize_module(block, mesh3["tp"], tp_plan())
        shardkit.compiled.fully_shard(block, mesh=dp)
    shardkit.compiled.fully_shard(model, mesh=dp)
    run = torch.compile(model, backend="aot_eager", fullgraph=True)
    opts = [torch.optim.AdamW(m.parameters(), **OPTIM) for m in (eager, model)]
    i = dp_index(mesh3)
    for step, (x, y) in enumerate(batches(2)):
        losses = [loss_of(m, x[i : i + 1], y[i : i + 1]) for m in (eager, run)]
        for loss in losses:
            loss.backward()
        assert torch.equal(*losses), (step, losses)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert_equal_locals(model, eager, "compiled mode against eager")


@checks("shardkit")
def check_mode_agrees_on_every_collective_and_the_trace_names_each_mesh_dim(mesh, impl):
    from shardkit.comm import check

    mesh3 = mesh_3d()
    model = hsdp_tp_llama("shardkit", mesh3)
    (x, y), = batches(1)
    i = dp_index(mesh3)
    check.check_collectives(True)
    try:
        with shardkit.trace() as t:
            loss_of(model, x[i : i + 1], y[i : i + 1]).backward()
    finally:
        check.check_collectives(False)
    dims = {(e.kind, e.mesh_dim, e.world) for e in t.collectives()}
    assert dims == {("all_gather", "dp_shard", 2), ("reduce_scatter", "dp_shard", 2), ("all_reduce", "dp_replicate", 2)}, t.format()


@checks("shardkit")
def clip_grad_norm_counts_each_replica_once(mesh, impl):
    mesh3 = mesh_3d()
    model = hsdp_tp_llama("shardkit", mesh3)
    torch.manual_seed(0)
    ref = Llama(CONFIG)
    (x, y), = batches(1)
    i = dp_index(mesh3)
    loss_of(model, x[i : i + 1], y[i : i + 1]).backward()
    loss_of(ref, x, y).backward()
    for norm_type in (2.0, math.inf):
        expected = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()], norm_type)
        with shardkit.trace() as t:
            norm = shardkit.grad_norm(model.parameters(), norm_type)
        assert_close(norm, expected, f"norm of order {norm_type}")
        # one all-reduce over dp_shard and tp, none over the replicas
        # (the norms, replicated over tp, over dp_shard alone)
        assert sorted((e.world, e.mesh_dim) for e in t.collectives("all_reduce")) == [(2, "dp_shard"), (4, "dp_shard*tp")], t.format(("all_reduce",))
    max_norm = expected.item() / 2
    shardkit.clip_grad_norm_(model.parameters(), max_norm, 2.0)
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, 2.0)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(full(p.grad), q.grad, f"clipped gradient {name}")


@checks("shardkit")
def muon_is_bit_identical_to_one_process_and_orthogonalizes_each_matrix_once(mesh, impl):
    """With owners, each matrix once in the 8 ranks; as it comes (these small matrices on
    every rank, gloo), each rank computes all 4 (its replica's pieces and every tp piece)."""
    from test_muon import LR, STEPS, EveryRankMuon, Muon, assert_bit_identical, built, mlp, train_injected

    mesh3 = mesh_3d()

    def shard(model):
        parallelize_module(model, mesh3["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": ColwiseParallel(), "3": RowwiseParallel()})
        for layer in model:
            shardkit.fully_shard(layer, mesh=mesh3["dp_replicate", "dp_shard"])

    for muon, per_step in ((Muon, 4), (EveryRankMuon, 4 * dist.get_world_size())):
        model, ref = built(lambda: mlp(16, 12, 16, 10, 6), shard)
        assert {len(p.placements) for p in model.parameters()} == {3}
        opt, ref_opt = muon(model.parameters(), lr=LR), torch.optim.Muon(ref.parameters(), lr=LR)
        calls, inner = [0], opt.orthogonalize

        def counted(matrix, opt_group):
            calls[0] += 1
            return inner(matrix, opt_group)

        opt.orthogonalize = counted
        train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
        assert_bit_identical(list(model.parameters()), list(ref.parameters()))
        total = torch.tensor([calls[0]])
        dist.all_reduce(total)
        assert int(total) == per_step * STEPS, (muon.__name__, int(total))  # 4 matrices a step


def shared_dir() -> str:
    """One temporary folder for every rank (rank 0 makes it), removed by the caller."""
    name = [tempfile.mkdtemp(prefix="shardkit-hsdp-tp-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return name[0]


@checks("shardkit")
def a_dcp_checkpoint_of_hsdp_tp_resumes_on_1d_fsdp_and_on_four_ranks(mesh, impl):
    mesh3 = mesh_3d()
    model = hsdp_tp_llama("shardkit", mesh3)
    opt = torch.optim.AdamW(model.parameters(), **OPTIM)
    (x, y), = batches(1)
    i = dp_index(mesh3)
    loss_of(model, x[i : i + 1], y[i : i + 1]).backward()
    opt.step()
    expected = {k: full(v) for k, v in model.state_dict().items()}
    folder = shared_dir()
    try:
        dcp.save(model.state_dict(), checkpoint_id=folder)
        # 1-D FSDP over the same 8 ranks, no tensor parallel
        torch.manual_seed(5)
        flat = Llama(CONFIG)
        for block in flat.layers:
            shardkit.fully_shard(block, mesh=mesh)
        shardkit.fully_shard(flat, mesh=mesh)
        state = flat.state_dict()
        dcp.load(state, checkpoint_id=folder)
        flat.load_state_dict(state)
        for k, v in flat.state_dict().items():
            assert v.placements == (Shard(0),), (k, v.placements)
            assert torch.equal(full(v), expected[k]), k
        # 4 ranks of the 8: FSDP 2 x TP 2 on ranks 0..3, a process group of their own
        group = dist.new_group([0, 1, 2, 3])
        mesh2 = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))  # (made by every rank)
        if dist.get_rank() < 4:
            torch.manual_seed(6)
            small = Llama(CONFIG)
            root_plan, block_plan = sequence_parallel_plans()
            parallelize_module(small, mesh2["tp"], root_plan)
            for block in small.layers:
                parallelize_module(block, mesh2["tp"], block_plan)
                shardkit.fully_shard(block, mesh=mesh2["dp"])
            shardkit.fully_shard(small, mesh=mesh2["dp"])
            state = small.state_dict()
            dcp.load(state, checkpoint_id=folder, process_group=group)
            small.load_state_dict(state)
            for k, v in small.state_dict().items():
                assert torch.equal(v.full_tensor(), expected[k]), k
        dist.barrier()
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(folder, ignore_errors=True)


@checks("shardkit")
def save_pretrained_from_hsdp_tp_loads_back_each_rank_its_piece(mesh, impl):
    from test_pretrained_four_ranks import local_pieces_problems, on_all_ranks, save_round_trip

    mesh3 = mesh_3d()
    torch.manual_seed(0)
    ref = Llama(CONFIG)
    model, fresh = hsdp_tp_llama("shardkit", mesh3), hsdp_tp_llama("shardkit", mesh3)
    assert isinstance(model.layers[0].attention.wq.weight.placements[1], _StridedShard)
    save_round_trip(mesh, model, fresh, ref, [mesh3])  # fresh is poisoned before its load
    problems = on_all_ranks(mesh, local_pieces_problems(fresh, ref.state_dict()))
    assert not problems, "\n".join(problems)


@checks("shardkit")
def replicate_only_mode_trains_as_fsdp2_and_the_unsharded_model(mesh, impl):
    from moe_spmd_models import D, SpmdStack

    # 2 replicas: FSDP2's bits (over more, gloo's ring sums each element in an order that
    # depends on the buffer's length, which shardkit's grad-presence column changes)
    full_mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
    models = {}
    for name, dims in (("shardkit", shardkit.DataParallelMeshDims), ("torch", torch.distributed.fsdp.DataParallelMeshDims)):
        model = SpmdStack(full_mesh, n_dp=1)
        for block in model.blocks:
            FULLY_SHARD[name](block, mesh=full_mesh, dp_mesh_dims=dims(replicate="dp"))
        FULLY_SHARD[name](model, mesh=full_mesh, dp_mesh_dims=dims(replicate="dp"))
        models[name] = model
    ours, theirs, ref = models["shardkit"], models["torch"], SpmdStack()
    assert ours.blocks[0].w1.placements == (Replicate(), Shard(0))
    opts = [torch.optim.SGD(m.parameters(), lr=0.2) for m in (ours, theirs, ref)]
    g = torch.Generator().manual_seed(5)
    for step in range(STEPS):
        data = [(torch.randn(2, D, generator=g), torch.randn(2, D, generator=g)) for _ in range(2)]
        x, t = data[full_mesh.get_local_rank("dp")]
        with shardkit.trace() as tr:
            F.mse_loss(ours(x), t).backward()
        F.mse_loss(theirs(x), t).backward()
        (sum(F.mse_loss(ref(x), t) for x, t in data) / 2).backward()
        assert_equal_locals(ours, theirs, f"step {step}: FSDP2's")
        # no sharding: each block's gradients all-reduced over the replicas, nothing over tp
        assert {(e.kind, e.world, e.mesh_dim) for e in tr.collectives() if e.world > 1} == {("all_reduce", 2, "dp")}, tr.format()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert isinstance(p, DTensor) and p.placements[0] == Replicate()
        torch.testing.assert_close(p.full_tensor(), q.detach(), **TOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_on_eight_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
