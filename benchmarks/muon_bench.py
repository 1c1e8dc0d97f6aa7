"""shardkit.optim.Muon next to torch.optim.Muon: step time, collectives, parity.

    python benchmarks/muon_bench.py [--quick] [--skip-hsdp] [--json PATH]
    (make bench runs it as its part 3; make bench ARGS=--muon runs it alone)

The model is a stack of 8 ``nn.Linear(D, D)`` blocks, each its own ``shardkit.fully_shard``
group (then the root), and the optimizer steps its 8 weight matrices (Muon is for matrices;
the biases are not stepped). Three implementations of the same step, built from one seed:

- shardkit: ``shardkit.optim.Muon`` on the sharded weights (DTensors): the momentum on each
  rank's shards, Newton-Schulz once per matrix on its owner rank, one packed all-to-all each
  way per bucket (here one bucket: 2 all-to-alls per step);
- torch: ``torch.optim.Muon`` on the same kind of sharded weights: its Newton-Schulz runs as
  DTensor ops, each matrix product gathering an operand, each norm an all-reduce;
- local: ``torch.optim.Muon`` in one process on the unsharded model. Every rank steps its own
  full copy at the same time (no communication), so it feels the same CPU contention.

Gradients are injected, not computed: step k gives every matrix the same seeded random full
gradient in all three, as a DTensor placed like the parameter for the sharded ones (each
rank takes its own rows: no communication). Each implementation takes 1 + rounds x steps
steps: a warm-up step, during which the collectives are counted (shardkit's by its own
``shardkit.trace()``, torch's by a dispatch mode that sees DTensor's functional collectives),
then interleaved rounds as in bench.py: the order rotates each round, a round's number is
the median step of the slower rank, the table shows the median over rounds (min..max) and
the ratios are paired per round before their median. Then the largest |parameter - local's|
over every element of the 8 matrices: shardkit's should be 0.0 (fp32 parameters end
bit-identical to one process), torch's is not (its sharded products round differently).

Layouts: FSDP on 2 ranks (D = 256; --quick: 128), then HSDP 2 x 2 on 4 ranks (D = 128;
placements (Replicate(), Shard(0)): the owners spread over both replicas), unless --skip-hsdp.

How to read it: the step of every implementation is mostly Newton-Schulz's bf16 matrix
products, 5 iterations of 3 per matrix. shardkit's floor is its owner share of them (1/2 of
local's on 2 ranks, 1/4 under HSDP 2 x 2); torch's sharded products split the same work
by rows and pay DTensor's dispatch and a collective per product on top. Where bf16 products
are slow (a CPU without AVX512-BF16 or AMX: the table's footer shows the measured product
times) the compute dwarfs that overhead, and shardkit / torch tends to 1 / 1; where they
are fast, the overhead is most of torch's step.
"""

from __future__ import annotations

import argparse
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
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import shardkit
import shardkit.optim

IMPLS = ("shardkit", "torch", "local")
DESCRIBED = {
    "shardkit": "shardkit.optim.Muon, sharded",
    "torch": "torch.optim.Muon, sharded (DTensor ops)",
    "local": "torch.optim.Muon, unsharded, one process",
}
BLOCKS = 8
LR = 0.02
WARMUP_STEPS = 1  # untimed: its collectives are counted (and shardkit builds its plan in it)
MiB = 1024 * 1024
# name -> (ranks, mesh shape, mesh dim names)
LAYOUTS = {"fsdp": (2, (2,), ("shard",)), "hsdp": (4, (2, 2), ("replicate", "shard"))}
# Flags left unset take their value from the preset: the default run, or --quick.
PRESETS = {
    "full": dict(dim=256, hsdp_dim=128, rounds=4, steps=1),
    "quick": dict(dim=128, hsdp_dim=128, rounds=4, steps=1),
}
GOALS = {"shardkit/torch": 0.1, "shardkit/local": 1.0}  # a ratio at or below its goal meets it


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small run (D = 128 on 2 ranks too)")
    for name in ("dim", "hsdp-dim", "rounds", "steps"):
        parser.add_argument(f"--{name}", type=int, default=None)
    parser.add_argument("--skip-hsdp", action="store_true", help="only the 2-rank FSDP layout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write every number here")
    args = parser.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


