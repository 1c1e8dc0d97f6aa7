"""shardkit next to torch's FSDP2, DDP and a plain local model: step time, collectives, memory.

    python benchmarks/bench.py [--quick] [--json PATH]      (or: make bench ARGS=--quick)
    python benchmarks/bench.py --compile [--quick]          (or: make bench ARGS="--compile --quick")

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

Part 4, compiled mode (--compile, alone; --quick: the small model, 3 rounds x 4 steps, under two
minutes on 2 cores): the same GPT seven ways on 2 gloo ranks, in interleaved rounds as in part 1:
  compiled mode            shardkit.compiled.fully_shard on each block then the root, then
                           torch.compile(model, fullgraph=True) (inductor): one graph, collectives in it
  compiled, no overlap pass  the same, compiled with torch.compile(..., options=
                           {"reorder_for_compute_comm_overlap": False}): inductor's own order of the
                           collectives (each waited for where it is issued), for what the overlap gives
  eager shardkit           shardkit.fully_shard, nothing compiled
  fsdp2                    torch's FSDP2, nothing compiled
  fsdp2 + compiled blocks  FSDP2, then torch.compile on each block (compile_blocks); hooks stay eager
  unsharded                the plain model, eager
  unsharded compiled       the plain model, torch.compile(model, fullgraph=True)
The two unsharded ones ("on one process") run inside each rank, like part 1's local: each rank
its own copy on its own batch, no communication, the same CPU contention and per-rank batch as
the sharded ones. Inductor's caches are off: fx_graph_cache and the autograd cache disabled, and
every implementation's first step runs in a fresh cache directory of its own rank with inductor's
in-memory caches cleared (torch._inductor.utils.fresh_cache), so no model reuses kernels another
model (or the other rank) compiled; a tiny model is compiled first, so the one-time costs
(imports, the C++ toolchain probe, the compile workers) fall on none of them. Per implementation:
  step ms       part 1's: per round the median step of the slower rank, then the median over rounds;
  first step s  the wall time of the first forward + backward (compilation included: dynamo,
                inductor and the C++ compiler, backward's graph too), both ranks starting together,
                the slower rank's; "graphs" is how many graphs dynamo compiled in it;
  peak MiB      per rank (the larger): parameters and optimizer state at the start of a step
                (gradients set to None) plus the most the step allocates above that, from the
                CPU profiler's allocation events (every c10 CPU allocation, inductor's buffers
                included; not gloo's internal scratch); the median of 3 steps. A number per
                implementation, unlike part 1's RSS.
The ratios the compiled mode's goals are stated in (paired per round, then the median):
what sharding adds in compiled mode = compiled mode / unsharded compiled (goal: <= 1.05, and no
more than in eager mode), in eager mode = eager shardkit / unsharded; and the compile time of
compiled mode / unsharded compiled (one sample per run; goal <= 0.6).

    --compile   part 4 alone (with --quick: the small model and few rounds)
    --regions N with --compile: compiled mode's blocks as nested compile regions from N blocks of
                one structure (shardkit/compiled/region.py; 1: always). Regions turn inductor's
                buffer reuse and in-place buffers off for the whole process: every row of that run compiles without it
    --muon      part 3 alone (the other flags go to muon_bench.py: --quick, --skip-hsdp, --json, ...)
    --skip-muon the parts before it only
    --scaling   how the cost grows with the world and the block count (benchmarks/scaling.py)
    --ft        torchft: a death's stall and heal time, the step with torchft against without
                (benchmarks/ft_bench.py, its own flags: --rounds, --steps, --json)
    --compile-time  compiled mode's compile time at 4 and 32 blocks, with and without regions
                (benchmarks/compile_time.py, its own flags: --layers, --dim, --seq, --json)
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
# Part 4 (--compile): the seven implementations, in the order of its table.
COMPILED_MODE = "compiled mode"  # shardkit.compiled.fully_shard + torch.compile(model, fullgraph=True)
NO_OVERLAP = "compiled, no overlap pass"  # the same, inductor without shardkit.compiled.overlap's pass
EAGER = "eager shardkit"  # shardkit.fully_shard, nothing compiled
FSDP2 = "fsdp2"  # torch's FSDP2, nothing compiled
FSDP2_BLOCKS = "fsdp2 + compiled blocks"  # FSDP2, each block torch.compile'd after fully_shard
UNSHARDED = "unsharded"  # the plain model, each rank its own copy
UNSHARDED_COMPILED = "unsharded compiled"  # the same, torch.compile(model, fullgraph=True)
COMPILE_IMPLS = (COMPILED_MODE, NO_OVERLAP, EAGER, FSDP2, FSDP2_BLOCKS, UNSHARDED, UNSHARDED_COMPILED)
SHARDED = (COMPILED_MODE, NO_OVERLAP, EAGER, FSDP2, FSDP2_BLOCKS)  # the same weights and batches: their losses agree
# Each implementation's reference for "what sharding adds": the unsharded model in the same mode.
SAME_MODE_UNSHARDED = {COMPILED_MODE: UNSHARDED_COMPILED, NO_OVERLAP: UNSHARDED_COMPILED, FSDP2_BLOCKS: UNSHARDED_COMPILED, UNSHARDED_COMPILED: UNSHARDED_COMPILED,
                       EAGER: UNSHARDED, FSDP2: UNSHARDED, UNSHARDED: UNSHARDED}
SHARDING_COST_GOAL = 1.05  # compiled mode / unsharded compiled, and at most eager shardkit / unsharded
COMPILE_TIME_GOAL = 0.6  # compiled mode's first step / unsharded compiled's
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
    parser.add_argument("--compile", action="store_true", help="part 4 alone: compiled mode next to eager shardkit, FSDP2 (eager and with "
                        "compiled blocks) and the unsharded model (eager and compiled): step time, compile time, peak memory")
    parser.add_argument("--regions", type=int, default=None, metavar="N", help="--compile: compiled mode runs blocks of one structure as "
                        "nested compile regions from N of them (shardkit.compiled.region.REGIONS_FROM; default: its own)")
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


def base_model(args: argparse.Namespace) -> GPT:
    """The GPT every implementation copies (deepcopy keeps the tied head/embedding weight tied)."""
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.dim)
    torch.manual_seed(args.seed)
    return GPT(config)


def with_optimizers(args: argparse.Namespace, models: dict[str, nn.Module]) -> dict[str, Impl]:
    foreach = {"auto": None, "on": True, "off": False}[args.foreach]
    return {name: Impl(name, m, torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=foreach)) for name, m in models.items()}


def float8_if_asked(args: argparse.Namespace, base: GPT) -> GPT:
    """--float8: torchao's float8 training on the blocks' Linear layers, their weights
    all-gathered in float8 (as torchtitan does)."""
    if args.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        f8 = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(base, config=f8, module_filter_fn=lambda m, fqn: fqn.startswith("blocks."))
    return base


def build_impls(args: argparse.Namespace, mesh) -> dict[str, Impl]:
    base = float8_if_asked(args, base_model(args))
    models = {
        "shardkit": apply_fully_shard(copy.deepcopy(base), shardkit.fully_shard, mesh=mesh),
        "fsdp2": apply_fully_shard(copy.deepcopy(base), torch_fully_shard, mesh=mesh),
        "ddp": nn.parallel.DistributedDataParallel(copy.deepcopy(base)),
        "local": base,
    }
    return with_optimizers(args, models)


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
    """Step seconds, (rounds, impls, steps), in the order of ``impls``; the order they run in rotates every round."""
    names = tuple(impls)
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
    if impl.name == "shardkit":
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
        counts["buckets"] = buckets
    if "sent" not in counts:  # ring algorithms: (w-1)/w of the buffer, twice for an all-reduce
        share = (WORLD - 1) / WORLD
        counts["sent"] = share * (counts["all_gather"][1] + counts["reduce_scatter"][1] + 2 * counts["all_reduce"][1])
    counts["functions"] = sorted(counts["functions"])
    return counts


def replay_ms(calls: list[tuple[str, int, torch.dtype, str]], repeats: int) -> float:
    """Median milliseconds of issuing ``calls`` ((kind, numel, dtype, detail) of the whole buffer)
    one after another with plain torch.distributed calls and nothing else: the communication
    alone. A reduce-scatter "via all_to_all" is an all-to-all and the sum of its chunks, as
    shardkit does it on gloo."""
    buffers = [(kind, torch.ones(numel, dtype=dtype), detail) for kind, numel, dtype, detail in calls]
    shards = [torch.empty(b.numel() // WORLD, dtype=b.dtype) for _, b, _ in buffers]
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for (kind, buffer, detail), shard in zip(buffers, shards):
            if kind == "all_gather":
                dist.all_gather_into_tensor(buffer, shard)
            elif kind == "all_reduce":
                dist.all_reduce(buffer)
            elif detail == "via all_to_all":
                received = torch.empty_like(buffer)
                dist.all_to_all_single(received, buffer)
                torch.sum(received.view(WORLD, -1), dim=0, out=shard)
            else:
                dist.reduce_scatter_tensor(shard, buffer)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def communication(impls: dict[str, Impl], args: argparse.Namespace, counts: dict) -> torch.Tensor:
    """This rank's [shardkit's collectives alone, DDP's all-reduces alone, shardkit's exposed
    wait] in ms: shardkit's step's collectives (from its trace, the same buffers) and DDP's
    gradient buckets replayed with no compute, and how long shardkit's hooks waited on them in a
    step (the trace's exposed time, the median of ``args.steps`` steps)."""
    exposed = []
    for _ in range(args.steps):
        with shardkit.trace() as t:
            train_step(impls["shardkit"], args)
        exposed.append(sum(e.exposed_ns for e in t.collectives()) / 1e6)
    fsdp = [(e.kind, e.numel, e.dtype, e.detail) for e in t.collectives() if e.kind in KINDS]
    ddp = [("all_reduce", n // 4, torch.float32, "") for n in counts["ddp"]["buckets"]]  # DDP's buckets are fp32 here
    repeats = max(5, args.rounds * 2)
    return torch.tensor([replay_ms(fsdp, repeats), replay_ms(ddp, repeats), statistics.median(exposed)], dtype=torch.float64)


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


def rank_entry(rank: int, body, args: argparse.Namespace, port: int, out_path: str) -> None:
    """A spawned rank: one thread, a gloo group, ``body(args, mesh)``; rank 0 writes its result."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result = body(args, init_device_mesh("cpu", (WORLD,)))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    # The sharded parameters (freed with body's frame) hold the mesh, which holds the group: collect them first.
    gc.collect()
    dist.destroy_process_group()


def run_ranks(body, args: argparse.Namespace) -> dict:
    """Run ``body`` on WORLD spawned gloo ranks; rank 0's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(rank_entry, args=(body, args, port, out_path), nprocs=WORLD)
        with open(out_path) as f:
            return json.load(f)



def over_ranks(gathered: tuple, maxed: tuple, summed: tuple) -> list[list[torch.Tensor]]:
    """Every rank's copy of each ``gathered`` tensor; ``maxed`` and ``summed`` reduced in place
    over the ranks (the largest, the sum)."""
    copies = []
    for tensor in gathered:
        copies.append([torch.zeros_like(tensor) for _ in range(WORLD)])
        dist.all_gather(copies[-1], tensor)
    for tensor in maxed:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    for tensor in summed:
        dist.all_reduce(tensor)
    return copies

def distributed_rank(args: argparse.Namespace, mesh) -> dict | None:
    """Part 1 in one rank: warm-up, timed rounds, collectives, memory; the summary on rank 0."""
    impls = build_impls(args, mesh)
    for impl in impls.values():
        for _ in range(WARMUP_STEPS):
            train_step(impl, args)
    times = time_rounds(impls, args)
    names = tuple(impls)
    counts = {name: count_collectives(impls[name], args) for name in names}
    rss = torch.tensor([peak_rss_mib(impls[name], args) for name in names], dtype=torch.float64)  # (impls, 2)
    held = torch.tensor([state_bytes(impls[name]) for name in names], dtype=torch.float64)
    losses = torch.tensor([impls[name].last_loss for name in names], dtype=torch.float64)
    comm = communication(impls, args, counts)  # (shardkit trains on: after its loss is read)
    (all_times,) = over_ranks(gathered=(times,), maxed=(rss, held, comm), summed=(losses,))  # losses divided by WORLD below
    if dist.get_rank() != 0:
        return None
    result = summarize(args, impls["local"], all_times, counts)
    result["communication"] = next_to_ddp(result, *comm.tolist())
    for i, name in enumerate(names):
        result["impls"][name].update(start_rss_mib=rss[i, 0].item(), peak_rss_mib=rss[i, 1].item(),
                                     held_mib_per_rank=held[i].item() / MiB, last_loss=losses[i].item() / WORLD)
    return result


def slower_rank_round_ms(all_times: list[torch.Tensor]) -> torch.Tensor:
    """(rounds, impls) milliseconds: per round the median step of each rank, then the slower rank."""
    return torch.stack([t.median(dim=2).values for t in all_times]).amax(dim=0) * 1000


def paired_ratio(round_ms: torch.Tensor, names: tuple[str, ...], a: str, b: str) -> dict:
    """a / b paired round by round (the same machine state), then the median."""
    per_round = (round_ms[:, names.index(a)] / round_ms[:, names.index(b)]).tolist()
    return {"per_round": per_round, "median": statistics.median(per_round)}


def summarize(args: argparse.Namespace, local: Impl, all_times: list[torch.Tensor], counts: dict) -> dict:
    """Per round: the median step of each rank, then the slower rank; then medians over rounds."""
    round_ms = slower_rank_round_ms(all_times)  # (rounds, impls)
    tokens = args.batch * args.seq * WORLD
    result = {"config": vars(args), "world": WORLD,
              "param_mib": sum(p.numel() * p.element_size() for p in local.model.parameters()) / MiB,
              "impls": {}, "ratios": {}}
    names = IMPLS
    for i, name in enumerate(names):
        ms = round_ms[:, i].tolist()
        result["impls"][name] = {
            "step_ms_per_round": ms, "step_ms": statistics.median(ms), "tokens_per_s": tokens / statistics.median(ms) * 1000,
            "step_s_per_rank_round_step": [t[:, i].tolist() for t in all_times],
            "collectives_per_step": {k: {"calls": c[0], "bytes": c[1]} for k, c in counts[name].items() if k in KINDS},
            "sent_bytes_per_rank_step": counts[name]["sent"],
            "torch_functions_called": counts[name]["functions"],
        }
    for a, b in (("shardkit", "fsdp2"), ("shardkit", "ddp"), ("local", "ddp")):
        result["ratios"][f"{a}/{b}"] = paired_ratio(round_ms, names, a, b)
    return result


def next_to_ddp(result: dict, fsdp_ms: float, ddp_ms: float, exposed_ms: float) -> dict:
    """What shardkit's step pays over DDP's, and the floor here: DDP's step plus the
    communication FSDP adds over DDP's (its collectives alone less DDP's all-reduces alone, the
    slower rank's), none of it hidden. On 2 gloo ranks on 2 cores the ranks' compute holds the
    cores gloo's threads need, so communication hides little; the floor assumes FSDP hides as
    much of its communication as DDP does of its own, and nothing more."""
    step = {name: r["step_ms"] for name, r in result["impls"].items()}
    floor_ms = step["ddp"] + fsdp_ms - ddp_ms
    return {"fsdp_comm_alone_ms": fsdp_ms, "ddp_comm_alone_ms": ddp_ms, "shardkit_exposed_ms": exposed_ms,
            "floor_ms": floor_ms, "floor/ddp": floor_ms / step["ddp"], "shardkit/floor": step["shardkit"] / floor_ms,
            "shardkit_over_local_ms": step["shardkit"] - step["local"], "ddp_over_local_ms": step["ddp"] - step["local"]}


def make_console() -> Console:
    # Piped output (make bench | tee) would otherwise wrap the tables at 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=160)


def spread(values: list[float]) -> str:
    return f"{min(values):.3g}..{max(values):.3g}"


def print_distributed(console: Console, result: dict) -> None:
    c = result["config"]
    table = Table(title=f"GPT {c['layers']}x{c['dim']} (heads {c['heads']}), {result['world']} gloo ranks, "
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
    c = result["communication"]
    console.print(f"next to DDP (issue 56 part 3; ms, the slower rank): collectives alone, replayed with nothing else: "
                  f"shardkit's {c['fsdp_comm_alone_ms']:.2f}, DDP's all-reduces {c['ddp_comm_alone_ms']:.2f}; shardkit's hooks waited "
                  f"{c['shardkit_exposed_ms']:.2f} of a step; over local: shardkit {c['shardkit_over_local_ms']:.2f}, "
                  f"DDP {c['ddp_over_local_ms']:.2f}.\nfloor (DDP's step + the communication FSDP adds, unhidden) "
                  f"{c['floor_ms']:.2f} ms = {c['floor/ddp']:.2f}x DDP; shardkit/floor {c['shardkit/floor']:.2f}")
    losses = {name: r["last_loss"] for name, r in result["impls"].items()}
    console.print("last-step loss (mean over ranks): " + ", ".join(f"{k} {v:.5f}" for k, v in losses.items()))
    gap = abs(losses["shardkit"] - losses["fsdp2"]) / abs(losses["fsdp2"])
    if gap > 1e-3:
        console.print(f"[red]warning: shardkit and fsdp2 losses differ by {gap:.2e} relative (> 1e-3)[/]")


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


# ---------------------------------------------------------------- part 4 (--compile): compiled mode, in each rank


def compile_blocks(model: nn.Module) -> nn.Module:
    """torch.compile each block in place, after fully_shard: the hooks and the root's own layers
    stay eager (docs/usage.md, "torch.compile")."""
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block)
    return model


def build_compile_impls(args: argparse.Namespace, mesh) -> dict[str, Impl]:
    """Part 4's seven copies of one GPT, in COMPILE_IMPLS order (the order they compile in); nothing
    compiles before its first step."""
    base = float8_if_asked(args, base_model(args))
    if args.regions is not None:
        shardkit.compiled.region.REGIONS_FROM = args.regions

    def sharded(fully_shard) -> nn.Module:
        return apply_fully_shard(copy.deepcopy(base), fully_shard, mesh=mesh)

    models = {
        COMPILED_MODE: torch.compile(sharded(shardkit.compiled.fully_shard), fullgraph=True),
        NO_OVERLAP: torch.compile(sharded(shardkit.compiled.fully_shard), fullgraph=True, options={"reorder_for_compute_comm_overlap": False}),
        EAGER: sharded(shardkit.fully_shard),
        FSDP2: sharded(torch_fully_shard),
        FSDP2_BLOCKS: compile_blocks(sharded(torch_fully_shard)),
        UNSHARDED: copy.deepcopy(base),
        UNSHARDED_COMPILED: torch.compile(base, fullgraph=True),
    }
    return with_optimizers(args, {name: models[name] for name in COMPILE_IMPLS})


def inductor_caches_off() -> str:
    """No compiled graph from a cache, on disk or in this process: the FX graph and autograd caches
    off, and a cache directory of this rank's own (under the run's fresh one), so that neither rank
    loads a kernel the other compiled. Returns that directory."""
    import torch._functorch.config
    import torch._inductor.config

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    root = os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], f"rank{dist.get_rank()}")
    os.makedirs(root, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = root
    return root


def dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def warm_up_inductor(cache_root: str) -> None:
    """Compile a tiny model, forward and backward, so that what only a process's first compile pays
    (importing inductor, probing the C++ compiler, starting the compile workers) falls on none of
    the measured ones."""
    from torch._inductor.utils import fresh_cache

    tiny = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8)))
    with fresh_cache(dir=cache_root, delete=False):
        tiny(torch.randn(2, 8)).sum().backward()


