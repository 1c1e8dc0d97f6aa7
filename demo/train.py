"""Train a small character-level GPT with shardkit on 2 ranks, and show what sharding did.

    torchrun --standalone --nproc-per-node 2 demo/train.py      (or: make demo)

Every block is its own fully_shard group, and the root group holds the embeddings, the final
LayerNorm and the tied head. Each rank keeps only its shard of every parameter, trains on its
own random windows of demo/data/corpus.txt, and the gradients meet in one reduce-scatter per
group. At the end rank 0 prints, per rank, the bytes of parameters it holds, the collectives
per step, how long it waited on them, its peak memory, and whether the loss fell (the exit
status says so too), and writes a timeline of the last steps of every rank (runs/timeline.json,
open it at https://ui.perfetto.dev).

With --optim muon the blocks' 2-D hidden weight matrices are stepped by shardkit.optim.Muon
(each matrix orthogonalized once in the mesh, on an owner rank: two all-to-alls per step) and
everything else (embeddings, the tied head, LayerNorms, biases) by AdamW, the usual recipe.

The gradients' total norm is clipped to --clip (shardkit.clip_grad_norm_: one all-reduce a
step). --save-pretrained DIR writes the trained weights in the Hugging Face layout (safetensors
files and an index, each tensor gathered whole on one rank only); --pretrained DIR starts from
such weights: the model is built on the meta device, sharded, and each rank reads only its own
rows of each tensor from the files (shardkit.checkpoint.load_pretrained).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import resource
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import shardkit
import shardkit.checkpoint
import shardkit.optim
from shardkit.comm.trace import CollectiveStats, Trace
from shardkit.models import GPT, GPTConfig, apply_fully_shard

DEFAULT_DATA = Path(__file__).parent / "data" / "corpus.txt"
DEFAULT_TIMELINE = Path(__file__).parent.parent / "runs" / "timeline.json"
TIMELINE_STEPS = 3  # the last steps kept for the timeline
LOSS_WINDOW = 10  # steps averaged for the "first" and "last" loss
MiB = 1024 * 1024


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=400, help="optimizer steps (about a minute on 2 CPU cores)")
    parser.add_argument("--max-seconds", type=float, default=None, help="stop early after this many seconds")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate")
    parser.add_argument("--optim", choices=("adamw", "muon"), default="adamw",
                        help="muon: shardkit.optim.Muon for the blocks' weight matrices, AdamW for the rest")
    parser.add_argument("--muon-lr", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--clip", type=float, default=1.0, help="clip the gradients' total norm to this (0: don't)")
    parser.add_argument("--pretrained", type=Path, default=None,
                        help="start from these weights: a safetensors file or a folder (one --save-pretrained wrote)")
    parser.add_argument("--save-pretrained", type=Path, default=None, help="write the trained weights to this folder (safetensors)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="a plain-text file")
    parser.add_argument("--timeline", default=str(DEFAULT_TIMELINE),
                        help=f"write the last {TIMELINE_STEPS} steps of every rank here as a Perfetto timeline (\"\": don't)")
    return parser.parse_args()


def setup_distributed() -> torch.device:
    """NCCL with one GPU per rank when there are enough GPUs, else gloo on the CPU."""
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available() and torch.cuda.device_count() >= ranks_here:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    # NCCL refuses two ranks on one GPU, so a 2-rank demo on a 1-GPU machine runs on the CPU.
    dist.init_process_group("gloo")
    return torch.device("cpu")


def load_corpus(path: Path, device: torch.device) -> tuple[torch.Tensor, list[str]]:
    """The file as one long tensor of character ids, and the vocabulary (sorted characters)."""
    text = path.read_text(encoding="utf-8")
    vocab = sorted(set(text))
    index = {ch: i for i, ch in enumerate(vocab)}
    data = torch.tensor([index[ch] for ch in text], dtype=torch.long, device=device)  # (N,)
    return data, vocab


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of the corpus; the targets are the inputs shifted by one character."""
    starts = torch.randint(len(data) - block_size - 1, (batch_size,), generator=generator)  # (B,)
    offsets = torch.arange(block_size)  # (T,)
    positions = (starts[:, None] + offsets[None, :]).to(data.device)  # (B, T)
    return data[positions], data[positions + 1]  # (B, T), (B, T)


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)  # this rank's loss per step
    grad_norms: list[float] = field(default_factory=list)  # the total gradient norm per step, before clipping
    clip: float = 0.0  # what it was clipped to
    seconds: float = 0.0
    collectives: dict[str, CollectiveStats] = field(default_factory=dict)  # summed over steps
    trace: Trace | None = None  # the events of the last TIMELINE_STEPS steps

    @property
    def steps(self) -> int:
        return len(self.losses)


def add_stats(totals: dict, step_summary: dict) -> None:
    for kind, stats in step_summary.items():
        total = totals.setdefault(kind, CollectiveStats())
        total.calls += stats.calls
        total.nbytes += stats.nbytes
        total.wire_nbytes += stats.wire_nbytes
        total.exposed_ns += stats.exposed_ns


