"""How the cost grows: shardkit next to torch's FSDP2 as the world and the model grow.

    python benchmarks/scaling.py [--quick] [--json PATH]      (or: make bench ARGS=--scaling)

Everything runs on the fake process group (torch's ``FakeStore``): collectives return at once
and move nothing, so what is measured is each library's own work on this rank (rank 0): hooks,
copies into and out of the collective buffers, bookkeeping, the sharded optimizer step.

1. **World sweep** (8, 64, 512, 4096 ranks; fixed block count). The model is a stack of
   ``Linear(64, 64) + ReLU`` blocks, one group each, plus the root (bench.py's hook-overhead
   model). Per library: ``fully_shard`` time per block and for the root, lazy init (called
   directly: ``shardkit.eager.root.lazy_init`` and FSDP2's ``FSDPState._lazy_init``, what the first
   forward calls), the first step after it, and the steady step (zero_grad, forward, backward,
   AdamW foreach step), medians over interleaved rounds, next to the same model unsharded.
   overhead per group = (step - unsharded step) / groups. A weight of 64 rows is sharded by
   rows, so from world 64 on most ranks hold an empty (all-padding) shard: each world also runs
   two steps as the last rank to check both libraries handle that.
2. **Block sweep** (8, 32, 128 blocks; world 8): the same numbers.
3. **Llama-70B lazy init** (world 1024), each library in a fresh subprocess: the model built on
   the meta device, ``fully_shard`` per layer then the root, ``to_empty(device="cpu")``, lazy
   init, then a first write of every local shard (what a weight init does next; until then the
   kernel may not have backed ``to_empty``'s pages). Time and the peak RSS (the kernel's VmHWM,
   reset before each phase) of each phase.

The numbers go to a JSON file (default benchmarks/results/scaling.json) and a plot next to it
(same name, .png; needs matplotlib, the ``bench`` extra: ``make bench`` installs it into the venv).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardkit
from shardkit.eager.root import lazy_init as shardkit_lazy_init

LIBS = ("shardkit", "fsdp2")
SHARD = {"shardkit": shardkit.fully_shard, "fsdp2": torch_fully_shard}
DIM = 64
BATCH = 8
MiB = 1024 * 1024
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "scaling.json"
PRESETS = {
    "full": dict(worlds=(8, 64, 512, 4096), world_blocks=32, block_counts=(8, 32, 128), block_world=8,
                 rounds=5, steps=8, llama_layers=80, llama_world=1024),
    "quick": dict(worlds=(8, 512, 4096), world_blocks=8, block_counts=(8, 32), block_world=8,
                  rounds=2, steps=4, llama_layers=4, llama_world=1024),
}
# Llama-70B (Llama 3): 80 layers, dim 8192, 64 heads, 8 key/value heads, SwiGLU 28672, vocab 128256.
LLAMA_70B = dict(vocab_size=128256, dim=8192, n_heads=64, n_kv_heads=8, hidden=28672, max_seq=8192)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and steps, 4 Llama layers: well under a minute")
    parser.add_argument("--scaling", action="store_true", help=argparse.SUPPRESS)  # bench.py passes its argv on
    parser.add_argument("--json", default=None, metavar="PATH", help=f"write every number here (default {DEFAULT_JSON}); "
                                                                       "the plot goes next to it, as .png")
    parser.add_argument("--worlds", type=int, nargs="+", default=None)
    parser.add_argument("--world-blocks", type=int, default=None, help="block count of the world sweep")
    parser.add_argument("--block-counts", type=int, nargs="+", default=None)
    parser.add_argument("--block-world", type=int, default=None, help="world of the block sweep")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="steps per model per round")
    parser.add_argument("--llama-layers", type=int, default=None, help="80: Llama-70B; 0 skips this part")
    parser.add_argument("--llama-world", type=int, default=None)
    parser.add_argument("--llama-child", choices=LIBS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, value in PRESETS["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def error_text(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


@contextlib.contextmanager
def fake_world(world: int, rank: int = 0):
    """The fake process group at ``world`` and its 1-D mesh; yields (mesh, seconds to build both)."""
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        yield mesh, time.perf_counter() - start
    finally:
        gc.collect()
        dist.destroy_process_group()


# ---------------------------------------------------------------- the tiny-block sweeps


def tiny_stack(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(blocks)))


def lazy_init(lib: str, model: nn.Module) -> None:
    """What the root's first forward runs before anything else."""
    if lib == "shardkit":
        shardkit_lazy_init(model._shardkit())
    else:
        model._get_fsdp_state()._lazy_init()


