"""Live tensor bytes per rank over a few shardkit GPT training steps, measured with MemTracker.

    python benchmarks/memory_probe.py [--steps 3] [--json PATH]      (spawns 2 gloo ranks)
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/memory_probe.py

The numbers a memory plan predicts, per rank: the persistent bytes between steps (after
``optimizer.step()``, and after ``zero_grad(set_to_none=True)``), the peak over a step and
in each phase (forward, backward, optimizer step), and what the peak holds above the bytes
the step started with. Every storage carries a category (``shardkit.memtrack``):

- ``parameter``, ``gradient``, ``optimizer_state``: the sharded parameters (padded shards),
  the sharded gradients (relabelled after each backward), AdamW's state (after each step)
- ``input``: the token ids and targets
- ``unsharded_param``: every group's unsharded buffer (``ShardedParam.unsharded_flat``),
  labelled once at lazy init; it is 0 bytes while the group is resharded
- ``unsharded_grad``: gradients autograd accumulates into the unsharded parameters, before
  the reduce-scatter
- ``saved_activation``: forward tensors autograd saved for backward (a saved-tensors hook)
- ``forward_other`` / ``backward_other`` / ``step_other``: anything else made in that
  phase: outputs not saved, all-gather and reduce-scatter buffers, activation gradients,
  sharded gradients of groups already reduced (until the backward ends), AdamW temporaries

The training loop drops the logits (``loss = model(x, targets=y)[1]``), as a loop that keeps
them would hold B * T * vocab floats more between steps. Not counted: memory gloo allocates
inside a collective, allocator overheads; see ``shardkit/memtrack.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import shardkit
from shardkit.memtrack import MemTracker
from shardkit.models import GPT, GPTConfig, apply_fully_shard

WORLD = 2
PHASES = ("forward", "backward", "step", "zero_grad")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--json", help="write every number here")
    return parser.parse_args()


def config() -> GPTConfig:
    return GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)


def sharded_params(model: torch.nn.Module) -> list:
    """Every ShardedParam of every group (shardkit internals: a probe may look)."""
    return [p for m in model.modules() if isinstance(m, shardkit.FSDPModule) for p in m._shardkit().group.params]


def label_shardkit_buffers(model: torch.nn.Module, tracker: MemTracker) -> None:
    """Once the root's lazy init has made the unsharded buffers: label them, and label each
    unsharded gradient when autograd has accumulated it."""

    def label_grad(param: torch.Tensor) -> None:
        tracker.track(param.grad, category="unsharded_grad")

    for p in sharded_params(model):
        tracker.track(p.unsharded_flat, category="unsharded_param")
        p.unsharded_param.register_post_accumulate_grad_hook(label_grad)


def saved_tensor_labeller(tracker: MemTracker):
    """A saved-tensors hook pair that labels what forward saves for backward, unless it is
    already something else (a parameter, the input)."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        if tracker.category(t) == "forward_other":
            tracker.track(t, category="saved_activation")
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def train_step(model, optimizer, x, y, tracker: MemTracker) -> dict:
    """One step between marks; returns the marks by phase."""
    tracker.default_category = "forward_other"
    with saved_tensor_labeller(tracker):
        loss = model(x, targets=y)[1]
    tracker.mark("forward")
    tracker.default_category = "backward_other"
    loss.backward()
    del loss
    tracker.track(model)  # the sharded gradients are here now
    tracker.mark("backward")
    tracker.default_category = "step_other"
    optimizer.step()
    tracker.track(optimizer)  # the state exists from the first step
    tracker.mark("step")
    optimizer.zero_grad(set_to_none=True)
    tracker.mark("zero_grad")
    return {m.label: m for m in tracker.marks[-4:]}


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages under these (D)tensors."""
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storages[id(local.untyped_storage())] = local.untyped_storage().nbytes()
    return sum(storages.values())


def step_report(start, marks: dict, model, optimizer) -> dict:
    """One step's numbers; ``start`` is the mark the step began at."""
    phases = {
        ph: {"peak_bytes": marks[ph].peak_bytes, "peak_above_start": above(marks[ph].peak_by_category, start.current_by_category)}
        for ph in PHASES[:3]
    }
    peak_phase = max(phases, key=lambda ph: phases[ph]["peak_bytes"])
    return {
        "start_bytes": start.current_bytes,
        "after_step_bytes": marks["step"].current_bytes,
        "after_step_by_category": marks["step"].current_by_category,
        "after_zero_grad_bytes": marks["zero_grad"].current_bytes,
        "after_forward_by_category": marks["forward"].current_by_category,
        "peak_bytes": phases[peak_phase]["peak_bytes"],
        "peak_phase": peak_phase,
        "phases": phases,
        # What the sharded state alone accounts for (storages: padded shards, grad chunks).
        "param_storage_bytes": storage_bytes(model.parameters()),
        "optimizer_state_bytes": storage_bytes(t for s in optimizer.state.values() for t in s.values()),
    }