def out_of_time(deadline: float | None, device: torch.device) -> bool:
    """All ranks must stop on the same step (or the next collective hangs), so rank clocks vote."""
    if deadline is None:
        return False
    late = torch.tensor([float(time.perf_counter() > deadline)], device=device)
    dist.all_reduce(late, op=dist.ReduceOp.MAX)
    return bool(late.item())


def make_optimizers(model: GPT, args: argparse.Namespace) -> list[torch.optim.Optimizer]:
    """AdamW for every parameter; or, with --optim muon, Muon for the blocks' 2-D hidden weight
    matrices and AdamW for the rest (embeddings, the head, LayerNorms, biases). The head's
    weight is the token embedding's (tied): named_parameters() lists it once, as tok_emb.weight,
    outside the blocks, so AdamW steps it, once."""
    if args.optim == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)]
    hidden = [p for name, p in model.named_parameters() if name.startswith("blocks.") and p.ndim == 2]
    held = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in held]
    return [shardkit.optim.Muon(hidden, lr=args.muon_lr, momentum=0.95, weight_decay=0.0),
            torch.optim.AdamW(rest, lr=args.lr, weight_decay=0.0)]


def train(model: GPT, optimizers: list, data: torch.Tensor, args: argparse.Namespace, progress: Progress | None) -> TrainResult:
    # The model starts identical everywhere; the data must not, or data parallelism is pointless.
    generator = torch.Generator().manual_seed(args.seed + 1 + dist.get_rank())
    tokens_per_step = args.batch_size * args.block_size * dist.get_world_size()
    task = progress.add_task("training", total=args.steps, loss=math.nan, tokens=0.0) if progress else None
    result = TrainResult(clip=args.clip)
    start = time.perf_counter()
    deadline = start + args.max_seconds if args.max_seconds else None
    recent: deque[list] = deque(maxlen=TIMELINE_STEPS)  # the events of the last steps, per step
    with shardkit.trace() as t:
        for _ in range(args.steps):
            x, y = get_batch(data, args.batch_size, args.block_size, generator)  # (B, T), (B, T)
            _, loss = model(x, y)
            loss.backward()
            if args.clip > 0:  # over every parameter of every rank: the same number on all ranks
                result.grad_norms.append(shardkit.clip_grad_norm_(model.parameters(), args.clip).item())
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            result.losses.append(loss.item())
            t.resolve()  # CUDA: when the step's collectives completed (a no-op on the CPU)
            add_stats(result.collectives, t.summary())
            recent.append(list(t.events))
            t.clear()  # one step's events at a time: the trace stays small however long we train
            if progress:
                rate = tokens_per_step * result.steps / (time.perf_counter() - start)
                progress.update(task, advance=1, loss=result.losses[-1], tokens=rate)
            if out_of_time(deadline, data.device):
                break
    result.seconds = time.perf_counter() - start
    t.events = [e for events in recent for e in events]
    result.trace = t
    return result


def mean_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.item() / dist.get_world_size()


