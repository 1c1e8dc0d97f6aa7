"""shardkit.compiled on 2 gloo ranks: a weight tied across two fully_shard calls, a
checkpoint saved in one mode loaded in the other, and a model with a complex and a frozen
integer parameter and a group of two modules. (A module of its own: test_compiled_mode.py
compiles enough to come near the harness's per-module time limit under load.)"""

import tempfile

import pytest
import torch

import shardkit.checkpoint
from compiled_parity import MODES, assert_same_bits, shard
from gloo_harness import Checks, run_worker
from gloo_parity import Parity, gpt_batches, gpt_loss, small_gpt

checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)


@checks("shardkit", sim=False)
def a_weight_tied_across_calls_trains_like_the_unsharded_model_and_eager_shardkit(mesh, impl):
    """The output head in a fully_shard call of its own, its weight the token embedding's (the
    root's, a later call): the root gathers it too, in a bucket of its own reduced with the
    head's settings, as eager mode reduces it in the head's group. Two plain steps: the unsharded
    model's gradients and parameters (compiled, aot_eager); then, the mode run without
    torch.compile, a divide factor on the head alone and accumulation without sync: eager
    shardkit's parameters (the same sums added in another order: close, not the same bits)."""
    from gloo_parity import assert_close, full

    def tied(mode):
        def apply(model):
            for block in model.blocks:
                MODES[mode](block, mesh=mesh)
            MODES[mode](model.head, mesh=mesh)
            MODES[mode](model, mesh=mesh)
        return apply

    runs = {}
    for mode, backend in (("eager", None), ("compiled", "aot_eager")):
        torch._dynamo.reset()
        p = Parity.build(small_gpt, tied(mode), mesh, "compiled", loss_of=gpt_loss)
        sharded = p.model
        assert sharded.head.weight is sharded.tok_emb.weight
        if backend is not None:
            p.model = torch.compile(p.model, backend=backend, fullgraph=True)
        p.train(gpt_batches(2))  # gradients and parameters against the unsharded model at each step
        p.model = sharded  # the same code run without torch.compile: three graphs fewer to compile
        sharded.head.set_gradient_divide_factor(3.0)
        for i, batch in enumerate(gpt_batches(3, seed=40)):
            sharded.set_requires_gradient_sync(i == 2)
            p.forward_backward(batch)
        p.optimizer_step()
        runs[mode] = p
    for (name, x), y in zip(runs["compiled"].model.named_parameters(), runs["eager"].model.parameters()):
        assert_close(full(x.detach()), full(y.detach()), f"tied across calls, divide factor on the head, accumulation: {name}")


@checks("shardkit", sim=False)
def a_checkpoint_saved_in_one_mode_loads_in_the_other(mesh, impl):
    with tempfile.TemporaryDirectory() as tmp:
        names = [tmp]
        torch.distributed.broadcast_object_list(names, src=0)  # rank 0's directory for every rank
        for saver, loader in (("compiled", "eager"), ("eager", "compiled")):
            trained = Parity.build(small_gpt, shard(saver, mesh), mesh, "compiled", loss_of=gpt_loss)
            for batch in gpt_batches(2):
                trained.step(batch)
            path = f"{names[0]}/{saver}"
            shardkit.checkpoint.save(path, trained.model, trained.opt, step=2)
            fresh = Parity.build(small_gpt, shard(loader, mesh), mesh, "compiled", loss_of=gpt_loss)
            shardkit.checkpoint.load(path, fresh.model, fresh.opt)
            assert_same_bits(fresh, trained, f"saved by {saver}, loaded by {loader}")
            after = []
            for p in (trained, fresh):  # the optimizer state came along: the next step agrees too
                after.append(p.forward_backward(gpt_batches(1, seed=7)[0]).loss)
                p.optimizer_step()
            assert torch.equal(after[0], after[1]), f"saved by {saver}: the next loss differs"
            assert_same_bits(fresh, trained, f"saved by {saver}, one step after loading")


class Odd(torch.nn.Module):
    """A complex weight and a frozen integer permutation in the blocks, and a norm and a head
    meant for one group of two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(OddBlock() for _ in range(2))
        self.norm, self.head = torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class OddBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.complex64) / 8)
        self.perm = torch.nn.Parameter(torch.randperm(8), requires_grad=False)

    def forward(self, x):
        return torch.tanh((x.to(torch.complex64) @ self.w).abs())[..., self.perm]


@checks("shardkit", sim=False)
def complex_and_integer_parameters_and_a_group_of_two_modules_match_eager_bit_for_bit(mesh, impl):
    """Compiled mode failed each: a complex gradient on gloo's all-to-all ("Invalid scalar
    type"), a frozen integer parameter at fully_shard, ``fully_shard([norm, head])`` in
    AOTAutograd's partitioner. 3 AdamW steps under torch.compile (aot_eager, fullgraph): eager
    shardkit's parameters, bit for bit."""
    from gloo_parity import local, stack_batches

    runs = {}
    for mode, fully_shard, backend in (("eager", shardkit.fully_shard, None), ("compiled", shardkit.compiled.fully_shard, "aot_eager")):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Odd()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard([model.norm, model.head], mesh=mesh)
        fully_shard(model, mesh=mesh)
        run = torch.compile(model, backend=backend, fullgraph=True) if backend else model
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for batch in stack_batches(3):
            x, y = local(batch, mesh)
            torch.nn.functional.mse_loss(run(x), y).backward()
            opt.step()
            opt.zero_grad()
        runs[mode] = {n: p.full_tensor() for n, p in model.named_parameters()}
    assert runs["compiled"].keys() == runs["eager"].keys()
    for name, want in runs["eager"].items():
        assert torch.equal(runs["compiled"][name], want), name


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_tied_and_checkpoints_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
