"""shardkit.optim.Muon on 4 gloo ranks: 2-D meshes, an empty shard, and experts.

Every check injects the gradients (test_muon.py's ``train_injected``) and asserts fp32
parameters ``torch.equal`` to torch.optim.Muon in one process: on HSDP 2x2, where the
owners must be spread over all four ranks (each matrix orthogonalized once, not once per
replica), on FSDP x TP 2x2 (``_StridedShard`` pieces), on a 3x3 weight that one rank holds
no row of, and on expert weights (E, M, N), which torch.optim.Muon steps as E separate
(M, N) matrices: sharded on E they need no communication at all.
"""

from typing import Callable, TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD
from test_muon import (
    LR, STEPS, EveryRankMuon, Muon, assert_bit_identical, assert_every_rank_buckets, assert_two_all_to_alls_per_bucket_per_step, built, mlp, shard_layers,
    train_injected,
)

T = TypeVar("T")
GLOO_WORLD = 4
checks = Checks()


def mesh_2x2(names: tuple[str, str]) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=names)


def counting_orthogonalize(opt: Muon) -> list[int]:
    """Count this rank's ``orthogonalize`` calls (one per full matrix it owns, per step)."""
    calls, inner = [0], opt.orthogonalize

    def counted(matrix, opt_group):
        calls[0] += 1
        return inner(matrix, opt_group)

    opt.orthogonalize = counted
    return calls


@checks()
def hsdp_2x2_is_bit_identical_and_orthogonalizes_each_matrix_once(mesh, impl):
    hsdp = mesh_2x2(("replicate", "shard"))
    model, ref = built(lambda: mlp(16, 24, 20, 12, 8, 6), shard_layers(impl, hsdp))  # 5 matrices
    assert {p.placements for p in model.parameters()} == {(Replicate(), Shard(0))}
    opt, ref_opt = Muon(model.parameters(), lr=LR), torch.optim.Muon(ref.parameters(), lr=LR)
    calls = counting_orthogonalize(opt)
    t = train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    per_rank = [torch.zeros(1, dtype=torch.int64) for _ in range(4)]
    dist.all_gather(per_rank, torch.tensor([calls[0]]), group=mesh.get_group())
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))
    per_rank = [int(c) for c in per_rank]
    # 5 matrices x 5 steps in all (none computed by both replicas), and every rank owns some
    assert sum(per_rank) == 5 * STEPS and min(per_rank) > 0, per_rank
    assert_two_all_to_alls_per_bucket_per_step(t, buckets=1)
    assert {e.world for e in t.collectives("all_to_all")} == {4}


@checks()
def fsdp_with_tensor_parallel_2x2_is_bit_identical(mesh, impl):
    mesh2d = mesh_2x2(("dp", "tp"))

    def shard(model):
        parallelize_module(model, mesh2d["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        shard_layers(impl, mesh2d["dp"])(model)

    model, ref = built(lambda: mlp(16, 12, 16, 6), shard)
    colwise, rowwise, dp_only = (p.placements for p in model.parameters())
    # (12, 16) split on rows by tp, then by dp within each tp shard; (16, 12) columns by tp, rows by dp
    assert isinstance(colwise[0], _StridedShard) and colwise[1] == Shard(0), colwise
    assert rowwise == (Shard(0), Shard(1)) and dp_only == (Shard(0),), (rowwise, dp_only)
    opt, ref_opt = Muon(model.parameters(), lr=LR), torch.optim.Muon(ref.parameters(), lr=LR)
    t = train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))
    # one bucket on the (dp, tp) mesh, and one on dp for the last weight (each tp rank's dp pair)
    assert_two_all_to_alls_per_bucket_per_step(t, buckets=2)


@checks("shardkit")
def on_every_rank_hsdp_and_tensor_parallel_2x2_are_bit_identical_with_one_all_to_all(mesh, impl):
    """The small buckets on every rank: under HSDP each rank gets the pieces of its own replica
    (the replicas hold the same rows), under FSDP x TP the strided and column pieces of all."""
    hsdp, dp_tp = mesh_2x2(("replicate", "shard")), mesh_2x2(("dp", "tp"))

    def tensor_parallel(model):
        parallelize_module(model, dp_tp["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        shard_layers(impl, dp_tp["dp"])(model)

    for make, shard, buckets in ((lambda: mlp(16, 24, 20, 12, 8, 6), shard_layers(impl, hsdp), 1), (lambda: mlp(16, 12, 16, 6), tensor_parallel, 2)):
        model, ref = built(make, shard)
        opt, ref_opt = EveryRankMuon(model.parameters(), lr=LR), torch.optim.Muon(ref.parameters(), lr=LR)
        calls = counting_orthogonalize(opt)
        t = train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
        assert_bit_identical(list(model.parameters()), list(ref.parameters()))
        assert calls[0] == len(list(model.parameters())) * STEPS, calls  # every rank: every matrix
        assert_every_rank_buckets(t, ["in"] * buckets)


@checks()
def a_3x3_weight_that_one_rank_holds_no_row_of_is_bit_identical(mesh, impl):
    model, ref = built(lambda: mlp(5, 3, 3), shard_layers(impl, mesh))  # (3, 5) and (3, 3): rows 1, 1, 1, 0
    opt, ref_opt = Muon(model.parameters(), lr=LR), torch.optim.Muon(ref.parameters(), lr=LR)
    t = train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))
    assert_two_all_to_alls_per_bucket_per_step(t, buckets=1)
    rows = [p.to_local().shape[0] for p in model.parameters()]  # after the last collective
    assert rows == [[1, 1, 1, 0][mesh.get_local_rank()]] * 2, rows