# ---------------------------------------------------------------- in each rank


@dataclass
class Impl:
    name: str
    weights: list[torch.Tensor]  # the BLOCKS weight matrices the optimizer steps
    optimizer: torch.optim.Optimizer
    steps_done: int = 0  # picks the gradients, so every implementation sees the same sequence


def build_impls(dim: int, mesh, seed: int) -> dict[str, Impl]:
    torch.manual_seed(seed)
    models = {name: nn.Sequential(*(nn.Linear(dim, dim) for _ in range(BLOCKS))) for name in IMPLS}
    for name in IMPLS[1:]:
        models[name].load_state_dict(models["shardkit"].state_dict())  # one set of weights for all
    for name in ("shardkit", "torch"):
        for block in models[name]:
            shardkit.fully_shard(block, mesh=mesh)
        shardkit.fully_shard(models[name], mesh=mesh)
    optimizers = {"shardkit": shardkit.optim.Muon, "torch": torch.optim.Muon, "local": torch.optim.Muon}
    impls = {}
    for name, model in models.items():
        weights = [block.weight for block in model]
        impls[name] = Impl(name, weights, optimizers[name](weights, lr=LR))
    return impls


def set_gradients(impl: Impl, seed: int) -> None:
    """Step ``impl.steps_done``'s gradients: the same full matrices on every rank and for every
    implementation; a sharded weight gets its own rows of it (``src_data_rank=None``: each
    rank cuts its piece from its own copy, no communication)."""
    generator = torch.Generator().manual_seed(seed + 1000 + impl.steps_done)
    for w in impl.weights:
        full = torch.randn(w.shape, generator=generator)  # (D, D)
        if isinstance(w, DTensor):
            w.grad = distribute_tensor(full, w.device_mesh, w.placements, src_data_rank=None)
        else:
            w.grad = full


def timed_step(impl: Impl, seed: int) -> float:
    """One optimizer step on the next injected gradients; returns its seconds."""
    set_gradients(impl, seed)
    start = time.perf_counter()
    impl.optimizer.step()
    seconds = time.perf_counter() - start
    impl.steps_done += 1
    return seconds


class CountingCollectives(TorchDispatchMode):
    """Counts the collectives that run under it, with their logical buffer bytes: DTensor's
    functional ones (all-gather output, all-reduce tensor) and c10d's all-to-all (input)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, list[int]] = {}  # kind -> [calls, bytes]
        functional, c10d = torch.ops._c10d_functional, torch.ops.c10d
        # op -> (kind, which tensor is the logical buffer: "out" or an argument's position)
        self.ops = {
            functional.all_gather_into_tensor.default: ("all_gather", "out"),
            functional.all_reduce.default: ("all_reduce", 0),
            functional.reduce_scatter_tensor.default: ("reduce_scatter", 0),
            functional.all_to_all_single.default: ("all_to_all", 0),
            c10d.alltoall_base_.default: ("all_to_all", 1),
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not isinstance(func, torch._ops.HigherOrderOperator) and DTensor in types:
            return NotImplemented  # modes run before subclasses: let DTensor desugar into collectives first
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            kind, which = self.ops[func]
            buffer = out if which == "out" else args[which]
            stats = self.counts.setdefault(kind, [0, 0])
            stats[0] += 1
            stats[1] += buffer.numel() * buffer.element_size()
        return out


def counted_step(impl: Impl, seed: int) -> dict[str, list[int]]:
    """{kind: [calls, bytes]} over one step."""
    if impl.name == "shardkit":
        with shardkit.trace() as t:
            timed_step(impl, seed)
        return {kind: [s.calls, s.nbytes] for kind, s in t.summary().items() if s.calls}
    mode = CountingCollectives()
    with mode:
        timed_step(impl, seed)
    return mode.counts


def time_rounds(impls: dict[str, Impl], args: argparse.Namespace) -> torch.Tensor:
    """Step seconds, (rounds, impls, steps); the implementation order rotates every round."""
    times = torch.zeros(args.rounds, len(IMPLS), args.steps, dtype=torch.float64)
    for r in range(args.rounds):
        order = IMPLS[r % len(IMPLS):] + IMPLS[:r % len(IMPLS)]
        for name in order:
            dist.barrier()
            for s in range(args.steps):
                times[r, IMPLS.index(name), s] = timed_step(impls[name], args.seed)
    return times


def largest_error(impl: Impl, reference: Impl) -> float:
    """max |parameter - reference's| over every element (a collective for DTensors)."""
    worst = 0.0
    for w, ref in zip(impl.weights, reference.weights):
        full = w.full_tensor() if isinstance(w, DTensor) else w
        worst = max(worst, (full.detach() - ref.detach()).abs().max().item())
    return worst