def above(at_peak: dict[str, int], at_start: dict[str, int]) -> dict[str, int]:
    """Bytes per category above the start, largest first."""
    diff = {k: v - at_start.get(k, 0) for k, v in at_peak.items()}
    return {k: v for k, v in sorted(diff.items(), key=lambda kv: -kv[1]) if v}


def rank_main(rank: int, args: argparse.Namespace, world: int) -> list[dict] | None:
    torch.manual_seed(0)  # the same full model on every rank
    mesh = init_device_mesh("cpu", (world,))
    model = apply_fully_shard(GPT(config()), shardkit.fully_shard, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, config().vocab_size, (args.batch, config().block_size), generator=gen)  # (B, T)
    y = x.roll(-1, dims=1)
    tracker = MemTracker().track(model, optimizer).track([x, y], category="input")

    def after_lazy_init(*_) -> None:  # runs after shardkit's own pre-forward hook
        label_shardkit_buffers(model, tracker)
        hook.remove()

    hook = model.register_forward_pre_hook(after_lazy_init)
    steps, times = [], []
    with tracker:
        for _ in range(args.steps):
            start = tracker.mark("start")
            begin = time.perf_counter()
            marks = train_step(model, optimizer, x, y, tracker)
            times.append(time.perf_counter() - begin)
            steps.append(step_report(start, marks, model, optimizer))
    untracked = []
    for _ in range(args.steps):
        begin = time.perf_counter()
        model(x, targets=y)[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        untracked.append(time.perf_counter() - begin)
    report = {"rank": rank, "steps": steps, "step_s_tracked": times, "step_s_untracked": untracked}
    gathered = [None] * world
    dist.all_gather_object(gathered, report)
    return gathered if rank == 0 else None


def kib(n: int) -> str:
    return f"{n:>10,d} B ({n / 1024:8.1f} KiB)"


def print_report(reports: list[dict], args: argparse.Namespace) -> None:
    c = config()
    print(f"GPT n_layer={c.n_layer} n_head={c.n_head} n_embd={c.n_embd} vocab={c.vocab_size} block={c.block_size}, "
          f"batch {args.batch} per rank, AdamW, {len(reports)} gloo ranks; live tensor bytes per rank")
    for rep in reports:
        for i, s in enumerate(rep["steps"]):
            print(f"\nrank {rep['rank']} step {i}  ({rep['step_s_tracked'][i] * 1e3:.0f} ms tracked)")
            print(f"  at start                  {kib(s['start_bytes'])}")
            print(f"  after step, before zero   {kib(s['after_step_bytes'])}  {s['after_step_by_category']}")
            print(f"  after zero_grad(None)     {kib(s['after_zero_grad_bytes'])}")
            print(f"  after forward             {s['after_forward_by_category']}")
            print(f"  peak of the step          {kib(s['peak_bytes'])}  in {s['peak_phase']}")
            for ph, p in s["phases"].items():
                print(f"    peak in {ph:<9}         {kib(p['peak_bytes'])}  above start: {p['peak_above_start']}")
            print(f"  parameter storages {s['param_storage_bytes']:,d} B, optimizer state {s['optimizer_state_bytes']:,d} B")
    for rep in reports:
        tracked, untracked = statistics.median(rep["step_s_tracked"]), statistics.median(rep["step_s_untracked"])
        print(f"rank {rep['rank']} median step: {tracked * 1e3:.0f} ms tracked, {untracked * 1e3:.0f} ms untracked")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)


def spawned(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    reports = rank_main(rank, args, WORLD)
    if reports is not None:
        print_report(reports, args)
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        reports = rank_main(dist.get_rank(), args, dist.get_world_size())
        if reports is not None:
            print_report(reports, args)
        dist.destroy_process_group()
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(spawned, args=(args, port), nprocs=WORLD)


if __name__ == "__main__":
    main()
