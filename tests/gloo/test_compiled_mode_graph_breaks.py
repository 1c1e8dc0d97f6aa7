"""shardkit.compiled under ``torch.compile``'s default, ``fullgraph=False``, on 2 gloo ranks: blocks
whose forward breaks the graph between two layers (a branch on a value read with ``.item()``, as
routers and checks do) run as several graphs, the group's gathered parameters held between them,
and train as eager shardkit does. (One graph, ``fullgraph=True``, is what the other compiled-mode
checks use.) And blocks the parent's forward calls through ``torch.utils.checkpoint``, as
transformers' ``gradient_checkpointing_enable`` does, in one graph."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from compiled_parity import assert_same_bits, shard
from gloo_harness import Checks, run_worker
from gloo_parity import Chain, Parity, stack_batches

checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)


class Breaking(nn.Module):
    """Two layers with a data-dependent branch between them: dynamo breaks the graph at ``.item()``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        if x.abs().sum().item() > 1e9:  # never true: the branch only breaks the graph
            x = x * 2
        return torch.tanh(self.b(x)) + x


def Net() -> Chain:  # noqa: N802 (a model class, to its callers)
    return Chain([Breaking(13), Breaking(13)])  # 13 rows: uneven shards


def mse(model: nn.Module, batch) -> torch.Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


@checks("shardkit", sim=False)
def blocks_that_break_the_graph_train_as_eager_shardkit(mesh, impl):
    """Each block's gather runs in the graph before its break and the second layer reads the
    gathered parameters in the graph after it (a read passes the parameter's index, which dynamo
    made symbolic in the resumed frame: it crashed with "unhashable type: non-nested SymInt").
    Three AdamW steps: the unsharded model's gradients, and eager shardkit's bits."""
    from torch._dynamo.utils import counters

    runs = {}
    for mode in ("eager", "compiled"):
        torch._dynamo.reset()
        counters.clear()
        p = Parity.build(Net, shard(mode, mesh), mesh, "compiled", loss_of=mse)
        if mode == "compiled":
            p.model = torch.compile(p.model, backend="aot_eager")
        for batch in stack_batches(3):
            p.forward_backward(batch)
            p.assert_grads_match()
            p.optimizer_step()
        if mode == "compiled":
            assert counters["graph_break"], "the blocks were meant to break the graph"
        runs[mode] = p
    assert_same_bits(runs["compiled"], runs["eager"], "blocks that break the graph")


class CheckpointedChain(Chain):
    """Chain whose forward calls each block through the user's checkpoint."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.out(x)


def Checkpointed() -> Chain:  # noqa: N802 (a model class, to its callers)
    return CheckpointedChain([nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(2)])


@checks("shardkit", sim=False)
def blocks_under_the_users_checkpoint_train_as_eager_shardkit(mesh, impl):
    """``fullgraph=True`` through a gather inside the user's checkpoint (it failed: "HOP: Unsafe
    side effect"), resharding after forward or not (not: the gather is saved, not recomputed).
    Two AdamW steps: the unsharded model's gradients, and eager shardkit's bits."""
    for reshard in (True, False):
        runs = {}
        for mode in ("eager", "compiled"):
            torch._dynamo.reset()
            p = Parity.build(Checkpointed, shard(mode, mesh, reshard_after_forward=reshard), mesh, "compiled", loss_of=mse)
            if mode == "compiled":
                p.model = torch.compile(p.model, backend="aot_eager", fullgraph=True)
            for batch in stack_batches(2):
                p.forward_backward(batch)
                p.assert_grads_match()
                p.optimizer_step()
            runs[mode] = p
        assert_same_bits(runs["compiled"], runs["eager"], f"blocks under the user's checkpoint, reshard_after_forward={reshard}")


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_mode_with_graph_breaks_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