COLLECTIVES = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
               "all_reduce")
COMM_S = [0.0]  # seconds spent inside the fake collectives, summed while timed_collectives() is active


@contextlib.contextmanager
def timed_collectives():
    """Time every collective call, wherever the library looked it up (``dist.X`` for FSDP2, a
    module-level alias for shardkit). The fake process group's collectives are not free: they
    cost time proportional to the world size (about 2.5 ms per call at world 4096 on this
    machine), which a real backend replaces with its transfer; it is subtracted as "comm"."""
    import shardkit.comm.collectives as sk_collectives

    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    by_id = {id(fn): fn for fn in originals.values()}

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                COMM_S[0] += time.perf_counter() - start
        return wrapper

    patched = []
    for module in (dist, sk_collectives):
        for name, value in list(vars(module).items()):
            if callable(value) and id(value) in by_id and by_id[id(value)] is value:
                patched.append((module, name, value))
                setattr(module, name, timed(value))
    try:
        yield
    finally:
        for module, name, value in patched:
            setattr(module, name, value)


class Runner:
    """One model and its AdamW; ``step()`` returns (forward+backward, optimizer, collectives) seconds."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        self.x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1))

    def step(self) -> tuple[float, float, float]:
        comm = COMM_S[0]
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        self.model(self.x).sum().backward()
        middle = time.perf_counter()
        self.optimizer.step()
        return middle - start, time.perf_counter() - middle, COMM_S[0] - comm


def shard_timed(lib: str, blocks: int, mesh) -> tuple[nn.Module, dict]:
    model = tiny_stack(blocks)
    per_block = []
    for block in model:
        start = time.perf_counter()
        SHARD[lib](block, mesh=mesh)
        per_block.append(time.perf_counter() - start)
    start = time.perf_counter()
    SHARD[lib](model, mesh=mesh)
    root = time.perf_counter() - start
    start = time.perf_counter()
    lazy_init(lib, model)
    lazy = time.perf_counter() - start
    return model, {"fully_shard_block_us": statistics.median(per_block) * 1e6,
                   "fully_shard_first_block_us": per_block[0] * 1e6,
                   "fully_shard_blocks_ms": sum(per_block) * 1e3, "fully_shard_root_us": root * 1e6,
                   "lazy_init_ms": lazy * 1e3}


def measure(world: int, blocks: int, args: argparse.Namespace) -> dict:
    """Both libraries and the unsharded model at one (world, blocks), rank 0."""
    rows = -(-DIM // world)  # ceil: a dim-0 shard's rows, padded alike on every rank
    result = {"world": world, "blocks": blocks, "groups": blocks + 1, "libs": {},
              # one block's all-gather output: weight (64, 64) and bias (64,), each padded to world * rows rows
              "gathered_numel_per_block": world * rows * DIM + world * rows, "block_numel": DIM * DIM + DIM}
    with fake_world(world) as (mesh, mesh_s):
        result["mesh_ms"] = mesh_s * 1e3
        runners = {"plain": Runner(tiny_stack(blocks))}
        for lib in LIBS:
            try:
                model, numbers = shard_timed(lib, blocks, mesh)
                runners[lib] = Runner(model)
                start = time.perf_counter()
                runners[lib].step()  # optimizer state is created here
                numbers["first_step_ms"] = (time.perf_counter() - start) * 1e3
                result["libs"][lib] = numbers
            except Exception as e:  # noqa: BLE001  (reported in the table)
                result["libs"][lib] = {"error": error_text(e)}
                traceback.print_exc()
        for runner in runners.values():
            for _ in range(2):
                runner.step()  # warm-up
        times = {name: [] for name in runners}  # (fwd+bwd, optimizer, collectives) seconds per step
        with timed_collectives():
            for r in range(args.rounds):  # interleaved, the order rotating, so drift hits all alike
                names = list(runners)
                for name in names[r % len(names):] + names[:r % len(names)]:
                    times[name] += [runners[name].step() for _ in range(args.steps)]
        for name, steps in times.items():
            numbers = result["libs"].setdefault(name, {})
            numbers["step_ms"] = statistics.median(a + b for a, b, _ in steps) * 1e3
            numbers["comm_ms"] = statistics.median(c for _, _, c in steps) * 1e3
            numbers["own_step_ms"] = statistics.median(a + b - c for a, b, c in steps) * 1e3
            numbers["fwd_bwd_ms"] = statistics.median(a for a, _, _ in steps) * 1e3
            numbers["optim_ms"] = statistics.median(b for _, b, _ in steps) * 1e3
        plain = result["libs"]["plain"]
        for lib in LIBS:
            numbers = result["libs"][lib]
            if "step_ms" in numbers:
                per_group = lambda ms: ms * 1e3 / result["groups"]  # noqa: E731
                numbers["overhead_us_per_group"] = per_group(numbers["own_step_ms"] - plain["step_ms"])
                numbers["overhead_with_comm_us_per_group"] = per_group(numbers["step_ms"] - plain["step_ms"])
                numbers["optim_overhead_us_per_group"] = per_group(numbers["optim_ms"] - plain["optim_ms"])
        del runners
    return result


def last_rank_check(world: int, blocks: int) -> dict:
    """Two steps as the last rank, whose shards are empty once the world exceeds 64 rows."""
    checks = {}
    with fake_world(world, rank=world - 1) as (mesh, _):
        for lib in LIBS:
            try:
                model, _ = shard_timed(lib, blocks, mesh)
                runner = Runner(model)
                runner.step()
                runner.step()
                local = [p.to_local().numel() for p in model.parameters()]
                checks[lib] = {"ok": True, "local_numel": sum(local), "empty_params": sum(n == 0 for n in local)}
                del model, runner
            except Exception as e:  # noqa: BLE001
                checks[lib] = {"ok": False, "error": error_text(e)}
                traceback.print_exc()
    return checks


# ---------------------------------------------------------------- Llama-70B lazy init, one library per process


def read_status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        return True
    except OSError:
        return False


def llama_child(lib: str, layers: int, world: int) -> dict:
    """The child process: each phase's seconds, peak RSS and RSS after it."""
    from shardkit.models.llama import Llama, LlamaConfig

    torch.set_num_threads(1)
    phases = {}
    can_reset = reset_peak()

    @contextlib.contextmanager
    def phase(name: str):
        gc.collect()
        reset_peak()
        before = read_status_mib("VmRSS")
        start = time.perf_counter()
        yield
        phases[name] = {"s": time.perf_counter() - start, "rss_before_mib": before,
                        "peak_rss_mib": read_status_mib("VmHWM"), "rss_after_mib": read_status_mib("VmRSS")}

    start_rss = read_status_mib("VmRSS")
    with phase("process group + mesh"):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
    with phase("build on meta"):
        with torch.device("meta"):
            model = Llama(LlamaConfig(n_layers=layers, **LLAMA_70B))
    n_params = sum(p.numel() for p in model.parameters())
    with phase("fully_shard"):
        for layer in model.layers:
            SHARD[lib](layer, mesh=mesh)
        SHARD[lib](model, mesh=mesh)
    with phase("to_empty"):
        model.to_empty(device="cpu")
    with phase("lazy init"):
        lazy_init(lib, model)
    with phase("first write of the shards"), torch.no_grad():  # what a weight init does next: every local page touched
        for p in model.parameters():
            p.to_local().normal_(0, 0.02)
    local_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    peak = max(p["peak_rss_mib"] for p in phases.values())
    return {"lib": lib, "layers": layers, "world": world, "params": n_params, "local_param_mib": local_bytes / MiB,
            "start_rss_mib": start_rss, "peak_rss_mib": peak, "hwm_reset": can_reset, "phases": phases}


