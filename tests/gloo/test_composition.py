"""HSDP and parameters sharded on other dims: numerics on 2 gloo ranks against the reference.

HSDP at 1x2 (one replica, two shards: FSDP) and 2x1 (two replicas of one shard: DDP-like),
gradient accumulation that skips the all-reduce across replicas, and Shard(1)/Shard(2)
parameters, even (with FSDP2 too) and uneven (shardkit only: FSDP2 needs even division).
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Parity, Stack, stack_batches

checks = Checks()
STEPS = 3


def mesh_2d(replicas: int, shards: int) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(replicas * shards).view(replicas, shards), mesh_dim_names=("replicate", "shard"))


def hsdp(impl, mesh):
    def shard(model):
        for block in model.blocks:
            FULLY_SHARD[impl](block, mesh=mesh)
        FULLY_SHARD[impl](model, mesh=mesh)
    return shard


@checks()
def hsdp_1x2_matches_reference(mesh, impl):
    p = Parity.build(Stack, hsdp(impl, mesh_2d(1, 2)), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    assert p.model.inp.weight.placements == (Replicate(), Shard(0))


@checks()
def hsdp_2x1_matches_reference(mesh, impl):
    p = Parity.build(Stack, hsdp(impl, mesh_2d(2, 1)), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()


@checks()
def hsdp_accumulation_without_all_reduce_matches_one_big_batch(mesh, impl):
    p = Parity.build(Stack, hsdp(impl, mesh_2d(2, 1)), mesh, impl)
    for batch in stack_batches(STEPS):
        halves = list(zip(*(t.chunk(2) for t in batch)))  # two microbatches of the global batch
        p.model.set_requires_all_reduce(False)
        p.forward_backward(halves[0], scale=0.5)
        p.model.set_requires_all_reduce(True)
        p.forward_backward(halves[1], scale=0.5)
        p.assert_grads_match()
        p.optimizer_step()
    p.assert_params_match()


class Experts(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 6)
        self.up = nn.Parameter(torch.randn(3, 6, hidden) / 3)  # (experts, dim, hidden)
        self.blocks = nn.ModuleList()
        self.down = nn.Linear(hidden, 3)

    def forward(self, x):
        h = torch.tanh(torch.einsum("bd,edh->bh", self.inp(x), self.up))
        return self.down(h)


def shard_dims(impl, mesh):
    fn = lambda p: Shard(2) if p.dim() == 3 else Shard(1) if p.dim() == 2 else Shard(0)  # noqa: E731
    return lambda m: FULLY_SHARD[impl](m, mesh=mesh, shard_placement_fn=fn)


@checks()
def params_sharded_on_dims_1_and_2_match_reference(mesh, impl):
    p = Parity.build(lambda: Experts(hidden=4), shard_dims(impl, mesh), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    assert p.model.up.placements == (Shard(2),) and p.model.down.weight.placements == (Shard(1),)


@checks("shardkit")  # FSDP2 requires even division on dims other than 0
def uneven_shards_on_dims_1_and_2_match_reference(mesh, impl):
    p = Parity.build(lambda: Experts(hidden=5), shard_dims(impl, mesh), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    assert p.model.up.to_local().shape == (3, 6, 3 - mesh.get_local_rank())  # 5 = 3 + 2


# Activation checkpointing ------------------------------------------------------------------
def shard_with_ac(impl, mesh, how):
    from torch.distributed._composable import checkpoint as composable_checkpoint
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def shard(model):
        for i, block in enumerate(model.blocks):
            if how == "composable":
                composable_checkpoint(block)
            else:
                model.blocks[i] = block = checkpoint_wrapper(block)
            FULLY_SHARD[impl](block, mesh=mesh)
        FULLY_SHARD[impl](model, mesh=mesh)
    return shard


@checks()
def activation_checkpointing_recomputes_without_extra_collectives(mesh, impl):
    for how in ("composable", "wrapper"):
        p = Parity.build(Stack, shard_with_ac(impl, mesh, how), mesh, impl)
        passes = p.train(stack_batches(STEPS))
        p.assert_params_match()
        # as without checkpointing: forward gathers root + 2 blocks, backward the 2 blocks
        # again (the recomputation reuses that gather), one reduce-scatter per group
        counts = [(s.forward.all_gather, s.backward.all_gather, s.backward.reduce_scatter) for s in passes]
        assert counts == [(3, 2, 3)] * STEPS, (how, counts)


# Other entry points --------------------------------------------------------------------------
from dataclasses import dataclass  # noqa: E402


@dataclass
class Output:
    logits: torch.Tensor
    extras: dict


class KeywordBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(13, 13)
        # a rotary-style buffer: never sharded, moved to the device, used in forward
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 13).float() / 13)), persistent=False)

    def forward(self, *, x, scale=1.0):
        h = torch.tanh(self.lin(x)) * scale
        return {"h": h + torch.sin(self.inv_freq), "aux": (h.square().mean(),)}


class KeywordModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 13)
        self.blocks = nn.ModuleList([KeywordBlock(), KeywordBlock()])
        self.out = nn.Linear(13, 3)

    def forward(self, *, x):
        h, aux = self.inp(x), 0.0
        for block in self.blocks:
            out = block(x=h, scale=0.5)
            h, aux = out["h"], aux + out["aux"][0]
        return Output(self.out(h), {"aux": aux})


def keyword_loss(model, batch):
    x, y = batch
    out = model(x=x)
    return torch.nn.functional.mse_loss(out.logits, y) + 0.1 * out.extras["aux"]


@checks()
def keyword_only_forwards_and_dataclass_outputs_match_reference(mesh, impl):
    from gloo_parity import shard_blocks_then_root

    p = Parity.build(KeywordModel, shard_blocks_then_root(impl, mesh), mesh, impl, loss_of=keyword_loss)
    passes = p.train(stack_batches(STEPS))
    p.assert_params_match()
    buffer = p.model.blocks[0].inv_freq
    assert type(buffer) is torch.Tensor and buffer.device.type == "cpu" and buffer.shape == (13,)
    counts = [(s.forward.all_gather, s.backward.all_gather, s.backward.reduce_scatter) for s in passes]
    assert counts == [(3, 2, 3)] * STEPS, counts  # the aux losses inside dicts and tuples reached backward


# Weights tied across groups ------------------------------------------------------------------
@checks("shardkit")  # torch FSDP2 2.13 raises when the tie crosses fully_shard calls
def embedding_tied_to_head_across_groups_matches_reference_and_stays_tied(mesh, impl):
    import shardkit
    from gloo_parity import gpt_batches, gpt_loss, small_gpt

    def shard(model):
        shardkit.fully_shard(model.tok_emb, mesh=mesh)  # owns the tied weight
        for block in model.blocks:
            shardkit.fully_shard(block, mesh=mesh)
        shardkit.fully_shard(model, mesh=mesh)  # the head uses it: borrows tok_emb's group

    p = Parity.build(small_gpt, shard, mesh, impl, loss_of=gpt_loss)
    passes = p.train(gpt_batches(STEPS))
    p.assert_params_match()
    assert p.model.head.weight is p.model.tok_emb.weight
    assert sum(q is p.model.tok_emb.weight for q in p.opt.param_groups[0]["params"]) == 1
    # forward: root (+ tok_emb's group, borrowed), 2 blocks; backward: tok_emb again, 2 blocks;
    # reduce-scatters: 2 blocks, root, tok_emb (once, for both uses)
    counts = [(s.forward.all_gather, s.backward.all_gather, s.backward.reduce_scatter) for s in passes]
    assert counts == [(4, 3, 4)] * STEPS, counts


# torch.compile per block ----------------------------------------------------------------------
def shard_compiled(impl, mesh, when, backend):
    def shard(model):
        for i, block in enumerate(model.blocks):
            if when == "before":  # compile, then shard the compiled module (torchtitan's order)
                model.blocks[i] = block = torch.compile(block, backend=backend)
            FULLY_SHARD[impl](block, mesh=mesh)
            if when == "after":
                model.blocks[i] = torch.compile(block, backend=backend)
        FULLY_SHARD[impl](model, mesh=mesh)
    return shard


@checks(sim=False)  # dynamo does not trace under the simulated streams' dispatch mode
def blocks_compiled_before_or_after_fully_shard_train_to_reference(mesh, impl):
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    for when, backend in (("before", "inductor"), ("before", counting), ("after", counting)):
        graphs.clear()
        torch._dynamo.reset()
        p = Parity.build(Stack, shard_compiled(impl, mesh, when, backend), mesh, impl)
        p.train(stack_batches(STEPS))
        p.assert_params_match()
        if backend is counting and when == "before":
            assert graphs, "compiling before fully_shard should capture the blocks' forward"


# FSDP + tensor parallel ------------------------------------------------------------------------
def train_llama_2d(mesh_1d, impl, dp: int, tp: int, fully_shard=None, compile=lambda model: model):
    """Llama's blocks parallelized over tp and sharded over dp (``fully_shard``: the impl's
    unless given), trained against the unsharded model (``compile``: what runs the model)."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import parallelize_module

    from gloo_parity import assert_close, full, mean_over_ranks
    from shardkit.models.llama import Llama, LlamaConfig, tp_plan

    mesh = DeviceMesh("cpu", torch.arange(dp * tp).view(dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Llama(LlamaConfig())
    ref = copy.deepcopy(model)
    fully_shard = fully_shard or FULLY_SHARD[impl]
    for block in model.layers:
        parallelize_module(block, mesh["tp"], tp_plan())
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    run = compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-5)
    g = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        tokens = torch.randint(0, 64, (4, 17), generator=g)
        x, y = tokens[:, :-1], tokens[:, 1:]
        mine = [t.chunk(dp)[mesh.get_local_rank(0)] for t in (x, y)]  # tp ranks share a batch
        loss = F.cross_entropy(run(mine[0]).flatten(0, 1), mine[1].flatten())
        loss.backward()
        ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
        ref_loss.backward()
        assert_close(mean_over_ranks(loss, mesh_1d), ref_loss.detach(), f"loss at step {step}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(full(p.grad), q.grad, f"grad {name} at step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(full(p.detach()), q.detach(), f"param {name}")


@checks()
def fsdp_with_tensor_parallel_1x2_matches_reference(mesh, impl):
    train_llama_2d(mesh, impl, dp=1, tp=2)


@checks()
def fsdp_with_tensor_parallel_2x1_matches_reference(mesh, impl):
    train_llama_2d(mesh, impl, dp=2, tp=1)


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_composition_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
