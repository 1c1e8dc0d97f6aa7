"""State dicts, torch's state-dict helpers, shardkit.checkpoint in-process, recovery after an
exception, and check mode for rank-divergent programs, on 2 gloo ranks.

(Resume in fresh processes and resharding to 1 and 4 ranks: tests/checkpoint/test_resume.py.)
"""

import copy
import shutil

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

import shardkit
from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Parity, Stack, assert_close, full, shard_blocks_then_root, stack_batches

checks = Checks()


def trained(mesh, impl, steps=2) -> Parity:
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    p.train(stack_batches(steps))
    return p


@checks()
def state_dict_has_the_unsharded_keys_and_sharded_values_without_communication(mesh, impl):
    p = trained(mesh, impl)
    with torch.no_grad():
        p.model(torch.randn(2, 8))  # the root keeps its gathered data after an eval forward
    with shardkit.trace() as t:
        sd = p.model.state_dict()
    assert list(sd) == list(p.ref.state_dict()), list(sd)
    assert all(isinstance(v, DTensor) for v in sd.values())
    assert not t.collectives(), t.format()


@checks("shardkit")  # FSDP2 needs DTensors here: load_state_dict of plain tensors fails there
def load_state_dict_takes_full_plain_tensors(mesh, impl):
    p = trained(mesh, impl)
    p.model.load_state_dict(p.ref.state_dict())  # the reference's full tensors
    p.assert_params_match()
    p.train(stack_batches(2, seed=7))  # and it trains on from there
    p.assert_params_match()


@checks()
def torch_state_dict_helpers_round_trip(mesh, impl):
    p = trained(mesh, impl)
    for full_state in (False, True):
        options = StateDictOptions(full_state_dict=full_state)  # (cpu_offload would leave rank 1 empty)
        model_sd = get_model_state_dict(p.model, options=options)
        optim_sd = get_optimizer_state_dict(p.model, p.opt, options=options)
        if full_state:
            assert_close(model_sd["inp.weight"], p.ref.inp.weight.detach(), "full inp.weight")
        other = trained(mesh, impl, steps=1)  # different weights and moments
        set_model_state_dict(other.model, model_sd, options=options)
        set_optimizer_state_dict(other.model, other.opt, optim_sd, options=options)
        for (name, a), b in zip(other.model.named_parameters(), p.model.parameters()):
            assert_close(full(a.detach()), full(b.detach()), f"{name} (full={full_state})")
        state_a = other.opt.state_dict()["state"][0]["exp_avg"]
        state_b = p.opt.state_dict()["state"][0]["exp_avg"]
        assert_close(full(state_a), full(state_b), f"exp_avg (full={full_state})")


@checks("shardkit")
def checkpoint_save_load_and_full_state_dicts(mesh, impl):
    import tempfile

    from shardkit import checkpoint

    p = trained(mesh, impl)
    path = tempfile.mkdtemp(dir="/tmp") if mesh.get_local_rank() == 0 else None
    holder = [path]
    torch.distributed.broadcast_object_list(holder, src=0, group=mesh.get_group())
    path = holder[0] + "/ck"
    checkpoint.save(path, p.model, p.opt, step=2, extra={"lr": 1e-2})
    other = trained(mesh, impl, steps=1)
    meta = checkpoint.load(path, other.model, other.opt)
    assert meta["step"] == 2 and meta["extra"] == {"lr": 1e-2} and meta["world_size"] == 2
    for (name, a), b in zip(other.model.named_parameters(), p.model.parameters()):
        assert torch.equal(full(a.detach()), full(b.detach())), name
    # full state dict on rank 0 only, then scattered back into a third model
    full_sd = checkpoint.full_state_dict(p.model)
    assert (mesh.get_local_rank() == 0) == bool(full_sd)
    third = trained(mesh, impl, steps=1)
    checkpoint.load_full_state_dict(third.model, full_sd if mesh.get_local_rank() == 0 else None)
    for (name, a), b in zip(third.model.named_parameters(), p.model.parameters()):
        assert torch.equal(full(a.detach()), full(b.detach())), name
    torch.distributed.barrier(group=mesh.get_group())  # nobody reads the checkpoint any more
    if mesh.get_local_rank() == 0:
        shutil.rmtree(holder[0], ignore_errors=True)


class Flaky(Stack):
    """Raises in forward or backward of block 1 when told to."""

    fail = ""

    def forward(self, x):
        x = self.inp(x)
        x = self.blocks[0](x)
        if self.fail == "forward":
            raise RuntimeError("boom in forward")
        if self.fail == "backward":
            x = Boom.apply(x)
        x = self.blocks[1](x)
        return self.out(x)


class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("boom in backward")


@checks("shardkit")  # FSDP2 keeps the failed backward's partial gradients and drifts from here
def an_exception_mid_forward_or_backward_then_reset_iter_state_trains_on(mesh, impl):
    p = Parity.build(Flaky, shard_blocks_then_root(impl, mesh), mesh, impl)
    batches = stack_batches(4)
    p.step(batches[0])
    for where in ("forward", "backward"):
        p.model.fail = where
        with pytest.raises(RuntimeError, match=f"boom in {where}"):
            p.forward_backward(batches[1])
        p.model.reset_iter_state()
        p.model.fail = ""
        p.ref.zero_grad()  # the reference's half-done step is dropped as well
        p.opt.zero_grad()
    for batch in batches[2:]:
        result = p.step(batch)
        assert_close(result.loss, result.ref_loss, "loss after recovery")
    p.assert_params_match()


class SkipsABlock(Stack):
    def forward(self, x, skip: bool):
        x = self.inp(x)
        if not skip:
            x = self.blocks[0](x)  # 13 -> 13: the model works either way
        return self.out(self.blocks[1](x))


@checks("shardkit")
def check_mode_turns_a_divergent_program_into_an_error_on_every_rank(mesh, impl):
    shardkit.check_collectives(True)
    try:
        torch.manual_seed(0)
        model = SkipsABlock()
        shard_blocks_then_root(impl, mesh)(model)
        skip = mesh.get_local_rank() == 1  # rank 1 skips blocks.0
        with pytest.raises(shardkit.CollectiveMismatch) as err:
            model(torch.randn(4, 8), skip).sum().backward()
        message = str(err.value)
        assert "rank 0: all_gather of group 'blocks.0'" in message, message
        assert "rank 1: all_gather of group 'blocks.1'" in message, message
    finally:
        shardkit.check_collectives(False)


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_checkpoint_and_recovery_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
