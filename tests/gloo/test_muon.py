"""shardkit.optim.Muon on 2 gloo ranks: bit for bit torch.optim.Muon in one process.

Most checks inject the gradients (``train_injected``): each step the reference parameters
get fresh ``randn`` gradients and each sharded parameter its placement's piece of the same
tensor, so that the two runs differ only in the optimizer, and fp32 parameters must end
``torch.equal``. The GPT check trains for real in bf16 mixed precision (a tolerance), and
the resume check saves after 3 steps three ways and must continue bit-identically.

The matrices here are small, and on gloo shardkit computes a bucket of small matrices on
every rank (``every_rank_below``): ``Muon`` and ``PolarExpress`` below are shardkit's with
that off, so that these checks are of the owners' path; the checks of the every-rank path use
``shardkit.optim.Muon`` as it comes (``EveryRankMuon``).

(4 ranks, HSDP, FSDP x TP and experts: test_muon_four_ranks.py.)
"""

from __future__ import annotations

import copy
import math
import shutil
import tempfile
from collections import Counter
from typing import Callable, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

import shardkit
from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, full, gpt_batches, gpt_loss, local, mean_over_ranks, small_gpt
from shardkit import MixedPrecisionPolicy
from shardkit import optim
from shardkit.optim.polar_express import polar_express

checks = Checks()
STEPS = 5
LR = 0.02


class Muon(optim.Muon):
    every_rank_below = 0.0  # owners, whatever the bucket's size


class PolarExpress(optim.PolarExpress):
    every_rank_below = 0.0


EveryRankMuon = optim.Muon  # as it comes: on gloo, the small buckets here on every rank


# Helpers shared with test_muon_four_ranks.py ----------------------------------------------
def mlp(*sizes: int) -> nn.Sequential:
    """Bias-free linears (Muon takes matrices only): ``mlp(8, 13)`` has one (13, 8) weight."""
    return nn.Sequential(*(nn.Linear(a, b, bias=False) for a, b in zip(sizes, sizes[1:])))


