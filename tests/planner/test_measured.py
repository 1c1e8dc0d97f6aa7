"""The planner's peak against a measured run in this process: the planned model is sharded over
a fake process group of 2 ranks (the NCCL path: reduce-scatter into a fresh chunk) and trained
for three steps while MemTracker counts live tensor bytes; the peak over the last two must be
within the tolerance of tests/gloo/test_plan_validation.py.

The planner assumes each reduction finishes as late as the runtime lets it (``MAX_REDUCING``);
the fake process group's finish at once, so ``latest_finish`` holds them in flight to measure
that case. tests/gloo measures the gloo path with real timing.
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import MixedPrecisionPolicy
from shardkit.memtrack import MemTracker
from shardkit.eager.param_group import ParamGroup
from shardkit.planner.workload import _default_loss
from tests.conftest import TanhStack, fake_world

TOLERANCE = 0.10  # tests/gloo/test_plan_validation.py's
WORLD, BATCH, SEQ = 2, 4, 64


class TinyLM(nn.Module):
    """A language model whose logits dwarf everything else: a large vocabulary, a small width."""

    def __init__(self, vocab: int, dim: int = 32, n_blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(n_blocks))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def tiny_lm(vocab: int = 8192) -> TinyLM:
    return TinyLM(vocab)


def cross_entropy(logits, targets):
    """What a training loop writes."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


@pytest.fixture
def latest_finish(monkeypatch):
    """Reductions never report done early: each finishes when MAX_REDUCING forces it."""
    monkeypatch.setattr(ParamGroup, "reduce_done", lambda self: False)


def measured_peak(p: shardkit.Plan, build, make_batch, loss_of, mp_policy=None) -> int:
    """The peak over steps 2 and 3 (the optimizer state exists by then, as the plan assumes)
    of the usual loop, which holds its batch through backward."""
    with fake_world(WORLD) as mesh:
        torch.manual_seed(0)
        model = build()
        shardkit.apply_plan(model, p, mesh=mesh, **({"mp_policy": mp_policy} if mp_policy else {}))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tracker = MemTracker().track(model, optimizer)
        with tracker:
            for i in range(3):
                if i == 1:
                    tracker.reset_peak()
                batch = make_batch()
                loss_of(model, *batch).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return tracker.peak_bytes


def assert_close(p: shardkit.Plan, measured: int) -> None:
    error = (p.memory.peak - measured) / measured
    assert abs(error) <= TOLERANCE, f"predicted {p.memory.peak:,} B, measured {measured:,} B ({error:+.1%})"


def tokens(b: int, t: int) -> tuple:
    return (torch.randint(8192, (b, t)),)


def tokens_and_targets() -> tuple:
    return tokens(BATCH, SEQ) + tokens(BATCH, SEQ)


def features(b: int, t: int = 0) -> tuple:
    return (torch.randn(b, 256),)


def test_default_loss_of_a_module_function_is_cross_entropy(latest_finish):
    # Logits (4, 64, 8192) in fp32 are 8 MiB; cross-entropy's log-softmax and its gradient add
    # two more, which a mean of the logits does not have. Fed the default token ids, the
    # planner scores them against random targets, as a loop with its own targets does.
    p = shardkit.plan("tests.planner.test_measured:tiny_lm", WORLD, batch_size=BATCH, seq_len=SEQ)
    assert_close(p, measured_peak(p, tiny_lm, tokens_and_targets, lambda model, x, y: cross_entropy(model(x), y)))


def test_default_loss_is_cross_entropy_against_the_last_input(latest_finish):
    p = shardkit.plan("tests.planner.test_measured:tiny_lm", WORLD, batch_size=BATCH, seq_len=SEQ, inputs_fn=tokens)
    assert_close(p, measured_peak(p, tiny_lm, lambda: tokens(BATCH, SEQ), lambda model, x: cross_entropy(model(x), x)))


@pytest.mark.parametrize("mp", [None, (torch.bfloat16, torch.float32)], ids=["fp32", "bf16-fp32"])
def test_reduce_scatter_buffers_are_counted(latest_finish, mp):
    # Parameters dominate: at each issue the runtime holds the unsharded gradients, the input
    # and output chunk, and (mixed precision) the gradients cast to fp32, besides the
    # reductions still in flight.
    dtypes = dict(zip(("param_dtype", "reduce_dtype"), mp)) if mp else {}
    p = shardkit.plan(lambda: TanhStack(4, 256), WORLD, batch_size=BATCH, inputs_fn=features,
                      loss_fn=lambda out, inputs: out.sum(), **dtypes)
    policy = MixedPrecisionPolicy(**dtypes) if mp else None
    measured = measured_peak(p, lambda: TanhStack(4, 256), lambda: features(BATCH), lambda model, x: model(x).sum(), policy)
    assert_close(p, measured)


def test_default_loss_scores_class_indices_else_takes_the_mean():
    logits = torch.randn(2, 3, 5)
    ids = torch.randint(5, (2, 3))
    assert torch.equal(_default_loss(logits, (ids,)), cross_entropy(logits, ids))
    assert torch.equal(_default_loss((logits, torch.tensor(1.5)), (ids,)), torch.tensor(1.5))
    for last in (torch.randn(2, 3), torch.randint(5, (2, 4)), torch.ones(2, 3, dtype=torch.bool)):
        assert torch.equal(_default_loss(logits, (ids, last)), logits.mean())
    assert torch.equal(_default_loss(logits, ()), logits.mean())