def run_llama(lib: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, __file__, "--llama-child", lib, "--llama-layers", str(args.llama_layers),
               "--llama-world", str(args.llama_world), "--child-out", out]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
        wall = time.perf_counter() - start
        if proc.returncode != 0 or not os.path.exists(out):
            lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
            return {"lib": lib, "error": lines[-1] if lines else f"exit code {proc.returncode}", "process_s": wall}
        with open(out) as f:
            return json.load(f) | {"process_s": wall}


# ---------------------------------------------------------------- output


def make_console() -> Console:
    return Console() if sys.stdout.isatty() else Console(width=160)


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def sweep_table(title: str, key: str, results: list[dict]) -> Table:
    table = Table(title=title)
    for header in (key, "impl", "fully_shard\nus/block", "fully_shard\nroot us", "lazy init\nms",
                   "first step\nms", "step ms", "of it: fake\ncomm ms", "of it:\noptim ms", "overhead\nus/group",
                   "shardkit\n/ fsdp2", "last rank\n(empty shards)"):
        table.add_column(header, justify="right")
    for i, r in enumerate(results):
        fsdp2_overhead = r["libs"]["fsdp2"].get("overhead_us_per_group")
        for name in ("plain", *LIBS):
            n = r["libs"][name]
            last = name == LIBS[-1] and i < len(results) - 1
            label = f"{r[key]}" if name == "plain" else (
                f"(gathers {r['gathered_numel_per_block']:,}" if name == LIBS[0] else "per block)")
            if "step_ms" not in n:
                table.add_row(label, name, f"[red]{n.get('error', 'failed')}[/]", *[""] * 9, end_section=last)
                continue
            ratio = None
            if name == "shardkit" and fsdp2_overhead and n.get("overhead_us_per_group") is not None:
                ratio = n["overhead_us_per_group"] / fsdp2_overhead
            check = r.get("last_rank", {}).get(name)
            check_cell = "" if check is None else (
                f"ok ({check['empty_params']} empty)" if check["ok"] else f"[red]{check['error']}[/]")
            table.add_row(label, name, fmt(n.get("fully_shard_block_us"), ".0f"),
                          fmt(n.get("fully_shard_root_us"), ".0f"), fmt(n.get("lazy_init_ms"), ".2f"),
                          fmt(n.get("first_step_ms"), ".1f"), f"{n['step_ms']:.2f}", f"{n['comm_ms']:.2f}",
                          f"{n['optim_ms']:.2f}", fmt(n.get("overhead_us_per_group"), ".0f"), fmt(ratio, ".2f"),
                          check_cell, end_section=last)
    return table


