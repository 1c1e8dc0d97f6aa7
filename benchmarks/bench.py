"""shardkit next to torch's FSDP2, DDP and a plain local model: step time, collectives, memory.

    python benchmarks/bench.py [--quick] [--json PATH]      (or: make bench ARGS=--quick)

Part 1, distributed: 2 gloo ranks on the CPU (spawned by this script), one thread each. Every
rank builds the same GPT four times from one seed: sharded with shardkit, sharded with FSDP2,
wrapped in DDP, and plain ("local": no communication, each rank trains its own copy on its
own batch, so it feels the same CPU contention). All four use the same AdamW and see the same
batches. After a warm-up, the implementations take turns in interleaved rounds (the order
rotates each round), so slow drift of the machine hits them all alike. A round's number per
implementation is the median step time of the slower rank; the table shows the median over
rounds and the min..max, and the ratios are paired per round (shardkit / fsdp2 in the same
round) before taking their median. Collectives are counted over one extra step: shardkit by
its own trace, FSDP2 by wrapping the torch.distributed functions it calls, DDP from its
gradient buckets (its all-reduce runs in C++). Bytes are the logical buffer: all-gather output,
reduce-scatter input, all-reduce tensor. Peak RSS is the kernel's high-water mark over three
steps after resetting it; all four models live in one process, so every number includes the
others' parameters and state (the same baseline for all); compare differences, not totals.
How to read it: a ratio below 1 means shardkit is faster; a spread (min..max) that straddles
the other implementation's median means the difference is within this machine's noise.

Part 2, hook overhead: in this process on the fake process group (world 8, collectives return
at once and move nothing), a stack of tiny Linear blocks, one group each: a training step
(forward, backward, AdamW foreach step, zero_grad). What is left over the plain model is the
per-group cost of hooks, copies and bookkeeping. The "floor" row is what any eager FSDP must
pay, written out in this file with no hooks and no DTensor (class Floor): the plain step plus,
per block, the copy-in, all-gather and copy-out twice (forward, and again for backward) and
the padded gradient copy-in and reduce-scatter. shardkit/floor is the runtime's own cost.

Part 3, Muon (benchmarks/muon_bench.py): shardkit.optim.Muon's step on 8 sharded
Linear(256, 256) weights next to torch.optim.Muon on the same DTensors and on the unsharded
weights in one process, 2 gloo ranks: step time, collectives, and the largest difference from
the one-process parameters after 5 steps; then the same on HSDP 2 x 2 (4 ranks, 128-wide).
--quick: the 2-rank layout only, 128-wide.

    --muon      part 3 alone (the other flags go to muon_bench.py: --quick, --skip-hsdp, --json, ...)
    --skip-muon the parts before it only
    --compile   part 1 again with every block torch.compile'd, side by side with eager, and a
                fifth implementation: shardkit's compiled mode (shardkit.compiled.fully_shard, the
                whole model torch.compile'd with fullgraph=True: one graph, collectives in it)
    --scaling   how the cost grows with the world and the block count (benchmarks/scaling.py)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardkit
import shardkit.compiled
from shardkit.models import GPT, GPTConfig, apply_fully_shard

IMPLS = ("shardkit", "fsdp2", "ddp", "local")
COMPILED_MODE = "compiled"  # --compile: shardkit.compiled, the whole model in one graph
EAGER = "eager shardkit"  # --compile: shardkit with nothing compiled, in the same run
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
WORLD = 2
WARMUP_STEPS = 3
MEMORY_STEPS = 3
MiB = 1024 * 1024
# Flags left unset take their value from the preset: the default run, or --quick.
PRESETS = {
    "full": dict(layers=6, dim=192, heads=6, rounds=5, steps=8, overhead_blocks=48, overhead_rounds=15),
    "quick": dict(layers=4, dim=128, heads=4, rounds=3, steps=4, overhead_blocks=16, overhead_rounds=5),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run, under a minute on 2 cores")
    for name in ("layers", "dim", "heads", "rounds", "steps", "overhead-blocks", "overhead-rounds"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--vocab", type=int, default=65)
    parser.add_argument("--overhead-dim", type=int, default=64)
    parser.add_argument("--foreach", choices=("auto", "on", "off"), default="auto", help="AdamW foreach")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number here")
    parser.add_argument("--float8", action="store_true", help="the blocks' Linear layers as torchao float8 (1-byte all-gathers); needs torchao")
    parser.add_argument("--compile", action="store_true", help="run part 1 twice, eager and with every block torch.compile'd (inductor), side by side")
    parser.add_argument("--scaling", action="store_true", help="how the cost grows with the world and the model instead (benchmarks/scaling.py)")
    parser.add_argument("--muon", action="store_true", help="part 3 alone: shardkit.optim.Muon next to torch.optim.Muon (benchmarks/muon_bench.py)")
    parser.add_argument("--skip-muon", action="store_true")
    parser.add_argument("--only-overhead", action="store_true")
    parser.add_argument("--skip-overhead", action="store_true")
    args = parser.parse_args()
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def nbytes(t: torch.Tensor) -> int:
    """Bytes this rank holds for ``t``: its local shard for a DTensor."""
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def read_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])  # "VmHWM:   123456 kB"
    raise KeyError(field_name)


# ---------------------------------------------------------------- part 1: runs in each rank


@dataclass
class Impl:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps_done: int = 0  # picks the batch, so every implementation sees the same sequence
    last_loss: float = float("nan")


def build_impls(args: argparse.Namespace, mesh) -> dict[str, Impl]:
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.dim)
    torch.manual_seed(args.seed)
    base = GPT(config)  # deepcopy keeps the tied head/embedding weight tied
    if args.float8:  # torchao's float8 training, its weights all-gathered in float8 (as torchtitan does)
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        f8 = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(base, config=f8, module_filter_fn=lambda m, fqn: fqn.startswith("blocks."))
    models = {
        "shardkit": apply_fully_shard(copy.deepcopy(base), shardkit.fully_shard, mesh=mesh),
        "fsdp2": apply_fully_shard(copy.deepcopy(base), torch_fully_shard, mesh=mesh),
        "ddp": nn.parallel.DistributedDataParallel(copy.deepcopy(base)),
        "local": base,
    }
    if args.compile:
        compiled = apply_fully_shard(copy.deepcopy(base), shardkit.compiled.fully_shard, mesh=mesh)  # before base's blocks are
        eager = apply_fully_shard(copy.deepcopy(base), shardkit.fully_shard, mesh=mesh)
        for model in models.values():
            compile_blocks(model)
        models[COMPILED_MODE], models[EAGER] = torch.compile(compiled, fullgraph=True), eager
    foreach = {"auto": None, "on": True, "off": False}[args.foreach]
    return {name: Impl(name, m, torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=foreach)) for name, m in models.items()}


def compile_blocks(model: nn.Module) -> None:
    """--compile: torch.compile each block in place (after fully_shard for shardkit and FSDP2),
    the same compiled regions for every implementation; hooks and the root's own layers stay
    eager (docs/usage.md, "torch.compile"). The warm-up steps absorb the compile time."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    for i, block in enumerate(inner.blocks):
        inner.blocks[i] = torch.compile(block)