def built(make: Callable[[], nn.Module], shard: Callable[[nn.Module], None], seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """The model sharded by ``shard`` and its unsharded copy, from the same weights."""
    torch.manual_seed(seed)  # the same weights on every rank
    model = make()
    ref = copy.deepcopy(model)
    shard(model)
    return model, ref


def shard_layers(impl: str, mesh, **kwargs) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        for layer in model:
            FULLY_SHARD[impl](layer, mesh=mesh, **kwargs)
    return shard


def piece_of(full_tensor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``full_tensor`` placed like ``p``: each rank cuts its own piece (every rank holds the
    same values, so ``src_data_rank=None`` needs no communication)."""
    if isinstance(p, DTensor):
        return distribute_tensor(full_tensor, p.device_mesh, p.placements, src_data_rank=None)
    return full_tensor.clone()


def train_injected(
    params: Sequence[torch.Tensor], opt, ref_params: Sequence[torch.Tensor] = (), ref_opt=None,
    steps: range = range(STEPS), per_matrix: bool = False,
) -> shardkit.Trace:
    """``opt`` on ``params`` and ``ref_opt`` (if any) on ``ref_params``, the same gradients
    each step (step ``s`` draws from seed 100 + s, so a resumed run sees the uninterrupted
    run's). ``per_matrix``: the reference holds each expert of an (E, M, N) parameter as a
    parameter of its own, in order. Returns the trace of ``opt``'s steps."""
    with shardkit.trace() as t:
        for s in steps:
            g = torch.Generator().manual_seed(100 + s)
            grads = [torch.randn(p.shape, generator=g) for p in params]
            for p, grad in zip(params, grads):
                p.grad = piece_of(grad, p)
            ref_grads = [e for grad in grads for e in (grad.unbind(0) if per_matrix and grad.ndim == 3 else [grad])]
            opt.step()
            if ref_opt is not None:
                assert len(ref_grads) == len(ref_params), (len(ref_grads), len(ref_params))
                for q, grad in zip(ref_params, ref_grads):
                    q.grad = grad.clone()
                ref_opt.step()
    return t


def assert_bit_identical(params: Sequence[torch.Tensor], ref_params: Sequence[torch.Tensor], per_matrix: bool = False) -> None:
    """Every full parameter ``torch.equal`` to the reference's (``per_matrix``: an (E, M, N)
    parameter to its E reference matrices stacked)."""
    fulls = [full(p.detach()) for p in params]  # the collectives first, on every rank
    refs = iter(ref_params)
    for k, actual in enumerate(fulls):
        if per_matrix and actual.ndim == 3:
            expected = torch.stack([next(refs).detach() for _ in range(actual.shape[0])])
        else:
            expected = next(refs).detach()
        assert actual.shape == expected.shape, f"parameter {k}: shape {list(actual.shape)} != {list(expected.shape)}"
        diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
        assert torch.equal(actual, expected), f"parameter {k} {list(actual.shape)}: largest difference {diff:.3g}"
    assert next(refs, None) is None, "the reference has more parameters"


def all_to_alls(t: shardkit.Trace) -> list[tuple[str, str]]:
    """(bucket, way) of each all-to-all in ``t``: their names are "<optimizer> <bucket> in"
    and "... out"."""
    return [tuple(e.group.rsplit(" ", 1)) for e in t.collectives("all_to_all")]


def assert_two_all_to_alls_per_bucket_per_step(t: shardkit.Trace, buckets: int, steps: int = STEPS, name: str = "Muon") -> None:
    """Each of ``buckets`` buckets sent one all-to-all in and one out per step, and nothing else."""
    issued = all_to_alls(t)
    names = sorted({bucket for bucket, _ in issued})
    expected = Counter({(bucket, way): steps for bucket in names for way in ("in", "out")})
    assert len(names) == buckets and Counter(issued) == expected and all(n.startswith(name) for n in names), (
        f"expected {buckets} buckets x 2 ways x {steps} steps of {name}, got:\n" + t.format(("all_to_all",))
    )


def assert_momentum_placed_like_params(params: Sequence[torch.Tensor], opt) -> None:
    for k, p in enumerate(params):
        assert "momentum_buffer" in opt.state[p], f"parameter {k} has no momentum_buffer"
        buf = opt.state[p]["momentum_buffer"]
        assert isinstance(buf, DTensor), f"parameter {k}: its momentum_buffer is a {type(buf).__name__}, not a DTensor"
        assert (buf.device_mesh, buf.placements, buf.shape) == (p.device_mesh, p.placements, p.shape), (
            f"parameter {k}: momentum_buffer {buf.placements} {list(buf.shape)}, parameter {p.placements} {list(p.shape)}"
        )


# Injected gradients ------------------------------------------------------------------------
# 13 rows split 7 + 6, 5 rows 3 + 2, and one row that rank 1 holds none of.
UNEVEN = (8, 13, 5, 1)


@checks()
def uneven_row_shards_are_bit_identical_to_torch_muon_with_one_bucket(mesh, impl):
    model, ref = built(lambda: mlp(*UNEVEN), shard_layers(impl, mesh))
    opt, ref_opt = Muon(model.parameters(), lr=LR), torch.optim.Muon(ref.parameters(), lr=LR)
    t = train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))
    assert_momentum_placed_like_params(list(model.parameters()), opt)
    assert_two_all_to_alls_per_bucket_per_step(t, buckets=1)  # every matrix on one mesh in fp32: one bucket
    assert {e.world for e in t.collectives("all_to_all")} == {2}


@checks()
def two_buckets_issue_two_all_to_alls_each_per_step_and_stay_bit_identical(mesh, impl):
    model, ref = built(lambda: mlp(*UNEVEN), shard_layers(impl, mesh))
    # 500 bytes: the (13, 8) fp32 weight (416 bytes) alone, then (5, 13) and (1, 5) (280 bytes together)
    opt = Muon(model.parameters(), lr=LR, bucket_mb=500 / 2**20)
    ref_opt = torch.optim.Muon(ref.parameters(), lr=LR)
    t = train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))
    assert_two_all_to_alls_per_bucket_per_step(t, buckets=2)
    # both buckets' inputs are sent before the first bucket's results come back (they pipeline)
    assert [way for _, way in all_to_alls(t)] == ["in", "in", "out", "out"] * STEPS, t.format(("all_to_all",))