def first_step(impl: Impl, args: argparse.Namespace, cache_root: str) -> float:
    """The implementation's first step, its forward + backward timed (compilation included), in a
    fresh inductor cache (a new directory, the in-memory caches cleared), both ranks starting together."""
    from torch._inductor.utils import fresh_cache

    x, y = make_batch(args, impl.steps_done)
    with fresh_cache(dir=cache_root, delete=False):
        dist.barrier()
        start = time.perf_counter()
        _, loss = impl.model(x, y)
        loss.backward()
        seconds = time.perf_counter() - start
    impl.optimizer.step()
    impl.steps_done += 1
    impl.last_loss = loss.item()
    return seconds


@contextlib.contextmanager
def without_profiler_banner():
    """The CPU profiler's C++ side prints two "USDT: ... profiler_start/stop" lines to stderr per
    run: hold this process's stderr back meanwhile, then pass on every other line."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            lines = held.read().decode(errors="replace").splitlines(keepends=True)
            sys.stderr.write("".join(line for line in lines if not line.startswith("USDT:")))
            sys.stderr.flush()


def step_memory(impl: Impl, args: argparse.Namespace) -> tuple[int, int, int]:
    """Bytes of one step: parameters and optimizer state at its start (gradients set to None), the
    most the step allocates above that (the CPU profiler's allocation events, in time order: every
    c10 CPU allocation and free, inductor's buffers included), and their sum, the step's peak.
    (Tensor bytes, not RSS: no allocator slack, code, or what gloo allocates outside torch.)"""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    impl.optimizer.zero_grad(set_to_none=True)  # train_step's own zero_grad then frees nothing
    held = state_bytes(impl)
    gc.collect()
    dist.barrier()
    with without_profiler_banner(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(impl, args)
    events, allocations = list(prof.profiler.kineto_results.experimental_event_tree()), []
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.tag == _EventType.Allocation:  # a free is one of minus its size
            allocations.append((event.start_time_ns, event.extra_fields.alloc_size))
    live = above = 0
    for _, size in sorted(allocations):
        live += size
        above = max(above, live)
    return held, above, held + above


def compile_rank(args: argparse.Namespace, mesh) -> dict | None:
    """Part 4 in one rank: per implementation in turn its first step (the compilation) and the rest
    of its warm-up; then the timed rounds and one step's memory each; the summary on rank 0."""
    cache_root = inductor_caches_off()
    impls = build_compile_impls(args, mesh)
    warm_up_inductor(cache_root)
    first = torch.zeros(len(impls), 2, dtype=torch.float64)  # (impls, [first-step seconds, dynamo graphs in the warm-up])
    for i, impl in enumerate(impls.values()):
        graphs = dynamo_graphs()
        first[i, 0] = first_step(impl, args, cache_root)
        for _ in range(WARMUP_STEPS - 1):
            train_step(impl, args)
        first[i, 1] = dynamo_graphs() - graphs
    graphs = dynamo_graphs()
    times = time_rounds(impls, args)
    # Each implementation's step memory, in MEMORY_STEPS interleaved rounds; the median: now and then one
    # of them allocates ~0.75 MiB more in a step, a different one each run.
    samples = torch.tensor([[step_memory(impl, args) for impl in impls.values()] for _ in range(MEMORY_STEPS)], dtype=torch.float64)
    memory = samples.median(dim=0).values  # (impls, 3)
    late = torch.tensor([dynamo_graphs() - graphs], dtype=torch.float64)  # compiled after the warm-up: recompiles
    losses = torch.tensor([impl.last_loss for impl in impls.values()], dtype=torch.float64)
    all_times, all_first = over_ranks(gathered=(times, first), maxed=(memory, late), summed=(losses,))  # losses divided by WORLD below
    if dist.get_rank() != 0:
        return None
    return summarize_compile(args, tuple(impls), all_times, all_first, memory, losses, int(late.item()))


def summarize_compile(args: argparse.Namespace, names: tuple[str, ...], all_times: list[torch.Tensor], all_first: list[torch.Tensor],
                      memory: torch.Tensor, losses: torch.Tensor, late_graphs: int) -> dict:
    """The tensors' implementation axis is ``names``; the ratios pair rounds, the compile time is the slower rank's."""
    round_ms = slower_rank_round_ms(all_times)  # (rounds, impls)
    result = {"config": vars(args), "world": WORLD, "impls": {}, "ratios": {}, "goals": {},
              "dynamo_graphs_after_warmup": late_graphs}
    for i, name in enumerate(names):
        ms, first_s = round_ms[:, i].tolist(), [f[i, 0].item() for f in all_first]
        result["impls"][name] = {
            "step_ms_per_round": ms, "step_ms": statistics.median(ms),
            "step_s_per_rank_round_step": [t[:, i].tolist() for t in all_times],
            "first_step_s": max(first_s), "first_step_s_per_rank": first_s,
            "dynamo_graphs_warmup": int(all_first[0][i, 1].item()),
            "held_mib": memory[i, 0].item() / MiB, "step_above_start_mib": memory[i, 1].item() / MiB,
            "peak_mib": memory[i, 2].item() / MiB, "last_loss": losses[i].item() / WORLD,
        }
    for name in names:
        if name != SAME_MODE_UNSHARDED[name]:
            result["ratios"][f"{name}/{SAME_MODE_UNSHARDED[name]}"] = paired_ratio(round_ms, names, name, SAME_MODE_UNSHARDED[name])
    for a, b in ((COMPILED_MODE, NO_OVERLAP), (COMPILED_MODE, EAGER), (COMPILED_MODE, FSDP2_BLOCKS), (COMPILED_MODE, FSDP2), (EAGER, FSDP2), (UNSHARDED_COMPILED, UNSHARDED)):
        result["ratios"][f"{a}/{b}"] = paired_ratio(round_ms, names, a, b)
    compiled, eager = result["ratios"][f"{COMPILED_MODE}/{UNSHARDED_COMPILED}"], result["ratios"][f"{EAGER}/{UNSHARDED}"]
    per_rank = [f[names.index(COMPILED_MODE), 0].item() / f[names.index(UNSHARDED_COMPILED), 0].item() for f in all_first]
    compile_time = result["impls"][COMPILED_MODE]["first_step_s"] / result["impls"][UNSHARDED_COMPILED]["first_step_s"]
    result["goals"] = {
        "sharding_cost_compiled": {"what": f"step time, {COMPILED_MODE} / {UNSHARDED_COMPILED}", **compiled,
                                   "goal": f"<= {SHARDING_COST_GOAL} and <= sharding_cost_eager",
                                   "met": compiled["median"] <= min(SHARDING_COST_GOAL, eager["median"])},
        "sharding_cost_eager": {"what": f"step time, {EAGER} / {UNSHARDED}", **eager, "goal": None, "met": None},
        "compile_time": {"what": f"first forward + backward (slower rank), {COMPILED_MODE} / {UNSHARDED_COMPILED}",
                         "median": compile_time, "per_rank": per_rank, "goal": f"<= {COMPILE_TIME_GOAL}",
                         "met": compile_time <= COMPILE_TIME_GOAL},
    }
    return result


def run_compile(args: argparse.Namespace) -> dict:
    """Part 4 on WORLD spawned ranks, inductor's caches off and its cache directory a fresh one."""
    with tempfile.TemporaryDirectory(prefix="bench-inductor-") as cache_dir:
        env = dict(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0", TORCHINDUCTOR_CACHE_DIR=cache_dir)
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)  # the ranks inherit it (and set the configs themselves)
        try:
            return run_ranks(compile_rank, args)
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def print_compile(console: Console, result: dict) -> None:
    c, impls = result["config"], result["impls"]
    table = Table(title=f"--compile: GPT {c['layers']}x{c['dim']} (heads {c['heads']}), {result['world']} gloo ranks, "
                        f"batch {c['batch']}x{c['seq']} per rank, {c['rounds']} rounds x {c['steps']} steps; inductor, caches off")
    for header in ("impl", "step ms\n(min..max rounds)", "/ unsharded\n(same mode)", "first fwd+bwd s\n(compile)",
                   "dynamo graphs\n(warm-up)", "peak MiB/rank\n(state + step)", "last loss"):
        table.add_column(header, justify="right")
    for name, r in impls.items():
        ref = SAME_MODE_UNSHARDED[name]
        ratio = "-" if name == ref else f"{result['ratios'][f'{name}/{ref}']['median']:.3f}"
        table.add_row(name, f"{r['step_ms']:.1f} ({spread(r['step_ms_per_round'])})", ratio, f"{r['first_step_s']:.2f}",
                      str(r["dynamo_graphs_warmup"]), f"{r['peak_mib']:.1f} ({r['held_mib']:.1f} + {r['step_above_start_mib']:.1f})",
                      f"{r['last_loss']:.5f}")
    console.print(table)
    goals = Table(title="compiled mode's goals (issue 30): ratios, not times, are what this machine measures")
    for header in ("ratio", "measured\n(min..max)", "goal", "met"):
        goals.add_column(header, justify="right")
    g = result["goals"]
    mark = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}
    goals.add_row(f"what sharding adds, compiled mode\n({COMPILED_MODE} / {UNSHARDED_COMPILED}, step)",
                  f"{g['sharding_cost_compiled']['median']:.3f} ({spread(g['sharding_cost_compiled']['per_round'])})",
                  f"<= {SHARDING_COST_GOAL} and <= eager mode's", mark[g["sharding_cost_compiled"]["met"]])
    goals.add_row(f"what sharding adds, eager mode\n({EAGER} / {UNSHARDED}, step)",
                  f"{g['sharding_cost_eager']['median']:.3f} ({spread(g['sharding_cost_eager']['per_round'])})", "-", "-")
    goals.add_row(f"compile time\n({COMPILED_MODE} / {UNSHARDED_COMPILED}, first fwd+bwd)",
                  f"{g['compile_time']['median']:.2f} (ranks {spread(g['compile_time']['per_rank'])})",
                  f"<= {COMPILE_TIME_GOAL}", mark[g["compile_time"]["met"]])
    console.print(goals)
    console.print("other ratios (step time, median of paired per-round ratios, min..max): " + ", ".join(
        f"{k} {v['median']:.2f} ({spread(v['per_round'])})" for k, v in result["ratios"].items()
        if k not in (f"{COMPILED_MODE}/{UNSHARDED_COMPILED}", f"{EAGER}/{UNSHARDED}")))
    console.print("step ms: per round the median step (zero_grad, forward, backward, AdamW) of the slower rank, then the median over rounds.\n"
                  "first fwd+bwd: the wall time of the first forward + backward, compilation included, each in a fresh inductor cache; "
                  "the slower rank's.\n"
                  "dynamo graphs: compiled during the implementation's warm-up steps. peak: parameters + optimizer state at a step's "
                  "start, plus the most\nthe step allocates above that (the CPU profiler's allocation events), median of "
                  f"{MEMORY_STEPS} steps; the larger rank's.\n"
                  f"unsharded and unsharded compiled run in each rank (its own copy and batch, no communication): the same CPU "
                  "contention and per-rank batch as the sharded ones.")
    if result["dynamo_graphs_after_warmup"]:
        console.print(f"[red]warning: dynamo compiled {result['dynamo_graphs_after_warmup']} graph(s) after the warm-up (recompiles in the timed steps)[/]")
    for names, ref in ((SHARDED, EAGER), ((UNSHARDED, UNSHARDED_COMPILED), UNSHARDED)):
        for name in names:  # the same weights and batches: inductor's kernels round differently, no more
            gap = abs(impls[name]["last_loss"] - impls[ref]["last_loss"]) / abs(impls[ref]["last_loss"])
            if gap > 1e-3:
                console.print(f"[red]warning: {name}'s last loss differs from {ref}'s by {gap:.2e} relative (> 1e-3)[/]")