def impl_names(args: argparse.Namespace) -> tuple[str, ...]:
    return IMPLS + ((COMPILED_MODE, EAGER) if args.compile else ())


def make_batch(args: argparse.Namespace, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(args.seed + 1000 * dist.get_rank() + step)
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=generator)  # (B, T + 1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # inputs and next-token targets, (B, T) each


def train_step(impl: Impl, args: argparse.Namespace, probe=None) -> float:
    """One optimizer step on the implementation's next batch; returns its seconds."""
    x, y = make_batch(args, impl.steps_done)
    start = time.perf_counter()
    impl.optimizer.zero_grad(set_to_none=True)
    _, loss = impl.model(x, y)
    loss.backward()
    if probe:
        probe()
    impl.optimizer.step()
    seconds = time.perf_counter() - start
    impl.steps_done += 1
    impl.last_loss = loss.item()
    return seconds


def time_rounds(impls: dict[str, Impl], args: argparse.Namespace) -> torch.Tensor:
    """Step seconds, (rounds, impls, steps); the implementation order rotates every round."""
    names = impl_names(args)
    times = torch.zeros(args.rounds, len(names), args.steps, dtype=torch.float64)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            dist.barrier()
            for s in range(args.steps):
                times[r, names.index(name), s] = train_step(impls[name], args)
    return times


# The torch.distributed functions FSDP2 may call: name -> (kind, position and name of the whole buffer).
TORCH_COLLECTIVES = {
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),  # the pre-2.13 name
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),  # the pre-2.13 name
    "all_reduce": ("all_reduce", 0, "tensor"),
}


