"""A sharded parameter's post-accumulate-grad hooks (``register_post_accumulate_grad_hook``, the
way to step an optimizer per parameter inside backward) run as FSDP2 runs them: once per
backward that reduces the parameter, with its ``.grad`` already set; not in a backward without
gradient sync, not for a frozen parameter. Its gradient hooks (``register_hook``) do not run:
autograd never reaches the sharded parameter. Eager mode and compiled mode (run eagerly and
under ``torch.compile``) against torch's FSDP2 on the same model, in a fake process group.

Compiled mode's graph takes a plain leaf per parameter instead of the DTensor (``CompiledGroup.
make_leaves``); the rest of this file checks that its gradient follows the parameter: frozen or
unfrozen after a compiled step, replaced by ``setattr`` or ``load_state_dict(assign=True)``, and
a replacement its group cannot see raises, naming the parameter."""

import functools
from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardkit
import shardkit.compiled
from tests.conftest import TanhStack, fake_world

MODES = ("fsdp2", "eager", "compiled, run eagerly", "compiled")


def sharded(mode: str, mesh) -> tuple[nn.Module, nn.Module]:
    """The model sharded in ``mode``, and what to call it through."""
    torch.manual_seed(0)
    net = TanhStack(2, dim=8)
    shard = {"fsdp2": torch_fully_shard, "eager": shardkit.fully_shard}.get(mode, shardkit.compiled.fully_shard)
    for block in net.blocks:
        shard(block, mesh=mesh)
    shard(net, mesh=mesh)
    run = torch.compile(net, backend="aot_eager", fullgraph=True) if mode == "compiled" else net
    return net, run


def step(run: nn.Module) -> None:
    run(torch.randn(4, 8)).sum().backward()


def hooked(net: nn.Module) -> tuple[Counter, list[str]]:
    """Per parameter name, the post-accumulate-grad hook's calls (each checks ``.grad``), and
    the names whose gradient hook ran."""
    post, pre = Counter(), []
    for name, p in net.named_parameters():

        def after(param, name=name):
            assert isinstance(param.grad, DTensor) and param.grad.shape == param.shape, name
            post[name] += 1

        p.register_post_accumulate_grad_hook(after)
        p.register_hook(lambda grad, name=name: pre.append(name))
    return post, pre


def calls_in(mode: str) -> list:
    """The hooks' calls after: two steps; one without gradient sync; one with the first
    block's weight frozen."""
    torch._dynamo.reset()
    with fake_world(4) as mesh:
        net, run = sharded(mode, mesh)
        post, pre = hooked(net)
        seen = []
        for _ in range(2):
            step(run)
        seen.append(dict(post))
        net.set_requires_gradient_sync(False)
        step(run)
        seen.append(dict(post))
        net.set_requires_gradient_sync(True)
        step(run)  # (reduces what the step without sync kept)
        seen.append(dict(post))
        net.blocks[0][0].weight.requires_grad_(False)
        step(run)
        seen.append(dict(post))
    return seen + [pre]


@functools.cache
def fsdp2_calls() -> list:
    """``calls_in("fsdp2")``, run once for the three modes compared with it."""
    return calls_in("fsdp2")


@pytest.mark.parametrize("mode", MODES[1:])
def test_post_accumulate_grad_hooks_run_as_fsdp2_runs_them(mode):
    expected = fsdp2_calls()
    names = [n for n, _ in TanhStack(2, dim=8).named_parameters()]
    assert expected[0] == {n: 2 for n in names}  # (what FSDP2 does, spelled out)
    assert expected[1] == expected[0] and expected[-1] == []
    assert expected[3]["blocks.0.0.weight"] == 3
    assert calls_in(mode) == expected


def test_compiled_mode_gradient_follows_freezing_and_unfreezing_after_a_compiled_step():
    """The graph's leaves require grad whatever the parameter; the traced forward detaches
    those of frozen parameters (dynamo guards on the flag: one more graph each way)."""
    with fake_world(4) as mesh:
        torch._dynamo.reset()
        net, run = sharded("compiled", mesh)
        weight = net.blocks[0][0].weight
        with_grad = []
        for requires_grad in (True, False, True, False):
            weight.requires_grad_(requires_grad)
            net.zero_grad(set_to_none=True)
            step(run)
            with_grad.append(weight.grad is not None)
            assert net.blocks[0][0].bias.grad is not None and net.out.weight.grad is not None
        assert with_grad == [True, False, True, False]