def llama_table(results: dict) -> Table:
    any_ok = next((r for r in results.values() if "phases" in r), None)
    title = "Llama-70B-shaped lazy init" if any_ok is None else (
        f"Llama {any_ok['layers']} layers ({any_ok['params'] / 1e9:.2f} B parameters) on meta, world {any_ok['world']}, "
        f"rank 0 holds {any_ok['local_param_mib']:.0f} MiB")
    table = Table(title=title)
    for header in ("impl", "phase", "seconds", "peak RSS MiB\n(over phase start)", "RSS after MiB"):
        table.add_column(header, justify="right")
    for lib, r in results.items():
        if "phases" not in r:
            table.add_row(lib, "[red]failed[/]", f"[red]{r['error']}[/]", "", "", end_section=True)
            continue
        for name, p in r["phases"].items():
            table.add_row(lib if name == "process group + mesh" else "", name, f"{p['s']:.3f}",
                          f"{p['peak_rss_mib']:.0f} (+{p['peak_rss_mib'] - p['rss_before_mib']:.0f})",
                          f"{p['rss_after_mib']:.0f}")
        total = sum(p["s"] for p in r["phases"].values())
        table.add_row("", "total", f"{total:.3f}", f"{r['peak_rss_mib']:.0f}", "", end_section=True)
    return table


