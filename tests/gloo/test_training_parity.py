"""Training on 2 gloo ranks matches a non-sharded single-process reference (AdamW, 5 steps).

Every check also runs with torch's own FSDP2 (``-torch`` items): a check FSDP2 fails is
probably a wrong check. The checks run inside the spawned ranks; see gloo_harness.py.
"""

import pytest
import torch
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import shardkit
from gloo_harness import Checks, run_worker
from gloo_parity import (
    FULLY_SHARD, Parity, Stack, assert_close, count_collectives, full, gather_rows, gpt_batches, gpt_loss,
    local, mean_over_ranks, shard_blocks_then_root, small_gpt, stack_batches, stack_loss,
)

from shardkit.models.gpt import apply_fully_shard

STEPS = 5
checks = Checks()


@checks()
def mlp_matches_reference_with_uneven_rows(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()


@checks()
def gpt_matches_reference_with_tied_weights(mesh, impl):
    shard = lambda m: apply_fully_shard(m, FULLY_SHARD[impl], mesh=mesh)
    p = Parity.build(small_gpt, shard, mesh, impl, loss_of=gpt_loss)
    assert p.model.head.weight is p.model.tok_emb.weight, "sharding untied head.weight from tok_emb.weight"
    passes = p.train(gpt_batches(STEPS))
    p.assert_params_match()
    # Three groups (2 blocks, root): one all-gather each in forward, the 2 blocks again in
    # backward (they resharded; the root did not), one reduce-scatter each.
    counts = [(s.forward.all_gather, s.backward.all_gather, s.backward.reduce_scatter) for s in passes]
    assert counts == [(3, 2, 3)] * STEPS, f"(forward all-gathers, backward all-gathers, reduce-scatters) per step: {counts}"


@checks()
def gpt_matches_reference_without_reshard_after_forward(mesh, impl):
    shard = lambda m: apply_fully_shard(m, FULLY_SHARD[impl], mesh=mesh, reshard_after_forward=False)
    p = Parity.build(small_gpt, shard, mesh, impl, loss_of=gpt_loss)
    passes = p.train(gpt_batches(STEPS))
    p.assert_params_match()
    # No group resharded after forward, so backward gathers nothing.
    counts = [(s.forward.all_gather, s.backward.all_gather, s.backward.reduce_scatter) for s in passes]
    assert counts == [(3, 0, 3)] * STEPS, f"(forward all-gathers, backward all-gathers, reduce-scatters) per step: {counts}"


@checks()
def gradient_accumulation_matches_one_big_batch(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    for step in range(3):
        micro_batches = stack_batches(4, seed=10 + step)
        loss, reduce_scatters = torch.zeros(()), []
        for i, micro_batch in enumerate(micro_batches):
            p.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            with count_collectives(impl) as counts:
                micro_loss = stack_loss(p.model, local(micro_batch, mesh)) / len(micro_batches)
                micro_loss.backward()
            loss += micro_loss.detach()
            reduce_scatters.append(counts.reduce_scatter)
        big_batch = tuple(torch.cat(ts) for ts in zip(*micro_batches))
        ref_loss = stack_loss(p.ref, big_batch)  # the mean of the 4 micro-batch means
        ref_loss.backward()
        p.assert_grads_match()
        p.optimizer_step()
        assert_close(mean_over_ranks(loss, mesh), ref_loss.detach(), f"loss at step {step}")
        assert reduce_scatters == [0, 0, 0, 3], f"reduce-scatters per micro-batch at step {step}: {reduce_scatters}"
    p.assert_params_match()


@checks()
def grouped_modules_all_gather_once_per_forward(mesh, impl):
    def shard(model):
        FULLY_SHARD[impl]([model.blocks[0], model.blocks[1]], mesh=mesh)
        FULLY_SHARD[impl](model, mesh=mesh)

    p = Parity.build(Stack, shard, mesh, impl)
    passes = p.train(stack_batches(STEPS))
    p.assert_params_match()
    # Two groups: the blocks together, and the root.
    counts = [(s.forward.all_gather, s.backward.all_gather, s.backward.reduce_scatter) for s in passes]
    assert counts == [(2, 1, 2)] * STEPS, f"(forward all-gathers, backward all-gathers, reduce-scatters) per step: {counts}"


@checks()
def unused_parameter_keeps_no_grad_under_weight_decay(mesh, impl):
    p = Parity.build(lambda: Stack(unused=True), shard_blocks_then_root(impl, mesh), mesh, impl, weight_decay=0.1)
    initial = {n: t.detach().clone() for n, t in p.ref.blocks[0].unused.named_parameters()}
    for i, batch in enumerate(stack_batches(STEPS)):
        result = p.forward_backward(batch)
        ref_grads = [t.grad for t in p.ref.blocks[0].unused.parameters()]
        assert ref_grads == [None, None], f"the reference's unused Linear has gradients {ref_grads}"
        p.assert_grads_match()  # None for the unused Linear, as in the reference
        p.optimizer_step()
        assert_close(result.loss, result.ref_loss, f"loss at step {i}")
    p.assert_params_match()
    for name, t in p.model.blocks[0].unused.named_parameters():
        assert_close(full(t.detach()), initial[name], f"unused {name} after {STEPS} steps")


@checks()
def no_grad_eval_between_steps_matches_reference(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    eval_batch = stack_batches(1, seed=2)[0]
    for i, batch in enumerate(stack_batches(STEPS)):
        result = p.step(batch)
        assert_close(result.loss, result.ref_loss, f"loss at step {i}")
        with torch.no_grad():
            out, ref_out = p.model(local(eval_batch, mesh)[0]), p.ref(eval_batch[0])
        assert_close(gather_rows(out, mesh), ref_out, f"eval output after step {i}")
    p.assert_params_match()


@checks("shardkit")  # FSDP2 reuses the root's pre-step unsharded parameters here
def eval_between_backward_and_step_does_not_reuse_stale_params(mesh, impl):
    # The eval forward leaves the root unsharded with pre-step values; the next training
    # forward must gather the updated shards again (any optimizer, foreach or not).
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    eval_batch = stack_batches(1, seed=3)[0]
    for i, batch in enumerate(stack_batches(STEPS)):
        result = p.forward_backward(batch)
        with torch.no_grad():
            p.model(local(eval_batch, mesh)[0])
        p.optimizer_step()
        assert_close(result.loss, result.ref_loss, f"loss at step {i}")
    p.assert_params_match()


@checks()
def meta_device_init_matches_reference(mesh, impl):
    torch.manual_seed(0)
    ref = Stack()
    with torch.device("meta"):
        model = Stack()
    shard_blocks_then_root(impl, mesh)(model)
    model.to_empty(device="cpu")
    full_state = ref.state_dict()
    rank, world = mesh.get_local_rank(), mesh.size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            chunks = full_state[name].chunk(world)  # torch.chunk rows: the Shard(0) layout
            rows = chunks[rank] if rank < len(chunks) else full_state[name][:0]
            param.to_local().copy_(rows)
    p = Parity(model, ref, mesh, impl, stack_loss)
    p.train(stack_batches(STEPS))
    p.assert_params_match()


class Wrapped(Stack):
    """The Stack, with each block called through ``wrap`` (checkpointing, or twice)."""

    def __init__(self, wrap: str) -> None:
        super().__init__()
        self.wrap = wrap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)  # (B, 13)
        for block in self.blocks:
            if self.wrap == "twice":
                x = block(block(x)) if block.lin.out_features == block.lin.in_features else block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.wrap == "reentrant_checkpoint")
        return self.out(x)  # (B, 3)


@checks()
def microbatching_with_fsdp2s_knobs_matches_one_big_batch(mesh, impl):
    """The usual FSDP2 microbatch loop: no sync, no reshard after backward and not the last
    backward until the last microbatch. Parameters stay gathered from one backward to the next
    forward."""
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    for step in range(3):
        micro_batches = stack_batches(3, seed=20 + step)
        gathers = []
        for i, micro_batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            p.model.set_is_last_backward(last)
            p.model.set_requires_gradient_sync(last)
            p.model.set_reshard_after_backward(last)
            with count_collectives(impl) as counts:
                (stack_loss(p.model, local(micro_batch, mesh)) / len(micro_batches)).backward()
            gathers.append(counts.all_gather)
        big_batch = tuple(torch.cat(ts) for ts in zip(*micro_batches))
        stack_loss(p.ref, big_batch).backward()
        p.assert_grads_match()
        p.optimizer_step()
        # Later microbatches' forwards gather nothing (kept since the last backward); the blocks
        # still reshard after forward and gather again in backward.
        assert gathers == [5, 2, 2], f"all-gathers per micro-batch: {gathers}"
    p.assert_params_match()


@checks()
def wrapped_blocks_match_reference(mesh, impl):
    """Activation checkpointing (both kinds) re-gathers in backward; a block called twice
    reduces twice, and the two partial reductions add up."""
    for wrap in ("reentrant_checkpoint", "checkpoint", "twice"):
        p = Parity.build(lambda: Wrapped(wrap), shard_blocks_then_root(impl, mesh), mesh, impl)
        p.train(stack_batches(3))
        p.assert_params_match()


@checks()
def freezing_after_fully_shard_stops_its_updates(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    for model in (p.model, p.ref):
        model.blocks[0].lin.weight.requires_grad_(False)
    p.train(stack_batches(3))  # compares gradients too: None for the frozen weight
    p.assert_params_match()


@checks()
def an_optimizer_stepped_in_post_accumulate_grad_hooks_matches_reference(mesh, impl):
    """Optimizer in backward: an AdamW per parameter, stepped (and its gradient dropped) by the
    parameter's post-accumulate-grad hook, on both models. The sharded parameters' hooks run
    once per backward with the reduced gradient (eager shardkit ran none before 2026-12-04:
    its parameters never moved)."""
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    for model in (p.model, p.ref):
        optimizers = {param: torch.optim.AdamW([param], lr=1e-2) for param in model.parameters()}

        def step_in_backward(param, optimizers=optimizers):
            optimizers[param].step()
            optimizers[param].zero_grad(set_to_none=True)

        for param in model.parameters():
            param.register_post_accumulate_grad_hook(step_in_backward)
    before = full(next(p.model.parameters())).clone()
    for i, batch in enumerate(stack_batches(3)):
        result = p.forward_backward(batch)
        assert_close(result.loss, result.ref_loss, f"loss at step {i}")
    assert not torch.equal(full(next(p.model.parameters())), before), "no hook stepped the sharded parameters"
    assert all(param.grad is None for param in p.model.parameters())
    p.assert_params_match()


class Generator(Stack):
    def generate(self, x: torch.Tensor, steps: int = 3) -> torch.Tensor:
        """Calls forward repeatedly, like a language model's decode loop."""
        for _ in range(steps):
            x = torch.cat([x[:, 3:], self(x)], dim=1)  # (B, 8)
        return x


@checks()
def registered_forward_method_runs_nested_forwards(mesh, impl):
    register = {"shardkit": shardkit.register_fsdp_forward_method, "torch": torch_register}[impl]
    p = Parity.build(Generator, shard_blocks_then_root(impl, mesh), mesh, impl)
    register(p.model, "generate")
    for i, batch in enumerate(stack_batches(3)):
        result = p.step(batch)
        assert_close(result.loss, result.ref_loss, f"loss at step {i}")
        with torch.no_grad():
            out, ref_out = p.model.generate(local(batch, mesh)[0]), p.ref.generate(batch[0])
        assert_close(gather_rows(out, mesh), ref_out, f"generate after step {i}")
    assert all(isinstance(t, DTensor) for t in p.model.parameters())


ELEMENTWISE_OPTIMIZERS = [
    (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, foreach=True)),
    (torch.optim.AdamW, dict(lr=1e-2, fused=True)),
    (torch.optim.RMSprop, dict(lr=1e-3, momentum=0.5, centered=True)),
    (torch.optim.Adagrad, dict(lr=1e-2)),
    (torch.optim.NAdam, dict(lr=1e-2, foreach=False)),
]


@checks()
def elementwise_optimizers_match_reference_and_keep_dtensor_state(mesh, impl):
    # shardkit steps these on the local shards (shardkit/optim/local_step.py); users still see DTensors.
    for optimizer, kwargs in ELEMENTWISE_OPTIMIZERS:
        p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl, optimizer=optimizer, **kwargs)
        p.train(stack_batches(3))
        p.assert_params_match()
        name = optimizer.__name__
        assert all(isinstance(q, DTensor) for g in p.opt.param_groups for q in g["params"]), name
        for param, state in p.opt.state.items():
            assert isinstance(param, DTensor), name
            for key, value in state.items():
                if value.dim() > 0:
                    assert isinstance(value, DTensor) and value.placements == param.placements, f"{name} {key}"
                    assert full(value).shape == param.shape, f"{name} {key} shape"


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_training_matches_reference_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