@contextlib.contextmanager
def counting_torch_collectives(counts: dict):
    """Count calls and buffer bytes of the torch.distributed collectives while active."""

    def counted(name, original):
        kind, position, keyword = TORCH_COLLECTIVES[name]

        def wrapper(*args, **kwargs):
            buffer = args[position] if len(args) > position else kwargs[keyword]
            counts[kind][0] += 1
            counts[kind][1] += nbytes(buffer)
            counts["functions"].add(name)
            return original(*args, **kwargs)
        return wrapper

    originals = {name: getattr(dist, name) for name in TORCH_COLLECTIVES if hasattr(dist, name)}
    for name, original in originals.items():
        setattr(dist, name, counted(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def count_collectives(impl: Impl, args: argparse.Namespace) -> dict:
    """{kind: [calls, bytes]} over one step, and the torch functions seen (FSDP2 only)."""
    counts = {kind: [0, 0] for kind in KINDS} | {"functions": set()}
    if impl.name in ("shardkit", EAGER):
        with shardkit.trace() as t:
            train_step(impl, args)
        for kind, stats in t.summary().items():
            counts[kind] = [stats.calls, stats.nbytes]
        counts["sent"] = sum(stats.wire_nbytes for stats in t.summary().values())
    elif impl.name == "fsdp2":
        with counting_torch_collectives(counts):
            train_step(impl, args)
    else:
        train_step(impl, args)
    if impl.name == "ddp":  # one all-reduce per gradient bucket, issued from C++: read the buckets instead
        data = impl.model._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes") or ""
        buckets = [int(size) for size in str(sizes).split(",") if size.strip()]
        counts["all_reduce"] = [len(buckets), sum(buckets)]
    if "sent" not in counts:  # ring algorithms: (w-1)/w of the buffer, twice for an all-reduce
        share = (WORLD - 1) / WORLD
        counts["sent"] = share * (counts["all_gather"][1] + counts["reduce_scatter"][1] + 2 * counts["all_reduce"][1])
    counts["functions"] = sorted(counts["functions"])
    return counts


def state_bytes(impl: Impl) -> int:
    """Parameters, gradients and optimizer state this rank holds."""
    params = list(impl.model.parameters())
    total = sum(nbytes(p) + (nbytes(p.grad) if p.grad is not None else 0) for p in params)
    for state in impl.optimizer.state.values():
        total += sum(nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def release_free_heap() -> None:
    """Return freed heap pages to the kernel: glibc keeps them, and they would hide each step's peak."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rss_mib(impl: Impl, args: argparse.Namespace) -> tuple[float, float]:
    """RSS before, and its high-water mark over a few steps (reset first, or sampled where we cannot)."""
    gc.collect()
    release_free_heap()
    dist.barrier()
    start = read_status_kib("VmRSS") / 1024
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        probe, samples = None, []
    except OSError:
        samples = [read_status_kib("VmRSS")]
        probe = lambda: samples.append(read_status_kib("VmRSS"))  # noqa: E731
    for _ in range(MEMORY_STEPS):
        train_step(impl, args, probe)
        if probe:
            probe()
    return start, (max(samples) if probe else read_status_kib("VmHWM")) / 1024


def rank_main(rank: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    impls = build_impls(args, init_device_mesh("cpu", (WORLD,)))
    for impl in impls.values():
        for _ in range(WARMUP_STEPS):
            train_step(impl, args)
    times = time_rounds(impls, args)
    names = impl_names(args)
    counts = {name: count_collectives(impls[name], args) for name in names}
    rss = torch.tensor([peak_rss_mib(impls[name], args) for name in names], dtype=torch.float64)  # (impls, 2)
    held = torch.tensor([state_bytes(impls[name]) for name in names], dtype=torch.float64)
    losses = torch.tensor([impls[name].last_loss for name in names], dtype=torch.float64)
    all_times = [torch.zeros_like(times) for _ in range(WORLD)]
    dist.all_gather(all_times, times)
    for tensor in (rss, held):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    dist.all_reduce(losses)  # summed; divided by WORLD below
    if rank == 0:
        result = summarize(args, impls["local"], all_times, counts)
        for i, name in enumerate(names):
            result["impls"][name].update(start_rss_mib=rss[i, 0].item(), peak_rss_mib=rss[i, 1].item(),
                                         held_mib_per_rank=held[i].item() / MiB, last_loss=losses[i].item() / WORLD)
        print_distributed(make_console(), result)
        with open(out_path, "w") as f:
            json.dump(result, f)
    # The sharded parameters hold the mesh, which holds the group: free them before destroying it.
    del impls
    gc.collect()
    dist.destroy_process_group()


def summarize(args: argparse.Namespace, local: Impl, all_times: list[torch.Tensor], counts: dict) -> dict:
    """Per round: the median step of each rank, then the slower rank; then medians over rounds."""
    round_ms = torch.stack([t.median(dim=2).values for t in all_times]).amax(dim=0) * 1000  # (rounds, impls)
    tokens = args.batch * args.seq * WORLD
    result = {"config": vars(args), "world": WORLD,
              "param_mib": sum(p.numel() * p.element_size() for p in local.model.parameters()) / MiB,
              "impls": {}, "ratios": {}}
    names = impl_names(args)
    for i, name in enumerate(names):
        ms = round_ms[:, i].tolist()
        result["impls"][name] = {
            "step_ms_per_round": ms, "step_ms": statistics.median(ms), "tokens_per_s": tokens / statistics.median(ms) * 1000,
            "step_s_per_rank_round_step": [t[:, i].tolist() for t in all_times],
            "collectives_per_step": {k: {"calls": c[0], "bytes": c[1]} for k, c in counts[name].items() if k in KINDS},
            "sent_bytes_per_rank_step": counts[name]["sent"],
            "torch_functions_called": counts[name]["functions"],
        }
    pairs = (("shardkit", "fsdp2"), ("shardkit", "ddp"), ("local", "ddp"))
    if args.compile:
        pairs += tuple((COMPILED_MODE, other) for other in (EAGER, "shardkit", "fsdp2", "ddp"))
    for a, b in pairs:
        per_round = (round_ms[:, names.index(a)] / round_ms[:, names.index(b)]).tolist()
        result["ratios"][f"{a}/{b}"] = {"per_round": per_round, "median": statistics.median(per_round)}
    return result


def make_console() -> Console:
    # Piped output (make bench | tee) would otherwise wrap the tables at 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=160)


def spread(values: list[float]) -> str:
    return f"{min(values):.3g}..{max(values):.3g}"


def print_distributed(console: Console, result: dict) -> None:
    c = result["config"]
    compiled = ", blocks torch.compile'd" if c.get("compile") else ""
    table = Table(title=f"GPT {c['layers']}x{c['dim']} (heads {c['heads']}){compiled}, {result['world']} gloo ranks, "
                        f"batch {c['batch']}x{c['seq']} per rank, {c['rounds']} rounds x {c['steps']} steps")
    for header in ("impl", "step ms\n(min..max rounds)", "tokens/s\n(global)", "peak RSS MiB\n(+ over start)",
                   "all-gather\n/step", "reduce-scatter\n/step", "all-reduce\n/step", "sent MiB\n/rank/step",
                   "param+grad+optim\nMiB/rank"):
        table.add_column(header, justify="right")
    for name, r in result["impls"].items():
        cells = [f"{s['calls']} x {s['bytes'] / MiB:.2f} MiB" if s["calls"] else "-"
                 for s in r["collectives_per_step"].values()]
        rss = f"{r['peak_rss_mib']:.0f} (+{r['peak_rss_mib'] - r['start_rss_mib']:.0f})"
        table.add_row(name, f"{r['step_ms']:.1f} ({spread(r['step_ms_per_round'])})", f"{r['tokens_per_s']:,.0f}",
                      rss, *cells, f"{r['sent_bytes_per_rank_step'] / MiB:.2f}", f"{r['held_mib_per_rank']:.2f}")
    console.print(table)
    console.print("ratios (median of paired per-round ratios, min..max): " + ", ".join(
        f"{k} {v['median']:.2f} ({spread(v['per_round'])})" for k, v in result["ratios"].items()))
    console.print(f"model fp32 parameters: {result['param_mib']:.2f} MiB. Expected per step: all-gather 2x that "
                  "(forward and backward, less any group kept unsharded), reduce-scatter 1x, all-reduce 1x.\n"
                  "Bytes: the logical buffer (all-gather output, reduce-scatter input); ddp: calls = gradient buckets.\n"
                  "Peak RSS: all four models share each process, so it includes the others' memory (same baseline).\n"
                  "param+grad+optim: what the optimizer sees; DDP also keeps its gradient buckets (1x parameters).\n"
                  "sent: bytes each rank puts on the wire (ring algorithms). On gloo shardkit reduce-scatters with an\n"
                  "all-to-all and a local sum (faster there, the same bytes; see docs/design.md).\n"
                  f"FSDP2 called: {', '.join(result['impls']['fsdp2']['torch_functions_called']) or 'nothing counted'}")
    losses = {name: r["last_loss"] for name, r in result["impls"].items()}
    console.print("last-step loss (mean over ranks): " + ", ".join(f"{k} {v:.5f}" for k, v in losses.items()))
    gap = abs(losses["shardkit"] - losses["fsdp2"]) / abs(losses["fsdp2"])
    if gap > 1e-3:
        console.print(f"[red]warning: shardkit and fsdp2 losses differ by {gap:.2e} relative (> 1e-3)[/]")


def run_distributed(args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(rank_main, args=(args, port, out_path), nprocs=WORLD)
        with open(out_path) as f:
            return json.load(f)


# ---------------------------------------------------------------- part 2: hook overhead, in this process


def tiny_stack(blocks: int, dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(blocks)))


# torch 2.13 deprecates the *_tensor names for these
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Floor:
    """What any eager FSDP must pay, written out with no hooks and no DTensor: the plain step
    (its parameters stay whole) plus, per block, the copies and collectives of a sharded one.
    Forward: copy the block's shards into one flat buffer, all-gather it, copy the result out
    into the parameters. Backward: the same all-gather again (parameters resharded after
    forward), then the gradients copied into one padded flat buffer and reduce-scattered.
    The fake process group moves nothing, so only the calls and the copies cost."""

    def __init__(self, model: nn.Sequential, world: int) -> None:
        self.model, self.world = model, world
        self.blocks = []
        for block in model:
            params = list(block.parameters())
            shards = [-(-p.numel() // world) for p in params]  # ceil: padded shard sizes
            self.blocks.append((params, shards, [torch.zeros(s) for s in shards]))

    def all_gather(self, params: list, shards: list, local: list) -> None:
        flat = torch.empty(sum(shards))
        torch._foreach_copy_(list(flat.split(shards)), local)  # copy-in
        out = torch.empty(flat.numel() * self.world)
        ALL_GATHER(out, flat)
        views = out.view(self.world, -1).split(shards, dim=1)  # copy-out, un-padding
        with torch.no_grad():
            for p, v in zip(params, views):
                p.view(-1).copy_(v.reshape(-1)[: p.numel()])

    def reduce_scatter(self, params: list, shards: list) -> None:
        grads = [p.grad.view(-1) for p in params]
        flat = torch._chunk_cat(grads, dim=0, num_chunks=self.world)  # padded copy-in
        out = torch.empty(sum(shards))
        REDUCE_SCATTER(out, flat.view(-1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for block, gathered in zip(self.model, self.blocks):
            self.all_gather(*gathered)
            x = block(x)
        return x

    def after_backward(self) -> None:
        for params, shards, local in reversed(self.blocks):
            self.all_gather(params, shards, local)
            self.reduce_scatter(params, shards)


def overhead_step_ms(model, optimizer: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(x).sum().backward()
        if isinstance(model, Floor):
            model.after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append((time.perf_counter() - start) * 1000)
    return times


def run_overhead(args: argparse.Namespace) -> dict:
    """A training step of tiny blocks on the fake process group: the per-group runtime cost."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the fake all-gather leaves buffers unwritten: keep junk floats cheap
    world = 8
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        models = {"plain": tiny_stack(args.overhead_blocks, args.overhead_dim)}
        models["floor"] = Floor(tiny_stack(args.overhead_blocks, args.overhead_dim), world)
        for name, shard in (("shardkit", shardkit.fully_shard), ("fsdp2", torch_fully_shard)):
            model = tiny_stack(args.overhead_blocks, args.overhead_dim)
            for block in model:
                shard(block, mesh=mesh)
            models[name] = shard(model, mesh=mesh)
        params = {name: (m.model if isinstance(m, Floor) else m).parameters() for name, m in models.items()}
        optimizers = {name: torch.optim.AdamW(p, lr=1e-3, foreach=True) for name, p in params.items()}
        x = torch.randn(8, args.overhead_dim)  # (batch, dim)
        rounds = {name: [] for name in models}  # per round, the median of its steps
        for name, model in models.items():
            overhead_step_ms(model, optimizers[name], x, 5)  # warm-up
        for _ in range(args.overhead_rounds):  # short interleaved rounds: drift hits every model alike
            for name, model in models.items():
                rounds[name].append(statistics.median(overhead_step_ms(model, optimizers[name], x, 5)))
        del models, model, optimizers, params
        gc.collect()
    finally:
        dist.destroy_process_group()
    ms = {name: statistics.median(t) for name, t in rounds.items()}
    ratios = {}  # paired per round, then the median: this shared machine's speed drifts within seconds
    for a, b in (("shardkit", "floor"), ("shardkit", "fsdp2"), ("floor", "plain"), ("fsdp2", "floor")):
        per_round = [x / y for x, y in zip(rounds[a], rounds[b])]
        ratios[f"{a}/{b}"] = statistics.median(per_round)
        ratios[f"{a}/{b} spread"] = (min(per_round), max(per_round))
    return {"world": world, "blocks": args.overhead_blocks, "dim": args.overhead_dim,
            "step_ms": ms, "step_ms_per_round": rounds, "ratios": ratios}


def print_overhead(console: Console, result: dict) -> None:
    table = Table(title=f"hook overhead (fake PG, world {result['world']})")
    table.add_column("impl")
    table.add_column("median step ms", justify="right")
    table.add_column("per group us", justify="right")
    plain = result["step_ms"]["plain"]
    for name, ms in result["step_ms"].items():
        per_group = "-" if name == "plain" else f"{(ms - plain) * 1000 / (result['blocks'] + 1):.0f}"
        table.add_row(name, f"{ms:.2f}", per_group)
    console.print(table)
    console.print(f"{result['blocks']} blocks of Linear({result['dim']}, {result['dim']}) + ReLU, one group each, plus the root; "
                  "a step is forward, backward, AdamW (foreach) step, zero_grad.\n"
                  "floor: the plain step plus, per block, the copies and collectives of a sharded one, no hooks (class Floor).")
    ratios = result["ratios"]
    console.print("ratios (median of paired per-round ratios, min..max): " + ", ".join(
        f"{k} {v:.2f} ({spread(ratios[k + ' spread'])})" for k, v in ratios.items() if not k.endswith("spread")))


def print_compiled(console: Console, eager: dict, compiled: dict) -> None:
    table = Table(title="--compile: step ms, eager and compiled (blocks torch.compile'd; compiled mode: the whole model)")
    for header in ("impl", "eager run", "compiled run", "compiled / eager run", "/ eager shardkit\n(compiled run)"):
        table.add_column(header, justify="right")
    eager_shardkit = compiled["impls"][EAGER]["step_ms"]  # the same run: the same machine state
    for name in (*IMPLS, COMPILED_MODE, EAGER):
        b = compiled["impls"][name]["step_ms"]
        same = "shardkit" if name == EAGER else name
        a = eager["impls"][same]["step_ms"] if same in eager["impls"] else None
        table.add_row(name, "-" if a is None else f"{a:.1f}", f"{b:.1f}", "-" if a is None else f"{b / a:.2f}", f"{b / eager_shardkit:.2f}")
    console.print(table)
    console.print("compiled ratios: " + ", ".join(f"{k} {v['median']:.2f}" for k, v in compiled["ratios"].items()))


def main() -> int:
    if "--muon" in sys.argv[1:]:  # before our parser: muon_bench.py has flags of its own
        import muon_bench  # benchmarks/muon_bench.py, next to this file

        return muon_bench.main([a for a in sys.argv[1:] if a != "--muon"])
    args = parse_args()
    if args.scaling:
        import scaling  # benchmarks/scaling.py, next to this file

        return scaling.main([a for a in sys.argv[1:] if a != "--scaling"])
    console = make_console()
    start = time.perf_counter()
    results = {}
    if not args.only_overhead:
        compile_too, args.compile = args.compile, False
        results["distributed"] = run_distributed(args)  # the ranks print their table
        if compile_too:
            args.compile = True
            results["compiled"] = run_distributed(args)
            print_compiled(console, results["distributed"], results["compiled"])
    if not args.skip_overhead:
        results["overhead"] = run_overhead(args)  # after the ranks have exited: no gloo group here
        print_overhead(console, results["overhead"])
    if not (args.skip_muon or args.only_overhead):
        import muon_bench  # part 3, in its own ranks

        results["muon"] = muon_bench.run(muon_bench.parse_args(["--quick", "--skip-hsdp"] if args.quick else []), console)
    console.print(f"wall time {time.perf_counter() - start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
