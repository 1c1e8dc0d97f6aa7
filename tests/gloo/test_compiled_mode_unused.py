"""shardkit.compiled on 2 gloo ranks: unused parameters keep ``.grad = None``, as in eager mode
and in the unsharded model (shardkit/compiled/unused.py); a parameter used on one rank only is
reduced with zeros on the other, as eager mode. AdamW tells the two apart: a zero gradient
would step the weight decay and the moments. (A module of its own: the compiled gloo modules
compile near the harness's per-module time limit under load.)"""

import contextlib

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import shardkit
import shardkit.compiled
from compiled_parity import regions
from gloo_harness import Checks, run_worker
from gloo_parity import Block, Chain, Parity, Stack, assert_close, full, local, stack_batches, stack_loss

checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)


def Same() -> Chain:  # noqa: N802 (a model class, to its callers)
    """Two blocks of one structure (so they can share a compile region), each with a Linear
    its forward never calls."""
    return Chain([Block(13, 13, unused=True) for _ in range(2)])


def _shard(mesh, **kwargs):
    def apply(model):
        for block in model.blocks:
            shardkit.compiled.fully_shard(block, mesh=mesh, **kwargs)
        shardkit.compiled.fully_shard(model, mesh=mesh)

    return apply


@checks("shardkit", sim=False)
def unused_parameters_keep_none_and_train_like_the_unsharded_model(mesh, impl):
    """The Stack with an unused Linear in its first block, compiled (aot_eager; the blocks
    reshard after forward, the root does not), then two identical blocks as compile regions,
    then not compiled: every step's gradients (None where the reference's are None) and
    AdamW's parameters match the unsharded model's; only the unused Linear's parameters are
    watched (for the second region too, whose body was traced for the first). Compiled, then
    accumulation over two backwards without sync and one with it: still None."""
    for what, make, as_regions in (("compiled", Stack, False), ("regions", Same, True), ("not compiled", Stack, None)):
        torch._dynamo.reset()
        with regions() if as_regions else contextlib.nullcontext():
            p = Parity.build(lambda: make(unused=True) if make is Stack else make(), _shard(mesh), mesh, "compiled", loss_of=stack_loss)
            sharded = p.model
            assert all(b._shardkit_state.region for b in sharded.blocks) == bool(as_regions), what
            if as_regions is not None:
                p.model = torch.compile(p.model, backend="aot_eager", fullgraph=True)
            for i, step in enumerate(p.train(stack_batches(2))):
                assert_close(step.loss, step.ref_loss, f"{what}: loss at step {i}")
            assert sharded.blocks[0].unused.weight.grad is None, what
            # only what a traced forward did not read is watched (its counts read back after backward)
            unread = [m._shardkit_state.watch.unread for m in (sharded, *sharded.blocks)]
            assert unread == [set(), {2, 3}, {2, 3} if make is Same else set()], f"{what}: {unread}"  # (lin, unused) x (weight, bias)
            if what != "compiled":
                continue
            for i, batch in enumerate(stack_batches(3, seed=5)):
                sharded.set_requires_gradient_sync(i == 2)
                p.forward_backward(batch)
            p.assert_grads_match()
            p.optimizer_step()
            p.assert_params_match()


class Branch(nn.Module):
    """Rank 0 runs ``a``, rank 1 runs ``b``; ``c`` runs on none; ``scale`` is read under
    ``no_grad`` only (a norm the forward divides by, as a constant)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.full((8,), 0.5))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        branch = self.a if torch.distributed.get_rank() == 0 else self.b
        with torch.no_grad():
            norm = self.scale.norm()
        return self.out(torch.tanh(branch(self.inp(x))) / norm)


@checks("shardkit", sim=False)
def a_parameter_one_rank_used_is_reduced_with_zeros_on_the_other_as_eager_mode(mesh, impl):
    """Each rank runs another branch (its own graph, the same collectives): ``a`` and ``b`` get
    the average of one rank's gradient and the other's zeros on both ranks, ``c`` (no rank)
    keeps None, but for the gradient of a regularizer of its shard in the second step's loss
    (kept, as eager mode); ``scale``, read under no_grad only, keeps None (a read with autograd
    off counted as a use gave it zeros, and AdamW's weight decay moved it); the same bits as
    eager shardkit after two AdamW steps."""
    runs = {}
    for mode, fully_shard, backend in (("eager", shardkit.fully_shard, None), ("compiled", shardkit.compiled.fully_shard, "aot_eager")):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Branch()
        fully_shard(model, mesh=mesh)
        run = torch.compile(model, backend=backend, fullgraph=True) if backend else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
        grads = []
        for step, batch in enumerate(stack_batches(2)):
            loss = stack_loss(run, local(batch, mesh))
            if step == 1:  # c's weight itself in the loss (a regularizer), not through the group's forward:
                w = model.c.weight  # compiled mode: the sharded DTensor; eager: the root's unsharded weight
                loss = loss + 1e-3 * (w.to_local() if isinstance(w, DTensor) else w).pow(2).sum()  # the same gradient
            loss.backward()
            grads.append({n: None if p.grad is None else full(p.grad) for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        runs[mode] = (model, grads)
    (compiled, compiled_grads), (eager, eager_grads) = runs["compiled"], runs["eager"]
    for step, (got, want) in enumerate(zip(compiled_grads, eager_grads)):
        assert (got["c.weight"] is None) == (want["c.weight"] is None) == (step == 0), f"step {step}: c's gradient"
        assert got["c.bias"] is None and want["c.bias"] is None, f"step {step}: c.bias has a gradient"
        assert got["scale"] is None and want["scale"] is None, f"step {step}: scale, read under no_grad, has a gradient"
        for name, g in got.items():
            assert (g is None) == (want[name] is None), f"step {step}: {name}: {g} against eager's {want[name]}"
            if g is not None:
                assert torch.equal(g, want[name]), f"step {step}: gradient {name} differs from eager shardkit's"
    for (name, x), y in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(full(x.detach()), full(y.detach())), f"parameter {name} differs from eager shardkit's"


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_unused_parameters_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
