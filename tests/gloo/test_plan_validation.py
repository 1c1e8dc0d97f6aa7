"""The planner against a real run: 2 gloo ranks train the planned GPT while MemTracker
counts live tensor bytes; the predicted peak and persistent bytes must be within 10% of
the measured ones on every rank, and the predicted collectives equal the trace's exactly.

The training loop is the usual one: forward, backward, step, ``zero_grad(set_to_none=True)``;
it keeps the loss and the batch but not the logits (the planner's profile drops them too).
Set SHARDKIT_PLAN_REPORT=<file> to have rank 0 write what it predicted and measured.
"""

import json
import os

import pytest
import torch
import torch.nn.functional as F

import shardkit
from gloo_harness import Checks, run_worker
from shardkit import MixedPrecisionPolicy
from shardkit.memtrack import MemTracker
from shardkit.models import GPT, GPTConfig
from shardkit.models.llama import Llama, LlamaConfig

checks = Checks()
CONFIG = dict(n_layer=4, n_head=4, n_embd=128, vocab_size=65, block_size=64)
BATCH = 8
TOLERANCE = 0.10


def gpt_loss(model, x, y):
    return model(x, y)[1]


def llama_loss(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def train_and_measure(p: shardkit.Plan, mesh, mp_policy=None, build=lambda: GPT(GPTConfig(**CONFIG)),
                      loss_of=gpt_loss, vocab=CONFIG["vocab_size"], seq=CONFIG["block_size"]) -> dict:
    """Three steps of the planned model; the peak over the last two (the optimizer state
    exists by then, as the plan assumes), persistent bytes after the last step, and the
    collectives of the last step."""
    torch.manual_seed(0)
    model = build()
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    shardkit.apply_plan(model, p, mesh=mesh, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    tracker = MemTracker().track(model, optimizer)
    with tracker:
        for step in range(3):
            x, y = (torch.randint(vocab, (BATCH, seq), generator=generator) for _ in range(2))
            if step == 1:
                tracker.reset_peak()
            with shardkit.trace() as t:
                loss = loss_of(model, x, y)
                loss.backward()
            optimizer.step()
            persistent = tracker.mark("step").current_bytes
            optimizer.zero_grad(set_to_none=True)
    return {
        "peak": tracker.peak_bytes,
        "persistent": persistent,
        "comm": {k: (s.calls, s.nbytes) for k, s in t.summary().items()},
        "batch_bytes": x.nbytes + y.nbytes,  # held by the loop, not by the model: the plan leaves them out
    }


def compare(p: shardkit.Plan, measured: dict, name: str) -> None:
    predicted = {"peak": p.memory.peak, "persistent": p.memory.persistent}
    report = os.environ.get("SHARDKIT_PLAN_REPORT")
    if report and torch.distributed.get_rank() == 0:
        doc = json.loads(open(report).read()) if os.path.exists(report) else {}
        doc[name] = {"predicted": predicted, "measured": {k: measured[k] for k in ("peak", "persistent", "batch_bytes")},
                     "prefetch": p.prefetch, "reshard_after_forward": {g.name or "<root>": g.reshard_after_forward for g in p.groups}}
        open(report, "w").write(json.dumps(doc, indent=2))
    assert measured["comm"] == {k: (s.calls, s.nbytes) for k, s in p.comm.items()}
    for key, value in predicted.items():
        error = abs(value - measured[key]) / measured[key]
        assert error <= TOLERANCE, f"{name} {key}: predicted {value:,} B, measured {measured[key]:,} B ({error:.1%} off)"


@checks("shardkit")
def fp32_recipe(mesh, impl):
    p = shardkit.plan("gpt", 2, batch_size=BATCH, **CONFIG)
    compare(p, train_and_measure(p, mesh), "fp32, default recipe")


@checks("shardkit")
def bf16_plan_chosen_for_a_budget(mesh, impl):
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    tight = shardkit.plan("gpt", 2, batch_size=BATCH, prefetch=0, **mp, **CONFIG).memory.peak
    p = shardkit.plan("gpt", 2, batch_size=BATCH, budget=int(tight * 1.05), **mp, **CONFIG)
    assert p.notes[0].startswith("fits")
    assert any(g.reshard_after_forward is False for g in p.groups if g.name), p.reshard_after_forward()
    compare(p, train_and_measure(p, mesh, MixedPrecisionPolicy(**mp)), "bf16/fp32, budget 1.05x the tightest")


@checks("shardkit")
def fp32_every_block_kept_and_prefetch_two(mesh, impl):
    p = shardkit.plan("gpt", 2, batch_size=BATCH, reshard_after_forward=False, prefetch=2, **CONFIG)
    compare(p, train_and_measure(p, mesh), "fp32, reshard_after_forward=False, prefetch 2")


@checks("shardkit")
def llama_with_grouped_query_attention_in_bf16(mesh, impl):
    config = LlamaConfig(vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, hidden=160, max_seq=48)
    mp = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    p = shardkit.plan(lambda: Llama(config), 2, batch_size=BATCH, seq_len=48, **mp)
    measured = train_and_measure(p, mesh, MixedPrecisionPolicy(**mp), lambda: Llama(config), llama_loss, 96, 48)
    compare(p, measured, "Llama (GQA) bf16/fp32")


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_plan_matches_a_measured_run(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