def assert_every_rank_buckets(t: shardkit.Trace, ways: list[str], steps: int = STEPS) -> None:
    """Per step the all-to-alls' ways in order (an every-rank bucket sends "in" and nothing back)."""
    issued = [way for _, way in all_to_alls(t)]
    assert issued == ways * steps, f"expected {ways} per step, got:\n" + t.format(("all_to_all",))


@checks()
def a_small_bucket_is_orthogonalized_on_every_rank_with_one_all_to_all_and_bit_identical(mesh, impl):
    model, ref = built(lambda: mlp(*UNEVEN), shard_layers(impl, mesh))
    opt, ref_opt = EveryRankMuon(model.parameters(), lr=LR), torch.optim.Muon(ref.parameters(), lr=LR)
    calls, inner = [0], opt.orthogonalize
    opt.orthogonalize = lambda matrix, opt_group: (calls.__setitem__(0, calls[0] + 1), inner(matrix, opt_group))[1]
    t = train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))
    assert_every_rank_buckets(t, ["in"])
    assert calls[0] == 3 * STEPS, calls  # each rank: every matrix, every step
    # each rank sends its pieces to both ranks (itself too): twice its rows of the three weights
    local_numel = sum(p.to_local().numel() for p in model.parameters())
    assert [e.numel for e in t.collectives("all_to_all")] == [2 * local_numel] * STEPS


@checks("shardkit")
def a_large_bucket_keeps_its_owners_beside_a_small_one_on_every_rank(mesh, impl):
    # (64, 64): 3 * 64**3 multiply-adds per iteration, above every_rank_below; then (5, 64), (1, 5)
    model, ref = built(lambda: mlp(64, 64, 5, 1), shard_layers(impl, mesh))
    opt = EveryRankMuon(model.parameters(), lr=LR, bucket_mb=64 * 64 * 4 / 2**20)  # the first weight alone
    ref_opt = torch.optim.Muon(ref.parameters(), lr=LR)
    t = train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))
    assert [bucket.every_rank for bucket in next(iter(opt._owners._plans.values()))] == [False, True]
    assert_every_rank_buckets(t, ["in", "in", "out"])  # bucket 0 in, bucket 1 in (pipelined), bucket 0 out


def settings_per_group(params: list[torch.Tensor]) -> list[dict]:
    return [
        dict(params=[params[0]], lr=0.05, weight_decay=0.0, nesterov=False),
        dict(params=[params[1]], weight_decay=0.3, momentum=0.9, adjust_lr_fn="match_rms_adamw"),
        dict(params=[params[2]], lr=torch.tensor(0.01), adjust_lr_fn="original"),  # a tensor lr, as torch takes
    ]


@checks()
def param_groups_with_their_own_settings_are_bit_identical_to_torch_muon(mesh, impl):
    model, ref = built(lambda: mlp(*UNEVEN), shard_layers(impl, mesh))
    opt = Muon(settings_per_group(list(model.parameters())), lr=LR)
    ref_opt = torch.optim.Muon(settings_per_group(list(ref.parameters())), lr=LR)
    train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))


@checks("shardkit")
def plain_params_beside_sharded_ones_are_bit_identical_to_torch_muon(mesh, impl):
    def shard_first_and_last(model):  # the middle (5, 13) weight stays a plain tensor
        shardkit.fully_shard(model[0], mesh=mesh)
        shardkit.fully_shard(model[2], mesh=mesh)

    model, ref = built(lambda: mlp(*UNEVEN), shard_first_and_last)
    assert [isinstance(p, DTensor) for p in model.parameters()] == [True, False, True]
    opt, ref_opt = Muon(model.parameters(), lr=LR), torch.optim.Muon(ref.parameters(), lr=LR)
    t = train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))
    assert_two_all_to_alls_per_bucket_per_step(t, buckets=1)
    # the plain matrix is computed where it is: the two sharded ones travel, 13*8 + 1*5 elements in all
    sent = torch.tensor([float(sum(e.numel for e in t.collectives("all_to_all")[:1]))])
    dist.all_reduce(sent, group=mesh.get_group())
    assert sent.item() == 13 * 8 + 1 * 5, sent