class Experts(nn.Module):
    """Two expert weights (E, M, N): a wide (m, n) and a tall (n, m) matrix per expert, so
    that their learning rates adjust differently (sqrt(max(1, M / N)))."""

    def __init__(self, experts: int, m: int = 6, n: int = 10) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, m, n) / 3)
        self.down = nn.Parameter(torch.randn(experts, n, m) / 3)


def per_expert(ref: nn.Module) -> list[nn.Parameter]:
    """The reference's experts as (M, N) parameters of their own, in order: what torch.optim.Muon steps."""
    return [nn.Parameter(w.detach()[e].clone()) for w in ref.parameters() for e in range(w.shape[0])]


def train_experts_against_torch_muon(model: nn.Module, ref: nn.Module):
    """Muon on ``model``'s (E, M, N) weights against torch.optim.Muon on each (M, N) expert;
    bit-identical, returns the trace."""
    experts = per_expert(ref)
    opt, ref_opt = Muon(model.parameters(), lr=LR), torch.optim.Muon(experts, lr=LR)
    t = train_injected(list(model.parameters()), opt, experts, ref_opt, per_matrix=True)
    assert_bit_identical(list(model.parameters()), experts, per_matrix=True)
    return t


@checks()
def experts_sharded_on_e_only_are_bit_identical_without_communication(mesh, impl):
    model, ref = built(lambda: Experts(8), lambda m: FULLY_SHARD[impl](m, mesh=mesh))  # 2 experts per rank
    assert {p.placements for p in model.parameters()} == {(Shard(0),)}
    t = train_experts_against_torch_muon(model, ref)
    assert not t.collectives("all_to_all"), t.format(("all_to_all",))


def raising_together(mesh: DeviceMesh, fn: Callable[[], T]) -> T:
    """``fn()`` (which must issue no collective) on every rank; if it raises on some rank,
    every rank raises, instead of the others waiting for it in their next collective."""
    error = None
    try:
        result = fn()
    except Exception as e:  # re-raised below, once every rank knows
        error = e
    failed = torch.tensor([0 if error is None else 1 << mesh.get_local_rank()])
    dist.all_reduce(failed, group=mesh.get_group())
    if error is not None:
        raise error
    if failed.item():
        raise AssertionError(f"ranks {[r for r in range(mesh.size()) if failed.item() >> r & 1]} raised")
    return result


@checks("shardkit")
def experts_sharded_on_e_with_a_rank_holding_none_are_bit_identical(mesh, impl):
    model, ref = built(lambda: Experts(6), lambda m: FULLY_SHARD[impl](m, mesh=mesh))  # 2, 2, 2, 0 experts
    experts = per_expert(ref)
    opt, ref_opt = Muon(model.parameters(), lr=LR), torch.optim.Muon(experts, lr=LR)
    t = raising_together(mesh, lambda: train_injected(list(model.parameters()), opt, experts, ref_opt, per_matrix=True))
    assert_bit_identical(list(model.parameters()), experts, per_matrix=True)
    assert not t.collectives("all_to_all"), t.format(("all_to_all",))


@checks()
def experts_sharded_on_m_are_bit_identical_to_torch_muon_per_expert(mesh, impl):
    shard = lambda m: FULLY_SHARD[impl](m, mesh=mesh, shard_placement_fn=lambda p: Shard(1))
    # shardkit: M = 6 rows split 2, 2, 2, 0 and M = 10 rows 3, 3, 3, 1; FSDP2 refuses uneven
    # shards on dim 1, so its (validating) run gets M = 8 and 12
    m, n = (6, 10) if impl == "shardkit" else (8, 12)
    model, ref = built(lambda: Experts(3, m, n), shard)
    assert {p.placements for p in model.parameters()} == {(Shard(1),)}
    t = train_experts_against_torch_muon(model, ref)
    assert_two_all_to_alls_per_bucket_per_step(t, buckets=1)


# Case -> the bug it shows (strict: once fixed, the item fails until its entry goes).
@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_muon_on_four_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
