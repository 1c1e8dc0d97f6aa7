"""How compiled mode's compile time grows with the block count, with and without regions.

    python benchmarks/compile_time.py [--layers 4,32] [--json PATH]   (or: make bench ARGS=--compile-time)

One process, the fake process group at world 2 (collectives return at once: compile time does
not depend on them). Per block count, the GPT (n_embd 256, 4 heads, sequences of 128, batch 2)
three ways, each compiled with inductor (``fullgraph=True``) in a fresh inductor cache, the FX
graph and autograd caches off (bench.py's part 4), after a tiny model has paid the process's
one-time costs; the wall time of the first forward + backward:

  unsharded compiled    the plain model
  compiled mode         shardkit.compiled.fully_shard on each block, then the root (no regions)
  compiled, regions     the same with region.REGIONS_FROM = 1: the blocks as ONE nested compile
                        region, traced and compiled once (shardkit/compiled/region.py)

The rows with regions run last: regions turn inductor's buffer reuse and in-place buffers off for the process
(region._no_buffer_reuse), and the other rows must compile as users' models do.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardkit.compiled
from shardkit.compiled import region
from shardkit.models.gpt import GPT, GPTConfig, apply_fully_shard

IMPLS = ("unsharded compiled", "compiled mode", "compiled, regions")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default="4,32", help="block counts, comma-separated")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", default=None, metavar="PATH")
    return parser.parse_args(argv)


def first_step_s(impl: str, layers: int, args: argparse.Namespace, mesh, cache_root: str) -> float:
    from torch._inductor.utils import fresh_cache

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=args.seq, n_layer=layers, n_head=4, n_embd=args.dim))
    if impl != "unsharded compiled":
        with regions_from(1 if impl == "compiled, regions" else layers + 1):
            model = apply_fully_shard(model, shardkit.compiled.fully_shard, mesh=mesh)
    model = torch.compile(model, fullgraph=True)
    x = torch.randint(0, 65, (2, args.seq), generator=torch.Generator().manual_seed(0))
    with fresh_cache(dir=tempfile.mkdtemp(dir=cache_root), delete=False):
        start = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        return time.perf_counter() - start


@contextlib.contextmanager
def regions_from(n: int):
    before, region.REGIONS_FROM = region.REGIONS_FROM, n
    try:
        yield
    finally:
        region.REGIONS_FROM = before


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.utils import fresh_cache

    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    counts = [int(n) for n in args.layers.split(",")]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    times: dict[str, dict[int, float]] = {impl: {} for impl in IMPLS}
    with tempfile.TemporaryDirectory() as cache_root:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_root
        with fresh_cache(dir=cache_root, delete=False):  # the process's one-time costs
            tiny = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)))
            tiny(torch.randn(2, 8)).sum().backward()
        mesh = init_device_mesh("cpu", (2,))
        for impl in IMPLS:  # regions last (see the top of this file)
            for layers in counts:
                times[impl][layers] = first_step_s(impl, layers, args, mesh, cache_root)
                Console().print(f"{impl}, {layers} blocks: {times[impl][layers]:.1f} s")
    dist.destroy_process_group()
    table = Table(title=f"first forward + backward, compile included (s); GPT n_embd {args.dim}, seq {args.seq}, inductor, caches off")
    table.add_column("")
    for layers in counts:
        table.add_column(f"{layers} blocks", justify="right")
    table.add_column(f"{counts[-1]} / {counts[0]} blocks", justify="right")
    base = times["unsharded compiled"]
    for impl in IMPLS:
        row = times[impl]
        table.add_row(impl, *(f"{row[n]:.1f} ({row[n] / base[n]:.2f}x)" for n in counts), f"{row[counts[-1]] / row[counts[0]]:.2f}")
    Console().print(table)
    Console().print("(Nx): against the unsharded model compiled, at the same block count.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "first_step_s": times}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