def rank_row(model: GPT, result: TrainResult) -> dict:
    """What this rank reports: its shard sizes, collectives per step, memory and losses."""
    sharded_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    window = max(1, min(LOSS_WINDOW, result.steps // 2))  # short runs: halves that do not overlap
    per_step = {kind: (s.calls / result.steps, s.nbytes / result.steps / MiB) for kind, s in result.collectives.items()}
    return {
        "rank": dist.get_rank(),
        "sharded_mb": sharded_bytes / MiB,
        "all_gather": per_step.get("all_gather", (0, 0.0)),
        "reduce_scatter": per_step.get("reduce_scatter", (0, 0.0)),
        "all_to_all": per_step.get("all_to_all", (0, 0.0)),  # Muon's (--optim muon)
        "waited_ms": sum(s.exposed_ns for s in result.collectives.values()) / result.steps / 1e6,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux reports KiB
        "loss_window": window,
        "step1_loss": result.losses[0],
        "first_loss": sum(result.losses[:window]) / window,
        "last_loss": sum(result.losses[-window:]) / window,
    }


def print_report(console: Console, rows: list[dict], result: TrainResult, first: float, last: float) -> None:
    table = Table(title=f"shardkit: {result.steps} steps in {result.seconds:.1f} s",
                  caption="collective MiB: the unsharded-side buffer; each rank sends (world - 1) / world of it "
                          "(on gloo the reduce-scatter runs as an all-to-all and a local sum: the same bytes); "
                          "waited on comm: time a hook (or the optimizer) blocked on a collective that compute did not hide")
    all_to_all = any(row["all_to_all"][0] for row in rows)  # only an optimizer's (Muon) issues them
    for header in ["rank", "sharded\nparams", "all-\ngather\nper step", "reduce-\nscatter\nper step",
                   *(["all-to-\nall\nper step"] if all_to_all else []),
                   "waited on\ncomm\nper step", "peak\nRSS", "first\nloss", "last\nloss"]:
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(
            str(row["rank"]), f"{row['sharded_mb']:.2f} MiB",
            _calls_and_size(*row["all_gather"]), _calls_and_size(*row["reduce_scatter"]),
            *([_calls_and_size(*row["all_to_all"])] if all_to_all else []),
            f"{row['waited_ms']:.1f} ms", f"{row['peak_rss_mb']:.0f} MiB", f"{row['first_loss']:.3f}", f"{row['last_loss']:.3f}",
        )
    console.print(table)
    verdict = "[green]the loss fell[/]" if last < first else "[red]the loss did NOT fall[/]"
    window = rows[0]["loss_window"]
    step1 = sum(row["step1_loss"] for row in rows) / len(rows)
    console.print(f"mean loss over ranks: step 1 {step1:.3f}; first {window} steps {first:.3f}, last {window} steps {last:.3f}: {verdict}")
    if result.grad_norms:
        clipped = sum(n > result.clip for n in result.grad_norms)
        console.print(f"gradient norm: {result.grad_norms[0]:.3f} at the first step, {result.grad_norms[-1]:.3f} at the last; "
                      f"clipped to {result.clip:g} in {clipped} of {len(result.grad_norms)} steps")


def _calls_and_size(calls: float, mebibytes: float) -> str:
    return f"{calls:g} calls\n{mebibytes:.2f} MiB"


def run(args: argparse.Namespace, device: torch.device) -> bool:
    """Build, shard, train and report; True if the loss fell."""
    is_main = dist.get_rank() == 0
    # Piped output (make demo | tee, the tests) would otherwise wrap the table at 80 columns.
    console = Console() if sys.stdout.isatty() else Console(width=120)
    data, vocab = load_corpus(args.data, device)
    config = GPTConfig(vocab_size=len(vocab), block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    if args.pretrained:  # no weights yet: the files give them, each rank only its rows
        with torch.device("meta"):
            model = GPT(config)
    else:  # every rank builds the same full model from the same seed; fully_shard keeps each rank's rows
        torch.manual_seed(args.seed)
        model = GPT(config).to(device)
    total_params = sum(p.numel() for p in model.parameters())  # the tied weight counts once
    # We pass the mesh: left to itself, fully_shard would pick the accelerator even under gloo.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    apply_fully_shard(model, shardkit.fully_shard, mesh=mesh)
    if args.pretrained:
        shardkit.checkpoint.load_pretrained(model, str(args.pretrained))
        if is_main:
            console.print(f"weights from {args.pretrained}: each rank read only its rows")
    optimizers = make_optimizers(model, args)  # after fully_shard: they hold the sharded parameters
    if is_main:
        console.print(f"GPT: {total_params:,} parameters, vocab {len(vocab)}, {config}")
        console.print(f"{dist.get_world_size()} ranks on {device.type} ({dist.get_backend()}), "
                      f"batch {args.batch_size} x {args.block_size} tokens per rank")
        console.print("optimizers: " + " + ".join(f"{type(o).__name__} ({sum(len(g['params']) for g in o.param_groups)} "
                                                  f"parameters, lr {o.defaults['lr']:g})" for o in optimizers))

    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tokens]:,.0f} tok/s")]
    if is_main:
        with Progress(*columns, console=console) as progress:
            result = train(model, optimizers, data, args, progress)
    else:
        result = train(model, optimizers, data, args, None)

    row = rank_row(model, result)
    rows: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(rows, row)
    first, last = mean_over_ranks(row["first_loss"], device), mean_over_ranks(row["last_loss"], device)
    if is_main:
        console.print(f"total parameters: {total_params:,}")
        print_report(console, rows, result, first, last)
    if args.timeline:
        write_timeline(console, result, Path(args.timeline))
    if args.save_pretrained:
        shardkit.checkpoint.save_pretrained(model, str(args.save_pretrained))
        if is_main:
            console.print(f"weights written to {args.save_pretrained} (safetensors; start from them with --pretrained)")
    return last < first


def write_timeline(console: Console, result: TrainResult, path: Path) -> None:
    """Rank 0 writes every rank's trace of the last steps as one Perfetto timeline."""
    traces = result.trace.gather()  # a collective: every rank sends its trace to rank 0
    if traces is None:
        return
    shardkit.timeline.write(traces, path)
    shown = path.resolve().relative_to(Path.cwd()) if path.resolve().is_relative_to(Path.cwd()) else path
    steps = min(TIMELINE_STEPS, result.steps)
    console.print(f"timeline of the last {steps} steps: {shown} (open at https://ui.perfetto.dev)",
                  highlight=False, soft_wrap=True)  # one line: the path and the link stay whole


def main() -> int:
    args = parse_args()
    device = setup_distributed()
    loss_fell = run(args, device)
    # The sharded parameters hold the device mesh, which holds the process group. If the group
    # outlives destroy_process_group (the model's hook cycles wait for the garbage collector),
    # gloo tears it down at interpreter exit and can abort while the peer rank is still
    # connected ("terminate called without an active exception"). So free it all first.
    gc.collect()
    dist.destroy_process_group()
    return 0 if loss_fell else 1


if __name__ == "__main__":
    sys.exit(main())