def adjusted_lr(lr: float, shape: torch.Size) -> float:
    a, b = shape
    return lr * math.sqrt(max(1, a / b))  # adjust_lr_fn=None ("original")


def polar_express_reference_step(params: list[nn.Parameter], buffers: dict, opt_group: dict) -> None:
    """Muon's step with Polar Express, on full tensors in one process (the test's own reference)."""
    lr, momentum = opt_group["lr"], opt_group["momentum"]
    with torch.no_grad():
        for p in params:
            buf = buffers.setdefault(p, torch.zeros_like(p))
            buf.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buf, momentum) if opt_group["nesterov"] else buf
            update = polar_express(update, opt_group["ns_steps"], opt_group["eps"])
            p.mul_(1 - lr * opt_group["weight_decay"])
            p.add_(update, alpha=-adjusted_lr(lr, p.shape))


class PolarExpressReference:
    """The reference as an optimizer ``train_injected`` can step."""

    def __init__(self, params, **settings) -> None:
        self.params, self.buffers = list(params), {}
        self.settings = dict(lr=LR, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5, eps=1e-7) | settings

    def step(self) -> None:
        polar_express_reference_step(self.params, self.buffers, self.settings)


@checks("shardkit")
def polar_express_is_bit_identical_to_a_single_process_reference(mesh, impl):
    model, ref = built(lambda: mlp(*UNEVEN), shard_layers(impl, mesh))
    newton_schulz = copy.deepcopy(ref)  # torch's Muon on the same gradients: Polar Express must differ
    opt = PolarExpress(model.parameters(), lr=LR, weight_decay=0.2, momentum=0.9)
    ref_opt = PolarExpressReference(ref.parameters(), weight_decay=0.2, momentum=0.9)
    train_injected(list(model.parameters()), opt, list(ref.parameters()), ref_opt)
    train_injected(list(newton_schulz.parameters()), torch.optim.Muon(newton_schulz.parameters(), lr=LR, weight_decay=0.2, momentum=0.9))
    assert_bit_identical(list(model.parameters()), list(ref.parameters()))
    assert not torch.equal(ref[0].weight, newton_schulz[0].weight), "Polar Express gave Newton-Schulz's update"


# Training for real: the small GPT in bf16 --------------------------------------------------
MP_TOL = dict(atol=3e-2, rtol=3e-2)  # bf16 rounding (8 bits of mantissa), as test_mixed_precision_numerics
ADAMW = dict(lr=1e-2, eps=1e-5)


def muon_and_adamw(model: nn.Module, muon: type) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Muon for the blocks' 2-D weights, AdamW for the rest (embeddings, norms, biases, head)."""
    hidden = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if not (n.startswith("blocks.") and p.ndim == 2)]
    return muon(hidden, lr=LR), torch.optim.AdamW(rest, **ADAMW)


