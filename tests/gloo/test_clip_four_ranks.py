"""``shardkit.clip_grad_norm_`` on 4 gloo ranks against ``torch.nn.utils.clip_grad_norm_`` on
the unsharded model, with shardkit's parameters and with FSDP2's: the same total norm, the
same clipped gradients, and the same parameters after the steps. Three steps per check, one
per norm type (2, 1, inf), each clipping to half the reference's norm, with SGD (AdamW would
undo most of a global scaling):

- an MoE block: experts over (efsdp 2, ep 2) by ``ShardPlacementResult``, dense layers over
  dp 4; torch's clip raises there (pytorch#180346);
- HSDP 2x2: each replica's gradients counted once;
- FSDP x TP 2x2: (dp, tp) DTensors with ``_StridedShard``, 1-D dp norms beside them;
- plain parameters (synchronized by hand, as DDP would) beside sharded blocks.

Each check also pins the all-reduces ``clip_grad_norm_`` issued (world, mesh dims).
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor

import shardkit
from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, TOL, Parity, Stack, assert_close, full, local, stack_batches
from moe_spmd_models import D, is_expert, moe_block

GLOO_WORLD = 4
NORM_TYPES = (2.0, 1.0, math.inf)  # one per step
LR = 0.5
checks = Checks()


def clip_both(model, ref, norm_type: float) -> list[tuple[int, str]]:
    """Clip the sharded model with shardkit and the reference with torch, to half the
    reference's norm; the norms must agree. Returns the all-reduces issued (world, dims)."""
    expected = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters() if q.grad is not None], norm_type)
    max_norm = expected.item() / 2
    with shardkit.trace() as t:
        norm = shardkit.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    assert type(norm) is torch.Tensor and norm.shape == (), type(norm)
    assert_close(norm, expected, f"norm of order {norm_type}")
    assert_close(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type), expected, "torch's norm")
    assert_close(shardkit.grad_norm(model.parameters(), norm_type), torch.tensor(max_norm), "the norm after clipping")
    return [(e.world, e.mesh_dim) for e in t.collectives("all_reduce")]


def assert_grads_match(model, ref) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(full(p.grad), q.grad, f"clipped gradient {name}")


def assert_params_match(model, ref) -> None:
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full(p.detach()), q.detach(), atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def sgd_step(*optimizers) -> None:
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


@checks()
def moe_experts_on_their_own_mesh_clip_as_the_reference(mesh, impl):
    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    ep_efsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "efsdp"))
    experts_mesh = FSDPMeshInfo(ep_efsdp["efsdp"], shard_mesh_dim=0)
    block, ref = moe_block(ep_efsdp["ep"]), moe_block()
    FULLY_SHARD[impl](block, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(None, experts_mesh) if is_expert(p) else None)
    if impl == "shardkit":  # the gradients as the reference's (tests/gloo/test_moe_and_spmd.py says why)
        block.set_gradient_divide_factor(4.0)
    opt, ref_opt = torch.optim.SGD(block.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    g = torch.Generator().manual_seed(3)
    for norm_type in NORM_TYPES:
        data = [(torch.randn(6, D, generator=g), torch.randn(6, D, generator=g)) for _ in range(GLOO_WORLD)]
        x, t = data[dist.get_rank()]
        F.mse_loss(block(x), t).backward()
        if impl == "torch":  # FSDP2 divides the experts' gradients by 2 only (no PREMUL_SUM on gloo)
            for p in (block.experts.w1, block.experts.w2):
                p.grad.mul_(0.5)
        (sum(F.mse_loss(ref(x), t) for x, t in data) / len(data)).backward()
        with pytest.raises(Exception) as raised:  # torch's clip, on either implementation's parameters
            torch.nn.utils.clip_grad_norm_(block.parameters(), 1.0, norm_type)
        assert "must have the same mesh" in f"{raised.value} {raised.value.__cause__}", raised.value
        # the experts over (efsdp, ep) and the dense layers over dp are all 4 ranks: one all-reduce
        assert clip_both(block, ref, norm_type) == [(4, "dp+efsdp*ep")]
        assert_grads_match(block, ref)
        sgd_step(opt, ref_opt)
    assert_params_match(block, ref)


def train_stack(p: Parity, expected_all_reduces: list[tuple[int, str]], sync=()) -> None:
    """Three steps of ``p``'s Stack, clipped; ``sync``: plain parameters, averaged by hand."""
    for norm_type, batch in zip(NORM_TYPES, stack_batches(len(NORM_TYPES))):
        p.forward_backward(batch)
        for q in sync:
            dist.all_reduce(q.grad, group=p.mesh.get_group())
            q.grad.div_(p.mesh.size())
        assert clip_both(p.model, p.ref, norm_type) == expected_all_reduces
        p.assert_grads_match()
        p.optimizer_step()
    p.assert_params_match()


@checks()
def hsdp_2x2_counts_each_replica_once(mesh, impl):
    from test_composition import hsdp, mesh_2d

    p = Parity.build(Stack, hsdp(impl, mesh_2d(2, 2)), mesh, impl, optimizer=torch.optim.SGD, lr=LR)
    train_stack(p, [(2, "shard")])  # over the shard dim only; Replicate() is not summed


@checks()
def plain_parameters_beside_sharded_blocks_clip_as_the_reference(mesh, impl):
    def shard_blocks(model):
        for block in model.blocks:
            FULLY_SHARD[impl](block, mesh=mesh)

    p = Parity.build(Stack, shard_blocks, mesh, impl, optimizer=torch.optim.SGD, lr=LR)
    plain = [q for q in p.model.parameters() if not isinstance(q, DTensor)]
    assert len(plain) == 4  # inp and out: counted locally, no collective
    train_stack(p, [(4, "dim0")], sync=plain)


@checks()
def fsdp_with_tensor_parallel_2x2_clips_as_the_reference(mesh, impl):
    import copy

    from torch.distributed.tensor.parallel import parallelize_module

    from shardkit.models.llama import Llama, LlamaConfig, tp_plan

    mesh_2d = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    ref = copy.deepcopy(model)
    for block in model.layers:
        parallelize_module(block, mesh_2d["tp"], tp_plan())
        FULLY_SHARD[impl](block, mesh=mesh_2d["dp"])
    FULLY_SHARD[impl](model, mesh=mesh_2d["dp"])
    assert "_StridedShard" in str(model.layers[0].attention.wq.weight.placements)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    g = torch.Generator().manual_seed(1)
    for norm_type in NORM_TYPES:
        tokens = torch.randint(0, 64, (4, 9), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = [t.chunk(2)[mesh_2d.get_local_rank(0)] for t in (x, y)]  # the tp ranks share a batch
        F.cross_entropy(model(mine[0]).flatten(0, 1), mine[1].flatten()).backward()
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
        # the norms (1-D, over dp) and the (dp, tp) weights (over all 4 ranks)
        assert clip_both(model, ref, norm_type) == [(2, "dp"), (4, "dp*tp")]
        assert_grads_match(model, ref)
        sgd_step(opt, ref_opt)
    assert_params_match(model, ref)


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_clip_on_four_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