def product_ms(dim: int, dtype: torch.dtype) -> float:
    """Milliseconds of one (dim x dim) @ (dim x dim) product on this rank."""
    a = torch.randn(dim, dim).to(dtype)
    a @ a
    start = time.perf_counter()
    for _ in range(3):
        a @ a
    return (time.perf_counter() - start) / 3 * 1000


def rank_main(rank: int, layout: str, dim: int, args: argparse.Namespace, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    world, shape, names = LAYOUTS[layout]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    impls = build_impls(dim, mesh, args.seed)
    counts = {name: counted_step(impls[name], args.seed) for name in IMPLS}  # the warm-up step
    times = time_rounds(impls, args)
    errors = {name: largest_error(impls[name], impls["local"]) for name in ("shardkit", "torch")}
    owners = [round(load / impls["shardkit"].optimizer.cost(torch.Size((dim, dim))))
              for load in next(iter(impls["shardkit"].optimizer._owners.load.values()))]  # matrices per rank
    dist.barrier()
    products = torch.tensor([product_ms(dim, torch.bfloat16), product_ms(dim, torch.float32)], dtype=torch.float64)
    dist.all_reduce(products)  # summed; divided by world below
    all_times = [torch.zeros_like(times) for _ in range(world)]
    dist.all_gather(all_times, times)
    if rank == 0:
        round_ms = torch.stack([t.median(dim=2).values for t in all_times]).amax(dim=0) * 1000  # (rounds, impls)
        result = {"layout": layout, "world": world, "mesh": dict(zip(names, shape)), "dim": dim, "blocks": BLOCKS,
                  "steps_per_impl": WARMUP_STEPS + args.rounds * args.steps, "rounds": args.rounds, "steps": args.steps,
                  "owned_matrices_per_rank": owners,
                  "product_ms": {"bfloat16": products[0].item() / world, "float32": products[1].item() / world},
                  "impls": {}, "ratios": {}}
        for i, name in enumerate(IMPLS):
            ms = round_ms[:, i].tolist()
            result["impls"][name] = {
                "step_ms_per_round": ms, "step_ms": statistics.median(ms),
                "step_s_per_rank_round_step": [t[:, i].tolist() for t in all_times],
                "collectives_per_step": {k: {"calls": c[0], "bytes": c[1]} for k, c in counts[name].items()},
                "max_abs_error_vs_local": errors.get(name, 0.0),
            }
        for a, b in (("shardkit", "torch"), ("shardkit", "local"), ("torch", "local")):
            per_round = (round_ms[:, IMPLS.index(a)] / round_ms[:, IMPLS.index(b)]).tolist()
            result["ratios"][f"{a}/{b}"] = {"per_round": per_round, "median": statistics.median(per_round)}
        with open(out_path, "w") as f:
            json.dump(result, f)
    # The sharded parameters hold the mesh, which holds the group: free them before destroying it.
    del impls
    gc.collect()
    dist.destroy_process_group()


# ---------------------------------------------------------------- in the launching process


def run_layout(layout: str, dim: int, args: argparse.Namespace) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "result.json")
        mp.spawn(rank_main, args=(layout, dim, args, port, out_path), nprocs=LAYOUTS[layout][0])
        with open(out_path) as f:
            return json.load(f)