@checks("shardkit")
def gpt_with_muon_and_adamw_in_bf16_matches_the_unsharded_model(mesh, impl):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def shard(model):
        for block in model.blocks:
            shardkit.fully_shard(block, mesh=mesh, mp_policy=policy)
        shardkit.fully_shard(model, mesh=mesh, mp_policy=policy)

    model, ref = built(small_gpt, shard)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    opts, ref_opts = muon_and_adamw(model, Muon), muon_and_adamw(ref, torch.optim.Muon)
    assert len(opts[0].param_groups[0]["params"]) == 8, "the 2 blocks' qkv, attn.proj, fc and mlp.proj weights"
    with shardkit.trace() as t:
        for i, batch in enumerate(gpt_batches(STEPS)):
            loss = gpt_loss(model, local(batch, mesh))
            loss.backward()
            low = copy.deepcopy(ref).to(torch.bfloat16)  # the reference computes in bf16 too
            ref_loss = gpt_loss(low, batch)
            ref_loss.backward()
            for p, q in zip(ref.parameters(), low.parameters()):
                p.grad = q.grad.float()
            torch.testing.assert_close(mean_over_ranks(loss.float(), mesh), ref_loss.detach().float(), **MP_TOL,
                                       msg=lambda m: f"loss at step {i}: {m}")
            for o in (*opts, *ref_opts):
                o.step()
                o.zero_grad()
    assert_two_all_to_alls_per_bucket_per_step(t, buckets=1)  # the 8 blocks' weights, one bucket
    fulls = {n: full(p.detach()) for n, p in model.named_parameters()}
    for n, q in ref.named_parameters():
        torch.testing.assert_close(fulls[n], q.detach(), **MP_TOL, msg=lambda m: f"param {n}: {m}")
        # bf16 rounding moves the two runs apart far less than training moved either (at most
        # 0.10 of it when written, tok_emb.weight; 0.07 for a Muon weight): MP_TOL alone is loose
        moved, apart = (q.detach() - start[n]).abs().max(), (fulls[n] - q.detach()).abs().max()
        assert apart <= 0.25 * moved, f"param {n}: {apart:.3g} from the reference, moved {moved:.3g} in training"


# Resume -------------------------------------------------------------------------------------
def shared_tmpdir(mesh) -> str:
    holder = [tempfile.mkdtemp(dir="/tmp", prefix="muon-ckpt-") if mesh.get_local_rank() == 0 else None]
    dist.broadcast_object_list(holder, group=mesh.get_group(), group_src=0)
    return holder[0]


@checks("shardkit")
def resume_from_state_dict_dcp_and_shardkit_checkpoint_is_bit_identical(mesh, impl):
    # here, not at the top: test_muon_four_ranks.py imports this module, and needs none of them
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    from shardkit import checkpoint

    def fresh(seed: int):
        model, _ = built(lambda: mlp(*UNEVEN), shard_layers(impl, mesh), seed=seed)
        return model, Muon(model.parameters(), lr=LR, weight_decay=0.2)

    model, opt = fresh(seed=0)
    params = list(model.parameters())
    train_injected(params, opt, steps=range(3))
    path = shared_tmpdir(mesh)
    in_memory = copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict()})
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=f"{path}/dcp")
    checkpoint.save(f"{path}/shardkit", model, opt, step=3)
    train_injected(params, opt, steps=range(3, STEPS))  # the uninterrupted run
    uninterrupted = [full(p.detach()) for p in params]

    def from_memory(m, o):
        m.load_state_dict(in_memory["model"])
        o.load_state_dict(in_memory["optim"])

    def from_dcp(m, o):
        state = {"model": get_model_state_dict(m), "optim": get_optimizer_state_dict(m, o)}
        dcp.load(state, checkpoint_id=f"{path}/dcp")
        set_model_state_dict(m, state["model"])
        set_optimizer_state_dict(m, o, state["optim"])

    def from_shardkit(m, o):
        assert checkpoint.load(f"{path}/shardkit", m, o)["step"] == 3

    for route in (from_memory, from_dcp, from_shardkit):
        other, other_opt = fresh(seed=1)  # other weights, no state yet
        route(other, other_opt)
        assert_momentum_placed_like_params(list(other.parameters()), other_opt)
        train_injected(list(other.parameters()), other_opt, steps=range(3, STEPS))
        assert_momentum_placed_like_params(list(other.parameters()), other_opt)
        try:
            assert_bit_identical(list(other.parameters()), uninterrupted)
        except AssertionError as e:
            raise AssertionError(f"resumed {route.__name__}: {e}") from None
    dist.barrier(group=mesh.get_group())  # every rank has read the files
    if mesh.get_local_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_muon_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
