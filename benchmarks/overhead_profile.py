"""Where shardkit's host time per step goes, by hook event and by action (make bench part 2's model).

    python benchmarks/overhead_profile.py [--blocks 48] [--dim 64] [--steps 200]

The model of ``make bench`` part 2 (``bench.tiny_stack``: blocks of Linear + ReLU, one group
each plus the root, on the fake process group at world 8, AdamW foreach), timed step by step
next to the unsharded model and the eager-FSDP floor (``bench.Floor``). Then one more run
of shardkit's steps with a timer around each entry point of the runtime: the four hook
events (``Schedule.pre_forward`` ... ``post_backward``, each including its classification
and the rules table), each action the rules name (exclusive of the actions it runs in turn),
the end of backward, the optimizer's swap to local shards and back, and the collectives'
calls into the process group. What no timer covers is the model's own math, autograd's
engine (calling our hooks) and AdamW: compare it with the unsharded step.

The timers cost about 1 us each; the table subtracts nothing, so read it as shares.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shardkit  # noqa: E402
from bench import Floor, overhead_step_ms, tiny_stack  # noqa: E402
from shardkit.eager import schedule as schedule_module  # noqa: E402
from shardkit.eager.state import RULES  # noqa: E402
from shardkit.comm import buckets, collectives  # noqa: E402
from shardkit.comm.streams import Streams  # noqa: E402
from shardkit.dtensor.sharded_param import ShardedParam  # noqa: E402
from shardkit.eager.param_group import ParamGroup, Reducing  # noqa: E402
from shardkit.optim import local_step  # noqa: E402

WORLD = 8


class Timers:
    """Exclusive time per label: a label's time excludes the labelled calls inside it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list] = []  # [label, start, time in children]

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.stack.append([label, time.perf_counter(), 0.0])
            try:
                return original(*args, **kwargs)
            finally:
                label_, start, children = self.stack.pop()
                spent = time.perf_counter() - start
                self.seconds[label_] += spent - children
                self.calls[label_] += 1
                if self.stack:
                    self.stack[-1][2] += spent

        setattr(owner, name, timed)


def instrument(timers: Timers, deep: bool) -> None:
    Schedule = schedule_module.Schedule
    for name in ("pre_forward", "post_forward", "pre_backward", "post_backward"):
        timers.wrap(Schedule, name, f"event {name} (classify, rules table)")
    timers.wrap(Schedule, "end_backward", "event end of backward")
    for action in sorted({m for rule in RULES.values() for m in rule.methods}):
        timers.wrap(Schedule, action, f"action {action}")
    from torch.optim import optimizer

    for hooks in (optimizer._global_optimizer_pre_hooks, optimizer._global_optimizer_post_hooks):
        for key, hook in hooks.items():
            if hook in (local_step._to_local, local_step._to_dtensor):
                holder = type("Hook", (), {"fn": staticmethod(hook)})
                timers.wrap(holder, "fn", f"optimizer: {hook.__name__} (the swap to local shards and back)")
                hooks[key] = holder.fn
    for name in ("_all_gather_single", "_reduce_scatter_single"):
        timers.wrap(collectives, name, "process group calls (fake: no data moves)")
    if deep:  # inside the actions
        for owner, names in ((ParamGroup, ("issue_unshard", "wait_for_unshard", "_reshard", "reduce_gradients", "_reduction")),
                             (Reducing, ("finish", "finish_oldest")),
                             (buckets.Bucket, ("copy_in", "copy_out")), (buckets.GatherBucket, ("copy_in", "copy_out", "alloc_outputs", "inputs")),
                             (collectives.Reduction, ("issue", "finish", "__init__")), (collectives, ("all_gather", "finish_all_gather", "_reduce_ops")),
                             (ShardedParam, ("set_sharded_grad",)), (Streams, ("issue", "wait"))):
            for name in names:
                timers.wrap(owner, name, f"  {getattr(owner, '__name__', owner)}.{name}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--deep", action="store_true", help="also time the main calls inside the actions (labels indented)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        models = {"plain": tiny_stack(args.blocks, args.dim), "floor": Floor(tiny_stack(args.blocks, args.dim), WORLD)}
        sharded = tiny_stack(args.blocks, args.dim)
        for block in sharded:
            shardkit.fully_shard(block, mesh=mesh)
        models["shardkit"] = shardkit.fully_shard(sharded, mesh=mesh)
        optimizers = {name: torch.optim.AdamW((m.model if isinstance(m, Floor) else m).parameters(), lr=1e-3, foreach=True) for name, m in models.items()}
        x = torch.randn(8, args.dim)
        rounds: dict[str, list[float]] = {name: [] for name in models}
        for name, model in models.items():
            overhead_step_ms(model, optimizers[name], x, 5)
        for _ in range(10):  # interleaved rounds, as bench.py
            for name, model in models.items():
                rounds[name].append(statistics.median(overhead_step_ms(model, optimizers[name], x, 5)))
        timers = Timers()
        instrument(timers, args.deep)
        start = time.perf_counter()
        overhead_step_ms(models["shardkit"], optimizers["shardkit"], x, args.steps)
        timed_ms = (time.perf_counter() - start) * 1000 / args.steps
    finally:
        dist.destroy_process_group()
    ms = {name: statistics.median(r) for name, r in rounds.items()}
    groups = args.blocks + 1
    per_group = lambda step_ms: (step_ms - ms["plain"]) * 1000 / groups  # noqa: E731
    print(f"world {WORLD}, {args.blocks} blocks of Linear({args.dim}) + ReLU, {groups} groups; median step ms (10 rounds of 5):")
    print("  " + ", ".join(f"{n} {v:.2f}" for n, v in ms.items()) + f"; shardkit/floor {ms['shardkit'] / ms['floor']:.2f}")
    print(f"  over the unsharded step, per group: floor {per_group(ms['floor']):.0f} us, shardkit {per_group(ms['shardkit']):.0f} us")
    print(f"\nshardkit with timers: {timed_ms:.2f} ms a step; exclusive time per group per step (us), calls per group per step:")
    covered = 0.0
    for label, seconds in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
        us = seconds * 1e6 / args.steps / groups
        covered += us
        print(f"  {us:7.1f}  {timers.calls[label] / args.steps / groups:5.2f}  {label}")
    rest = timed_ms * 1000 / groups - covered
    print(f"  {covered:7.1f}         in the runtime's entry points above")
    print(f"  {rest:7.1f}         the rest: model math, autograd's engine, AdamW, the hooks' own Python calls "
          f"(unsharded step: {ms['plain'] * 1000 / groups:.1f} per group)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