def run_parts_1_to_3(args: argparse.Namespace, console: Console, results: dict) -> None:
    if not args.only_overhead:
        results["distributed"] = run_ranks(distributed_rank, args)
        print_distributed(console, results["distributed"])
    if not args.skip_overhead:
        results["overhead"] = run_overhead(args)  # after the ranks have exited: no gloo group here
        print_overhead(console, results["overhead"])
    if not (args.skip_muon or args.only_overhead):
        import muon_bench  # part 3, in its own ranks

        results["muon"] = muon_bench.run(muon_bench.parse_args(["--quick", "--skip-hsdp"] if args.quick else []), console)


def main() -> int:
    if "--muon" in sys.argv[1:]:  # before our parser: muon_bench.py has flags of its own
        import muon_bench  # benchmarks/muon_bench.py, next to this file

        return muon_bench.main([a for a in sys.argv[1:] if a != "--muon"])
    if "--ft" in sys.argv[1:]:  # torchft: benchmarks/ft_bench.py, its own flags
        import ft_bench

        return ft_bench.main([a for a in sys.argv[1:] if a != "--ft"])
    if "--compile-time" in sys.argv[1:]:  # the same: compile_time.py's own flags
        import compile_time  # benchmarks/compile_time.py, next to this file

        return compile_time.main([a for a in sys.argv[1:] if a != "--compile-time"])
    args = parse_args()
    if args.scaling:
        import scaling  # benchmarks/scaling.py, next to this file

        return scaling.main([a for a in sys.argv[1:] if a != "--scaling"])
    console = make_console()
    start = time.perf_counter()
    results = {}
    if args.compile:  # part 4 alone
        results["compile"] = run_compile(args)
        print_compile(console, results["compile"])
    else:
        run_parts_1_to_3(args, console, results)
    console.print(f"wall time {time.perf_counter() - start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
