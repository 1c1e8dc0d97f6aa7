"""What checkpoint integrity and asynchronous saving cost, on 2 gloo ranks on the CPU.

    python benchmarks/checkpoint_bench.py [--dir DIR]

Part 1, checksums: a model of about 100 MB of fp32 parameters (with AdamW state, so ~300 MB
written) is saved and loaded 3 times; the table shows the median save and load times and,
inside them, the time rank 0 spends computing CRC-32s: while writing, and on load for each
item it reads (plus ``.metadata`` read back).

Part 2, the training stall: the demo's GPT (4 layers, 128 wide) trains; at one step it saves,
either synchronously or with ``async_save=True``. The stall is how long the ``save`` call keeps
the training loop from its next step; for the asynchronous save the table also shows the
median step time while the files were being written, against steps without a save.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
import zlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import checkpoint
from shardkit.checkpoint import manifest, trust
from shardkit.models import GPT, GPTConfig, apply_fully_shard

REPEATS = 3


def timed_checksums() -> list[float]:
    """Time every CRC-32 the checkpoint code computes (while writing, on load, reading back)."""
    spent = [0.0]

    class Timed:
        @staticmethod
        def crc32(data, value=0):
            start = time.perf_counter()
            try:
                return zlib.crc32(data, value)
            finally:
                spent[0] += time.perf_counter() - start

    manifest.zlib = trust.zlib = Timed
    return spent


def checksum_cost(folder: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])  # 25.2 M parameters: 101 MB in fp32
    for layer in model:
        shardkit.fully_shard(layer)
    shardkit.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    spent = timed_checksums()
    rows = {"save": [], "save crc": [], "load": [], "load crc": []}
    for i in range(REPEATS):
        for kind in ("save", "load"):
            dist.barrier()
            spent[0] = 0.0
            start = time.perf_counter()
            if kind == "save":
                checkpoint.save(os.path.join(folder, "big"), model, opt, step=i)
            else:
                checkpoint.load(os.path.join(folder, "big"), model, opt)
            rows[kind].append(time.perf_counter() - start)
            rows[f"{kind} crc"].append(spent[0])
    return {k: statistics.median(v) for k, v in rows.items()}


def training_stall(folder: str, async_save: bool) -> dict:
    torch.manual_seed(0)
    model = apply_fully_shard(GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)), shardkit.fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    steps, stall, writing, pending = [], 0.0, [], None
    for step in range(16):
        tokens = torch.randint(0, 65, (8, 65), generator=g)
        start = time.perf_counter()
        logits, _ = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        took = time.perf_counter() - start
        (writing if pending is not None and not pending.done() else steps).append(took)
        if step == 8:
            start = time.perf_counter()
            pending = checkpoint.save(os.path.join(folder, f"demo_{async_save}"), model, opt, step=step, async_save=async_save)
            stall = time.perf_counter() - start
    if pending is not None:
        pending.result()
    return {"stall": stall, "step": statistics.median(steps[2:]), "steps while writing": len(writing),
            "step while writing": statistics.median(writing) if writing else float("nan")}


def worker(rank: int, port: int, folder: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    cost = checksum_cost(folder)
    sync = training_stall(folder, False)
    asynchronous = training_stall(folder, True)
    if rank == 0:
        out.update(cost=cost, sync=sync, asynchronous=asynchronous)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as folder, mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(worker, args=(port, folder, out), nprocs=2, start_method="fork")
        cost, sync, asynchronous = out["cost"], out["sync"], out["asynchronous"]
    print(f"checksums, ~100 MB of parameters + AdamW state, 2 ranks, median of {REPEATS}:")
    for kind in ("save", "load"):
        share = cost[f"{kind} crc"] / cost[kind]
        print(f"  {kind}: {cost[kind] * 1e3:8.1f} ms, of which CRC-32 {cost[f'{kind} crc'] * 1e3:6.1f} ms ({share:.1%}, rank 0)")
    print("training stall at a save, the demo's GPT (4x128), 2 ranks:")
    print(f"  synchronous save: {sync['stall'] * 1e3:8.1f} ms (a step takes {sync['step'] * 1e3:.1f} ms)")
    print(f"  async_save=True:  {asynchronous['stall'] * 1e3:8.1f} ms, then {asynchronous['steps while writing']} steps "
          f"while writing, median {asynchronous['step while writing'] * 1e3:.1f} ms (without a save {asynchronous['step'] * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