def plot(results: dict, png: Path) -> str | None:
    """Three panels; returns None when written, else why not."""
    try:
        import matplotlib
    except ImportError:
        return ("matplotlib is not installed, so no plot was written (the tables and the JSON were). "
                "`make bench ARGS=--scaling` installs it, or: .venv/bin/pip install 'matplotlib==3.10.9'")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"shardkit": "tab:blue", "fsdp2": "tab:orange"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (("world", results["world_sweep"], f"{results['config']['world_blocks']} blocks"),
              ("blocks", results["block_sweep"], f"world {results['config']['block_world']}"))
    for ax, (key, sweep, fixed) in zip(axes, panels):
        for lib in LIBS:
            points = [(r[key], r["libs"][lib]["overhead_us_per_group"]) for r in sweep
                      if r["libs"][lib].get("overhead_us_per_group") is not None]
            if points:
                ax.plot(*zip(*points), "o-", color=colors[lib], label=lib)
        ax.set_xscale("log", base=2)
        ax.set_xticks([r[key] for r in sweep], [str(r[key]) for r in sweep])
        ax.set_xlabel("world size" if key == "world" else "blocks (groups - 1)")
        ax.set_ylabel("step overhead, us per group")
        ax.set_ylim(bottom=0)
        ax.set_title(f"per-step overhead vs {'world' if key == 'world' else 'block count'} ({fixed})")
        ax.grid(alpha=0.3)
        ax.legend()
    ax = axes[2]
    sweep = results["world_sweep"]
    for lib in LIBS:
        rows = [r for r in sweep if "lazy_init_ms" in r["libs"][lib]]
        worlds = [r["world"] for r in rows]
        ax.plot(worlds, [r["libs"][lib]["fully_shard_blocks_ms"] + r["libs"][lib]["fully_shard_root_us"] / 1e3 for r in rows],
                "o-", color=colors[lib], label=f"{lib}: fully_shard (all groups)")
        ax.plot(worlds, [r["libs"][lib]["lazy_init_ms"] for r in rows], "s--", color=colors[lib], label=f"{lib}: lazy init")
    ax.plot([r["world"] for r in sweep], [r["mesh_ms"] for r in sweep], "^:", color="gray", label="process group + mesh")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([r["world"] for r in sweep], [str(r["world"]) for r in sweep])
    ax.set_xlabel("world size")
    ax.set_ylabel("ms")
    ax.set_title(f"setup time vs world ({results['config']['world_blocks']} blocks)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.suptitle("shardkit vs FSDP2 on the fake process group (rank 0, Linear(64, 64) + ReLU blocks, AdamW foreach)")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.llama_child:
        result = llama_child(args.llama_child, args.llama_layers, args.llama_world)
        with open(args.child_out, "w") as f:
            json.dump(result, f)
        return 0
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # the fake all-gather leaves buffers unwritten: keep junk floats cheap
    console = make_console()
    start = time.perf_counter()
    config = {k: v for k, v in vars(args).items() if k not in ("llama_child", "child_out", "scaling")}
    results = {"config": config, "world_sweep": [], "block_sweep": [], "llama": {}}
    with fake_world(8) as (mesh, _):  # first-call costs (imports, dispatcher caches) out of the first size's numbers
        for lib in LIBS:
            Runner(shard_timed(lib, 2, mesh)[0]).step()
    for world in args.worlds:
        console.print(f"world {world}, {args.world_blocks} blocks ...")
        r = measure(world, args.world_blocks, args)
        r["last_rank"] = last_rank_check(world, args.world_blocks)
        results["world_sweep"].append(r)
    console.print(sweep_table(f"as the world grows: {args.world_blocks} blocks of Linear({DIM}, {DIM}) + ReLU, "
                              f"fake PG, rank 0", "world", results["world_sweep"]))
    for blocks in args.block_counts:
        console.print(f"{blocks} blocks, world {args.block_world} ...")
        results["block_sweep"].append(measure(args.block_world, blocks, args))
    console.print(sweep_table(f"as the model grows: world {args.block_world}, fake PG, rank 0", "blocks",
                              results["block_sweep"]))
    console.print("A step is zero_grad, forward, backward and AdamW (foreach); medians over interleaved rounds. "
                  "fake comm: time inside the fake process group's collectives (it grows with the world; a real "
                  "backend's transfer replaces it). overhead per group = (step - fake comm - plain step) / (blocks + 1). "
                  "fully_shard us/block: median over the blocks. gathers: elements in a block's all-gather output (its "
                  f"{DIM * DIM + DIM:,} parameters, padded to world x ceil(64 / world) rows). last rank: two steps as rank world-1, whose shards are "
                  "empty once world > 64 (count of parameters with an empty local shard).")
    if args.llama_layers:
        for lib in LIBS:
            console.print(f"Llama {args.llama_layers} layers, world {args.llama_world}: {lib} in a subprocess ...")
            results["llama"][lib] = run_llama(lib, args)
        console.print(llama_table(results["llama"]))
        console.print("peak RSS: the kernel's high-water mark (VmHWM) in that library's own process, reset before each "
                      "phase; the parenthesis is its rise over the phase's starting RSS.")
    results["wall_s"] = time.perf_counter() - start
    json_path = Path(args.json) if args.json else DEFAULT_JSON
    json_path.parent.mkdir(parents=True, exist_ok=True)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    png = json_path.with_suffix(".png")
    why_not = plot(results, png)
    console.print(f"wrote {json_path}" + (f" and {png}" if why_not is None else ""))
    if why_not:
        console.print(f"[yellow]{why_not}[/]")
    console.print(f"wall time {results['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
