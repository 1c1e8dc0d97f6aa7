"""MemTracker on 2 gloo ranks: a step's live bytes match the shards, byte for byte.

The model is Linear(8, 16) -> ReLU -> Linear(16, 4), each Linear its own group, the root
holding no parameters. Every sharded dim is even, so no rank has padding rows and the
padded shards are exactly the local shards. Per rank (float32):

- parameters: 16/2 x 8 + 16/2 + 4/2 x 16 + 4/2 = 64 + 8 + 32 + 2 elements = 424 B
- gradients: one reduced chunk per group, each parameter's ``.grad`` a view of it: 424 B
- AdamW: ``exp_avg`` and ``exp_avg_sq`` like each local shard, plus a 4 B ``step`` each
- shardkit's grad-presence column: one ones tensor per group, an element per parameter,
  made at the first backward and kept (``Bucket.all_present``)
"""

import gc
import time

import pytest
import torch
import torch.nn as nn

from gloo_harness import Checks, run_worker
from shardkit import fully_shard
from shardkit.memtrack import MemTracker

checks = Checks()
BATCH = 2


def build(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def settled(tracker: MemTracker, expected: int, timeout_s: float = 2.0) -> int:
    """The tracker's bytes once they reach ``expected`` (or after ``timeout_s``): gloo's worker
    thread drops its reference to a finished collective's buffers a moment after the waiting
    thread has returned, so on a loaded machine they can outlive the wait by a little."""
    deadline = time.monotonic() + timeout_s
    while tracker.current_bytes != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return tracker.current_bytes


def local_bytes(tensors) -> int:
    return sum(t.to_local().numel() * t.element_size() for t in tensors)


@checks("shardkit")
def persistent_bytes_are_the_shards_grads_and_adamw_state(mesh, impl):
    model, optimizer = build(mesh)
    params = list(model.parameters())
    shards = local_bytes(params)
    assert shards == 424
    presence = 4 * 2 * 2  # the grad-presence columns: one (world 2) x (2 parameters) buffer, shared by both groups
    tracker = MemTracker().track(model, optimizer)
    with tracker:
        for _ in range(2):  # the second step starts with the optimizer state in place
            x = torch.randn(BATCH, 8)
            model(x).sum().backward()
            del x
            optimizer.step()
            gc.collect()  # garbage in reference cycles goes when the collector runs: not deterministic otherwise
            after_step = tracker.mark("step")
            grads = local_bytes(p.grad for p in params)
            optimizer.zero_grad(set_to_none=True)
            after_zero_grad = tracker.mark("zero_grad")
    assert grads == shards
    adamw = 2 * shards + 4 * len(params)
    assert after_step.current_bytes == shards + grads + adamw + presence, after_step
    assert after_zero_grad.current_bytes == shards + adamw + presence, after_zero_grad
    assert tracker.by_category()["parameter"] == shards  # DTensors count their local storage


@checks("shardkit")
def activations_after_forward_exclude_the_resharded_parameters(mesh, impl):
    model, optimizer = build(mesh)
    tracker = MemTracker().track(model, optimizer)
    seen_in_forward = []
    # Runs after shardkit's own pre-forward hook: the group is unsharded by now.
    model[0].register_forward_pre_hook(lambda *_: seen_in_forward.append(tracker.current_bytes))
    with tracker:
        before = tracker.current_bytes
        x = torch.randn(BATCH, 8)  # 64 B
        loss = model(x).sum()
        # Read without mark(): mark re-reads every storage size, which would hide a resize
        # to 0 that the tracker missed. The unsharded storages were freed with resize_(0).
        # Left: x, relu's output (BATCH, 16) saved for the second Linear's backward, the loss.
        expected = before + 64 + BATCH * 16 * 4 + 4
        after_forward = settled(tracker, expected)
    assert after_forward == expected, (before, after_forward)
    # Inside the first group's forward, its unsharded weight and bias (16 x 8 + 16) count.
    assert seen_in_forward[0] >= before + 64 + (16 * 8 + 16) * 4, (before, seen_in_forward)
    loss.backward()


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_memtrack_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