@pytest.mark.parametrize("how", ["setattr", "load_state_dict(assign=True)"])
def test_compiled_mode_trains_a_parameter_replaced_after_a_compiled_step(how):
    with fake_world(4) as mesh:
        torch._dynamo.reset()
        net, run = sharded("compiled", mesh)
        step(run)
        old = net.blocks[1][0].weight
        new = nn.Parameter(old.detach().clone())
        if how == "setattr":
            net.blocks[1][0].weight = new
        else:
            state = net.state_dict()
            state["blocks.1.0.weight"] = new
            net.load_state_dict(state, assign=True)
        new = net.blocks[1][0].weight
        assert new is not old
        net.zero_grad(set_to_none=True)
        old.grad = None  # (no longer the model's: zero_grad does not reach it)
        with torch.no_grad():
            new.to_local().fill_(0.5)
        step(run)
        assert new.grad is not None and old.grad is None
        group = net.blocks[1]._shardkit()
        assert group.leaves[0].untyped_storage().data_ptr() == new.to_local().untyped_storage().data_ptr()


def test_compiled_mode_raises_for_a_replacement_its_group_cannot_see():
    """Written into ``_parameters`` directly: the group's leaf still holds the old tensor, so its
    gradient is not the new one's. The backward says so, naming the parameter."""
    with fake_world(4) as mesh:
        torch._dynamo.reset()
        net, run = sharded("compiled", mesh)
        step(run)
        old = net.blocks[1][0].weight
        net.blocks[1][0]._parameters["weight"] = nn.Parameter(old.detach().clone())
        with pytest.raises(RuntimeError, match=r"parameter 'blocks\.1\.0\.weight' holds a tensor its group did not see"):
            step(run)


class TiedAcross(nn.Module):
    """The embedding's weight is the head's, the head sharded by a call of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)))


@pytest.mark.parametrize("mode", ["eager", "compiled, run eagerly", "compiled"])
def test_a_weight_tied_across_two_calls_runs_its_hooks_once_per_backward(mode):
    """Both calls reduce a gradient for it (compiled mode: two reduce-scatters, summed by
    autograd in one leaf): an optimizer stepping in its hook must step once."""
    with fake_world(4) as mesh:
        torch._dynamo.reset()
        torch.manual_seed(0)
        net = TiedAcross()
        shard = shardkit.fully_shard if mode == "eager" else shardkit.compiled.fully_shard
        shard(net.head, mesh=mesh)
        shard(net, mesh=mesh)
        run = torch.compile(net, backend="aot_eager", fullgraph=True) if mode == "compiled" else net
        post, _ = hooked(net)
        for _ in range(2):
            run(torch.randint(0, 16, (4, 3))).sum().backward()
        assert dict(post) == {"emb.weight": 2}


def calls_with_a_regularizer(mode: str) -> tuple[dict, torch.Tensor]:
    """One step whose loss also reads the first block's sharded weight outside any forward (a
    regularizer on its local shard): the hooks' calls per parameter and that weight's gradient."""
    torch._dynamo.reset()
    with fake_world(1) as mesh:  # (world 1: the gradient is the real one)
        net, run = sharded(mode, mesh)
        post, _ = hooked(net)
        weight = net.blocks[0][0].weight
        loss = run(torch.randn(4, 8, generator=torch.Generator().manual_seed(0))).sum() + (weight.to_local() ** 2).sum() * 1e-3
        loss.backward()
        return dict(post), weight.grad.full_tensor()


@pytest.mark.parametrize("mode", MODES[1:])
def test_a_weight_also_used_outside_its_groups_forward_runs_its_hooks_as_fsdp2(mode):
    """FSDP2 runs such a weight's hooks twice in that backward: once when autograd accumulates
    the regularizer's gradient into the sharded parameter, once when the reduce-scatter adds
    the forward's. Each mode runs them as FSDP2 does, with FSDP2's gradient."""
    expected, grad = calls_with_a_regularizer("fsdp2")
    assert expected["blocks.0.0.weight"] == 2 and expected["blocks.1.0.weight"] == 1  # (what FSDP2 does, spelled out)
    calls, mode_grad = calls_with_a_regularizer(mode)
    assert calls == expected
    torch.testing.assert_close(mode_grad, grad, rtol=0, atol=0)
