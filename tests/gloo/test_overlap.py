"""Communication overlaps computation on CPU (gloo), and prefetching keeps the numerics.

The overlap check makes every collective take at least ``DELAY_S`` of wall time in the
background (its work handle's ``wait`` returns no earlier than ``DELAY_S`` after the
collective was issued) and every block's forward and backward take ``COMPUTE_S`` (sleeps,
so the machine's load does not matter). An implementation that waits for each collective
right after issuing it takes compute + communication; shardkit issues all-gathers one group
ahead and finishes reduce-scatters one group later, so most of the delay hides behind the
compute. torch's FSDP2 runs gloo collectives synchronously on CPU, so the check is
shardkit-only; its "-torch" twin below shows the same program without overlap.
"""

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Parity, Stack, shard_blocks_then_root, stack_batches
from shardkit.comm import collectives

checks = Checks()
DELAY_S = 0.03
COMPUTE_S = 0.03
N_BLOCKS = 4


class SlowWork:
    """A work handle whose wait returns no earlier than DELAY_S after the issue."""

    def __init__(self, work, issued: float) -> None:
        self.work, self.issued = work, issued

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.issued + DELAY_S and (self.work is None or self.work.is_completed())

    def wait(self, *args):
        if self.work is not None:
            self.work.wait()
        time.sleep(max(0.0, self.issued + DELAY_S - time.perf_counter()))
        return True


def slow(fn):
    def wrapped(*args, async_op=False, **kwargs):
        work = SlowWork(fn(*args, async_op=True, **kwargs), time.perf_counter())
        if async_op:
            return work
        work.wait()
        return None
    return wrapped


@contextlib.contextmanager
def slow_collectives():
    """Every collective either implementation issues takes DELAY_S."""
    names = ["all_gather_single", "reduce_scatter_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"]
    saved_dist = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    saved_ours = collectives._all_gather_single, collectives._reduce_scatter_single
    for n, fn in saved_dist.items():
        setattr(dist, n, slow(fn))
    collectives._all_gather_single, collectives._reduce_scatter_single = slow(saved_ours[0]), slow(saved_ours[1])
    try:
        yield
    finally:
        for n, fn in saved_dist.items():
            setattr(dist, n, fn)
        collectives._all_gather_single, collectives._reduce_scatter_single = saved_ours


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(COMPUTE_S)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(COMPUTE_S)
        return grad


class SlowBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return Sleep.apply(torch.tanh(self.lin(x)))


class SlowNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(SlowBlock() for _ in range(N_BLOCKS))

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return x.sum()


def timed_steps(mesh, impl) -> tuple[float, int]:
    """Median step time (after warm-up) and collectives per step."""
    torch.manual_seed(0)
    net = SlowNet()
    for b in net.blocks:
        FULLY_SHARD[impl](b, mesh=mesh)
    FULLY_SHARD[impl](net, mesh=mesh)
    x = torch.randn(4, 16)
    times = []
    with slow_collectives():
        for _ in range(4):
            start = time.perf_counter()
            net(x).backward()
            times.append(time.perf_counter() - start)
    # Forward gathers the root and every block; backward gathers the blocks again and
    # reduces every group: (1 + N) + N + (1 + N).
    return sorted(times[1:])[1], 3 * N_BLOCKS + 2


@checks("shardkit")
def slow_collectives_overlap_with_compute(mesh, impl):
    step, n_collectives = timed_steps(mesh, impl)
    compute, comm = 2 * N_BLOCKS * COMPUTE_S, n_collectives * DELAY_S
    # Blocking: compute + comm = 0.24 + 0.42 s. Overlapped: what cannot hide is the root's
    # all-gather, the first block's (the root computes ~nothing), and the last reduce-scatters.
    assert step < compute + 0.5 * comm, f"step {step:.3f} s, compute {compute:.3f} s + communication {comm:.3f} s: no overlap"


@checks("torch")
def slow_collectives_do_not_overlap_in_torch_fsdp2_on_cpu(mesh, impl):
    step, n_collectives = timed_steps(mesh, impl)
    compute, comm = 2 * N_BLOCKS * COMPUTE_S, n_collectives * DELAY_S
    assert step > compute + 0.8 * comm, f"step {step:.3f} s: FSDP2 overlapped? (then the check above proves nothing special)"


@checks()
def prefetching_keeps_numerics_with_explicit_lists(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    blocks = list(p.model.blocks)
    blocks[0].set_modules_to_forward_prefetch(blocks[1:])
    blocks[-1].set_modules_to_backward_prefetch(blocks[:-1][::-1])
    p.train(stack_batches(4))
    p.assert_params_match()


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_overlap_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
