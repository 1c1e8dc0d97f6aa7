"""Pretrained weights into a 2-rank sharded model: three recipes, their time and host memory.

    OMP_NUM_THREADS=1 python benchmarks/pretrained_bench.py [--trials 5] [--layers 3] [--width 768] [--dir DIR]

The demo's GPT at GPT-2 width (3 layers of 768, 12 heads, vocab 65, block 64: an 81.5 MiB fp32
safetensors file, the tied head stored once, under ``tok_emb.weight``), ``shardkit.fully_shard``
on 2 gloo ranks (the blocks, then the root). The recipes, each in a fresh pair of processes so
that their memory peaks do not mix:

1. ``load_pretrained``: the model built on the meta device and sharded, then
   ``shardkit.checkpoint.load_pretrained(model, file)``: each rank reads its rows (positional reads);
   (1b: the same into a model built and initialized first, to tell the read from the
   materialization);
2. ``rank 0 + scatter``: rank 0 reads the whole file (``safetensors.torch.load_file``), then
   ``shardkit.checkpoint.load_full_state_dict(model, sd or None, from_rank0=True)``;
3. ``every rank reads all``: every rank reads the whole file, then ``model.load_state_dict``.

Memory, per rank, on the first load in the fresh processes, from after the model is sharded
(built and initialized for 1b, 2 and 3, on the meta device for 1): the growth of the peak
resident set (VmHWM, reset through /proc/self/clear_refs; where that is not writable, the most
a thread sampling every 0.5 ms saw), and the most anonymous (allocated) and file-backed
(memory-mapped) memory that thread saw. The goal for recipe 1 is the rank's share of the file
plus the largest tensor. Time: the median over the other ``--trials - 1`` loads (recipe 1 each
into a fresh meta model) of the slower rank. Each rank also checks that every full tensor
equals the file's. The last column: the peak RSS growth of building and sharding the model,
before the load (a model built on the CPU is whole on every rank until it is sharded).
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
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
MiB = 1 << 20
RECIPES = {
    "load_pretrained": "1. load_pretrained (meta model)",
    "load_pretrained_built": "1b. load_pretrained (model built)",
    "rank0_scatter": "2. rank 0 reads, load_full_state_dict",
    "all_read": "3. every rank reads all, load_state_dict",
}


def config(args: argparse.Namespace):
    from shardkit.models import GPTConfig

    return GPTConfig(vocab_size=65, block_size=64, n_layer=args.layers, n_head=12, n_embd=args.width, dropout=0.0, tie_weights=True)


# Memory ---------------------------------------------------------------------------------------
def _status(*fields: str) -> list[int]:
    """/proc/self/status fields, in bytes."""
    out = dict.fromkeys(fields, 0)
    with open("/proc/self/status") as f:
        for line in f:
            name = line.split(":")[0]
            if name in out:
                out[name] = int(line.split()[1]) * 1024
    return [out[k] for k in fields]


class Peak:
    """The peak RSS from ``start()`` on: the kernel's high-water mark (VmHWM), reset through
    clear_refs; where that is not writable, the largest VmRSS a thread saw sampling every half
    millisecond. The thread runs either way, for the split: the most anonymous memory
    (RssAnon: allocations) and the most file-backed (RssFile: memory-mapped pages) it saw."""

    def __init__(self) -> None:
        self.kernel = True
        self.rss = self.anon = self.file = 0
        self._stop = threading.Event()

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.kernel = False
        self.start_rss, self.start_anon, self.start_file = _status("VmRSS", "RssAnon", "RssFile")
        self.rss, self.anon, self.file = self.start_rss, self.start_anon, self.start_file
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._take()
            time.sleep(0.0005)

    def _take(self) -> None:
        rss, anon, file = _status("VmRSS", "RssAnon", "RssFile")
        self.rss, self.anon, self.file = max(self.rss, rss), max(self.anon, anon), max(self.file, file)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        self._take()
        peak = _status("VmHWM")[0] if self.kernel else self.rss
        return dict(growth=peak - self.start_rss, anon=self.anon - self.start_anon, file=self.file - self.start_file, kernel=self.kernel)


# The ranks ------------------------------------------------------------------------------------
def rank_main(rank: int, recipe: str, file: str, args: argparse.Namespace, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    import shardkit
    from shardkit.checkpoint import load_full_state_dict
    from shardkit.checkpoint.pretrained import load_pretrained
    from shardkit.models import GPT, apply_fully_shard

    def build():
        if recipe == "load_pretrained":
            with torch.device("meta"):
                model = GPT(config(args))
        else:
            torch.manual_seed(1)
            model = GPT(config(args))
        return apply_fully_shard(model, shardkit.fully_shard)

    def load(model) -> None:
        if recipe.startswith("load_pretrained"):
            load_pretrained(model, file)
        elif recipe == "rank0_scatter":
            sd = None
            if rank == 0:
                sd = load_file(file)
                sd["head.weight"] = sd["tok_emb.weight"]  # tied: stored once
            load_full_state_dict(model, sd, from_rank0=True)
        else:
            sd = load_file(file)
            sd["head.weight"] = sd["tok_emb.weight"]
            model.load_state_dict(sd)

    def timed(model) -> float:
        gc.collect()
        dist.barrier()
        start = time.perf_counter()
        load(model)
        return time.perf_counter() - start

    # Trial 0, in a fresh process: the memory (and a time, under the sampling thread)
    gc.collect()
    building = Peak()
    building.start()
    model = build()
    built = building.stop()
    gc.collect()
    dist.barrier()
    peak = Peak()
    peak.start()
    start = time.perf_counter()
    load(model)
    first = time.perf_counter() - start
    memory = peak.stop()
    # Correct, not only fast: every full tensor is the file's (collectives, after the measurement)
    expected = load_file(file)
    expected["head.weight"] = expected["tok_emb.weight"]
    wrong = []
    for key, value in model.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if not torch.equal(value, expected[key]):
            wrong.append(key)
    share = sum(p._local_tensor.numel() * p._local_tensor.element_size() for p in {id(p): p for p in model.parameters()}.values())
    largest = max(t.numel() * t.element_size() for t in expected.values())
    del expected
    # Trials 1.., the times (each load_pretrained into a fresh meta model, as in trial 0)
    seconds = []
    for _ in range(args.trials - 1):
        if recipe == "load_pretrained":
            del model
            gc.collect()
            model = build()
        seconds.append(timed(model))
    result = dict(rank=rank, built=built, first=first, seconds=seconds or [first], memory=memory, wrong=wrong, share=share, largest=largest)
    with open(os.path.join(out_dir, f"{recipe}.rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    del model
    gc.collect()
    dist.destroy_process_group()


# The launcher ---------------------------------------------------------------------------------
def write_file(folder: str, args: argparse.Namespace) -> str:
    from safetensors.torch import save_file

    from shardkit.models import GPT

    torch.manual_seed(0)
    model = GPT(config(args))
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # tied: stored once
    path = os.path.join(folder, "model.safetensors")
    save_file({k: v.contiguous() for k, v in state.items()}, path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where to write the safetensors file (default: a temporary folder)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--trials", type=int, default=5, help="loads per recipe: the first for memory, the others timed")
    parser.add_argument("--recipes", default=",".join(RECIPES), help=f"a comma-separated subset of {','.join(RECIPES)}")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    recipes = args.recipes.split(",")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        file = write_file(folder, args)
        size = os.path.getsize(file)
        results = {}
        for recipe in recipes:
            mp.spawn(rank_main, args=(recipe, file, args, free_port(), folder), nprocs=WORLD)
            results[recipe] = []
            for r in range(WORLD):
                with open(os.path.join(folder, f"{recipe}.rank{r}.json")) as f:
                    results[recipe].append(json.load(f))
    print_table(results, size, args)


def print_table(results: dict, size: int, args: argparse.Namespace) -> None:
    def load_s(ranks) -> float:  # per trial the slower rank, then the median over trials
        return statistics.median(max(t) for t in zip(*(r["seconds"] for r in ranks)))

    first = results.get("load_pretrained")
    base_s = load_s(first) if first else None
    trials = len(next(iter(results.values()))[0]["seconds"])
    print(f"GPT {args.layers} x {args.width} (vocab 65, block 64): {size / MiB:.1f} MiB fp32 safetensors file, "
          f"{WORLD} gloo ranks, shardkit.fully_shard. load s: median of {trials} loads (the slower rank of each); "
          "memory: the first load in a fresh process, peak RSS growth from the sharded model, and of it what a "
          "thread sampling every 0.5 ms saw at most as allocations (anon) and as memory-mapped file pages (file)")
    print()
    print("| recipe | load s (vs 1.) | " + " | ".join(f"rank {r} peak RSS growth MiB (anon + file)" for r in range(WORLD))
          + " | correct | before it, build + shard: peak RSS growth MiB per rank |")
    print("|---|---|" + "---|" * WORLD + "---|---|")
    for recipe, ranks in results.items():
        seconds = load_s(ranks)
        ratio = f" ({seconds / base_s:.2f}x)" if base_s else ""
        growth = " | ".join(f"{r['memory']['growth'] / MiB:.1f} ({r['memory']['anon'] / MiB:.1f} + {r['memory']['file'] / MiB:.1f})" for r in ranks)
        ok = "yes" if not any(r["wrong"] for r in ranks) else "NO: " + ", ".join(sorted({k for r in ranks for k in r["wrong"]}))
        built = " / ".join(f"{r['built']['growth'] / MiB:.1f}" for r in ranks)
        print(f"| {RECIPES[recipe]} | {seconds:.3f}{ratio} | {growth} | {ok} | {built} |")
    if first:
        goal = " | ".join(f"{(r['share'] + r['largest']) / MiB:.1f}" for r in first)
        shares = " / ".join(f"{r['share'] / MiB:.1f}" for r in first)
        print(f"| goal for 1.: the rank's share ({shares} MiB) + the largest tensor ({first[0]['largest'] / MiB:.1f} MiB) | | {goal} | | |")
    if not all(r["memory"]["kernel"] for ranks in results.values() for r in ranks):
        print("\n(peaks sampled: /proc/self/clear_refs is not writable here)")


if __name__ == "__main__":
    sys.exit(main())