def make_console() -> Console:
    # Piped output (make bench | tee) would otherwise wrap the tables at 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=160)


def spread(values: list[float]) -> str:
    return f"{min(values):.4g}..{max(values):.4g}"


def collectives_cell(counts: dict) -> str:
    lines = [f"{c['calls']} {kind}, {c['bytes'] / MiB:.2f} MiB" for kind, c in counts.items()]
    return "\n".join(lines) or "-"


def print_layout(console: Console, result: dict) -> None:
    mesh = " x ".join(f"{n} {name}" for name, n in result["mesh"].items())
    table = Table(title=f"Muon step: {result['blocks']} x Linear({result['dim']}, {result['dim']}) weights, "
                        f"{result['world']} gloo ranks (mesh {mesh}), {result['rounds']} rounds x {result['steps']} steps")
    for header in ("impl", "", "step ms\n(min..max rounds)", "collectives / step\n(calls, logical MiB)",
                   f"max |param - local|\nafter {result['steps_per_impl']} steps"):
        table.add_column(header, justify="right")
    for name, r in result["impls"].items():
        error = "-" if name == "local" else f"{r['max_abs_error_vs_local']:.3g}"
        table.add_row(name, DESCRIBED[name], f"{r['step_ms']:.1f} ({spread(r['step_ms_per_round'])})",
                      collectives_cell(r["collectives_per_step"]), error)
    console.print(table)
    parts = []
    for key, v in result["ratios"].items():
        goal = GOALS.get(key)
        verdict = "" if goal is None else (f" [green]<= {goal:g}[/]" if v["median"] <= goal else f" [red]> goal {goal:g}[/]")
        parts.append(f"{key} {v['median']:.2f} ({spread(v['per_round'])}){verdict}")
    console.print("ratios (median of paired per-round ratios, min..max): " + ", ".join(parts))
    p, ms = result["product_ms"], {name: r["step_ms"] for name, r in result["impls"].items()}
    share = max(result["owned_matrices_per_rank"]) / result["blocks"]
    console.print(f"Newton-Schulz owners: {result['owned_matrices_per_rank']} matrices per rank (local: all "
                  f"{result['blocks']} on every rank). One {result['dim']}^3 product here: bf16 {p['bfloat16']:.2f} ms, "
                  f"fp32 {p['float32']:.2f} ms; Newton-Schulz is 15 bf16 products per matrix.\n"
                  f"Over the compute: shardkit {ms['shardkit'] - share * ms['local']:+.1f} ms over its floor "
                  f"(local x {share:g}, the busiest owner's share); torch {ms['torch'] - ms['local']:+.1f} ms over local "
                  "(DTensor dispatch and its collectives).\n"
                  "Bytes: the logical buffer (all-to-all input, all-gather output, all-reduce tensor).")
    errors = {name: r["max_abs_error_vs_local"] for name, r in result["impls"].items()}
    if errors["shardkit"] != 0.0:
        console.print(f"[red]warning: shardkit.optim.Muon differs from one-process torch.optim.Muon by {errors['shardkit']:.3g} "
                      "(expected bit-identical fp32 parameters)[/]")


def run(args: argparse.Namespace, console: Console | None = None) -> dict:
    """Every layout, each printed as it finishes; returns their numbers."""
    console = console or make_console()
    results = {}
    layouts = {"fsdp": args.dim} if args.skip_hsdp else {"fsdp": args.dim, "hsdp": args.hsdp_dim}
    for layout, dim in layouts.items():
        results[layout] = run_layout(layout, dim, args)
        print_layout(console, results[layout])
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = make_console()
    start = time.perf_counter()
    results = run(args, console)
    console.print(f"wall time {time.perf_counter() - start:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
