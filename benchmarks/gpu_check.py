"""The prepared GPU check (``make gpu-check``): run it first whenever a GPU is lent.

On one GPU, NCCL at world 1, in a few minutes:

1. ``tests/gpu`` (pytest, in a subprocess);
2. parity: the GPT trained 5 steps with shardkit matches the unsharded model (losses, then
   every parameter, at 1e-5);
3. overlap: every all-gather is delayed on its side stream (``torch.cuda._sleep``, ``--delay-ms``)
   and every block computes longer than that. If block k+1's all-gather runs while block k
   computes, the delays hide behind compute: the step grows by far less than the sum of the
   delays. Printed with the exposed communication per step (device time the compute stream
   waited for collectives, from shardkit's trace);
4. the same GPT with shardkit and with torch's FSDP2: peak ``torch.cuda.max_memory_allocated``
   and median step time, side by side;
5. compiled mode: the GPT with ``shardkit.compiled.fully_shard`` and ``torch.compile(model,
   fullgraph=True)`` (inductor) against eager shardkit: losses over 3 AdamW steps (inductor's
   kernels round differently: 1e-4); then compiled mode, eager shardkit and torch's FSDP2
   (eager) side by side: median step time, peak memory (each model alone on the device, above
   what was allocated before it was built) and the first step's time (compiled mode's compile);
6. Muon: 8 ``nn.Linear(256, 256)`` blocks sharded by shardkit, their weights stepped by
   ``shardkit.optim.Muon`` and by ``torch.optim.Muon`` (DTensor ops), the same injected
   gradients, next to ``torch.optim.Muon`` on the unsharded weights: shardkit's parameters
   must end bit-identical to the unsharded ones after 5 steps; then the median step time of
   each. At world 1 no matrix travels (its one rank owns them all): what differs is DTensor's
   dispatch in torch's Newton-Schulz;
7. host overhead: 48 blocks of ``Linear(64)`` + ReLU, one group each, plain, shardkit and
   FSDP2: the host's time per step (forward, backward, AdamW; the GPU waited for between steps,
   not within them: tiny kernels, so the host is what limits), per group over the plain
   model's, shardkit's against FSDP2's (the fake-process-group figure of ``make bench`` part 2,
   here with CUDA streams, events and NCCL).

It prints one table and exits non-zero if a check failed. ``--cpu`` runs the same script on
the CPU (gloo, shardkit's simulated streams) to check the script itself; the GPU-only
measurements then say "n/a".
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import shardkit  # noqa: E402
import shardkit.compiled  # noqa: E402
import shardkit.optim  # noqa: E402
from shardkit.comm import collectives, sim  # noqa: E402
from shardkit.models.gpt import GPT, GPTConfig, apply_fully_shard  # noqa: E402

RESULTS: list[tuple[str, bool | None, str]] = []  # (check, passed (None: measured only), detail)


def report(check: str, passed: bool | None, detail: str) -> None:
    RESULTS.append((check, passed, detail))
    mark = {True: "ok", False: "FAIL", None: "--"}[passed]
    print(f"[{mark:>4}] {check}: {detail}", flush=True)


def run_gpu_tests(device: torch.device) -> None:
    if device.type != "cuda":
        return report("tests/gpu", None, "n/a on the CPU")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/gpu"], cwd=ROOT, capture_output=True, text=True)
    tail = (out.stdout.strip().splitlines() or ["no output"])[-1]
    report("tests/gpu", out.returncode == 0, f"{tail} ({time.perf_counter() - start:.0f} s)")
    if out.returncode != 0:
        print(out.stdout[-4000:], out.stderr[-2000:], sep="\n")


def gpt_config(**overrides) -> GPTConfig:
    return GPTConfig(**{"vocab_size": 512, "block_size": 128, "n_layer": 4, "n_head": 8, "n_embd": 256, **overrides})


def gpt(device: torch.device, **overrides) -> GPT:
    torch.manual_seed(0)
    return GPT(gpt_config(**overrides)).to(device)


def batches(device: torch.device, config: GPTConfig, n: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (batch, config.block_size)
    return [(torch.randint(0, config.vocab_size, shape, generator=g).to(device),
             torch.randint(0, config.vocab_size, shape, generator=g).to(device)) for _ in range(n)]


def check_parity(mesh, device: torch.device) -> None:
    model = gpt(device)
    ref = copy.deepcopy(model)
    apply_fully_shard(model, shardkit.fully_shard, mesh=mesh)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, ref))
    worst = 0.0
    for x, y in batches(device, ref.config, 5):
        for m, o in ((model, opt), (ref, ref_opt)):
            _, loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            if m is model:
                sharded_loss = loss.detach()
        worst = max(worst, (sharded_loss - loss.detach()).abs().item())
    names = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        worst = max(worst, (p.full_tensor() - names[name]).abs().max().item())
    report("NCCL world-1 parity" if device.type == "cuda" else "gloo world-1 parity", worst <= 1e-5,
           f"5 AdamW steps of a 4-layer GPT: largest difference {worst:.2e} (loss and parameters)")


class Heavy(nn.Module):
    """A block whose forward takes a few milliseconds on a GPU."""

    def __init__(self, dim: int, repeats: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.repeats = repeats

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.repeats):
            x = torch.tanh(self.lin(x))
        return x


@contextlib.contextmanager
def delayed_all_gathers(delay_ms: float, device: torch.device):
    """Every all-gather waits ``delay_ms`` on its side stream first (a slow network)."""
    real, skips = collectives._all_gather_single, collectives.ONE_RANK_SKIPS
    cycles = int(delay_ms * sleep_cycles_per_ms()) if device.type == "cuda" else 0

    def slow(*args, **kwargs):
        if cycles:
            torch.cuda._sleep(cycles)
        return real(*args, **kwargs)

    collectives._all_gather_single, collectives.ONE_RANK_SKIPS = slow, False  # world 1: gather all the same
    try:
        yield
    finally:
        collectives._all_gather_single, collectives.ONE_RANK_SKIPS = real, skips


def sleep_cycles_per_ms() -> float:
    """Calibrate ``torch.cuda._sleep``: how many of its cycles make a millisecond here."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm up
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def timed_steps(model: nn.Module, x: torch.Tensor, steps: int, device: torch.device) -> tuple[float, shardkit.Trace]:
    """Median step time (ms) over ``steps`` after two warm-up steps, and the last step's trace."""
    times = []
    for i in range(steps + 2):
        sync(device)
        start = time.perf_counter()
        with shardkit.trace() as t:
            model(x).sum().backward()
            sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:]), t


def check_overlap(mesh, device: torch.device, delay_ms: float) -> None:
    if device.type != "cuda" and sim.current() is not None:
        return report("overlap", None, "n/a on the CPU (the simulated streams run each collective at once)")
    torch.manual_seed(0)
    n_blocks, dim = 6, 2048 if device.type == "cuda" else 64
    model = nn.Sequential(*[Heavy(dim, repeats=8) for _ in range(n_blocks)]).to(device)
    for block in model:
        shardkit.fully_shard(block, mesh=mesh)
    shardkit.fully_shard(model, mesh=mesh)
    x = torch.randn(4096 if device.type == "cuda" else 64, dim, device=device)
    plain_ms, _ = timed_steps(model, x, 5, device)
    with delayed_all_gathers(delay_ms, device):
        slow_ms, t = timed_steps(model, x, 5, device)
    gathers = len(t.collectives("all_gather"))
    added, serial = slow_ms - plain_ms, gathers * delay_ms
    exposed = {kind: s.exposed_ns / 1e6 for kind, s in t.summary().items() if s.calls}
    forward_ms = plain_ms / 3  # backward costs about twice the forward
    report("overlap", added < 0.5 * serial,
           f"{gathers} all-gathers delayed {delay_ms} ms each: step {plain_ms:.1f} -> {slow_ms:.1f} ms "
           f"(+{added:.1f} ms; serialized would be +{serial:.0f} ms; block forward ~{forward_ms / n_blocks:.1f} ms); "
           "exposed per step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in exposed.items()))


def measure_against_fsdp2(mesh, device: torch.device) -> None:
    rows = {}
    size = dict(n_layer=8, n_embd=1024, n_head=16, block_size=256) if device.type == "cuda" else {}
    for impl, shard in (("shardkit", shardkit.fully_shard), ("fsdp2", torch_fully_shard)):
        model = gpt(device, **size)
        apply_fully_shard(model, shard, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        data = batches(device, model.config, 12, batch=8)
        reset_peak(device)
        times, losses = train_timed(model, opt, data, device)
        rows[impl] = (statistics.median(times[2:]), peak(device), losses[-1])
    (s_ms, s_peak, s_loss), (f_ms, f_peak, f_loss) = rows["shardkit"], rows["fsdp2"]
    same = abs(s_loss - f_loss) <= 1e-3 * abs(f_loss)
    peaks = f"peak {s_peak / 2**20:.0f} vs {f_peak / 2**20:.0f} MiB ({s_peak / f_peak:.2f}x)" if f_peak else "peak n/a on the CPU"
    report(f"vs FSDP2 ({model_name(size)})", same,
           f"step {s_ms:.1f} vs {f_ms:.1f} ms ({s_ms / f_ms:.2f}x), {peaks}, last loss {s_loss:.5f} vs {f_loss:.5f}")


def check_host_overhead(mesh, device: torch.device, blocks: int = 48, dim: int = 64, steps: int = 30) -> None:
    def stack() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(blocks))).to(device)

    models = {"plain": stack()}
    for impl, shard in (("shardkit", shardkit.fully_shard), ("fsdp2", torch_fully_shard)):
        model = stack()
        for block in model:
            shard(block, mesh=mesh)
        models[impl] = shard(model, mesh=mesh)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True) for name, m in models.items()}
    x = torch.randn(8, dim, device=device)
    host_ms = {name: [] for name in models}
    for step in range(steps + 3):
        for name, model in models.items():  # interleaved: drift hits all three alike
            sync(device)
            start = time.perf_counter()
            model(x).sum().backward()
            opts[name].step()
            opts[name].zero_grad()
            if step >= 3:
                host_ms[name].append((time.perf_counter() - start) * 1000)
    ms = {name: statistics.median(t) for name, t in host_ms.items()}
    us = {impl: (ms[impl] - ms["plain"]) * 1000 / (blocks + 1) for impl in ("shardkit", "fsdp2")}
    report("host overhead", None, f"per group per step over the plain model: shardkit {us['shardkit']:.0f} us, FSDP2 "
           f"{us['fsdp2']:.0f} us ({us['shardkit'] / us['fsdp2']:.2f}x); plain step {ms['plain']:.1f} ms, {blocks + 1} groups")


def train_timed(model: nn.Module, opt: torch.optim.Optimizer, data: list, device: torch.device) -> tuple[list[float], list[float]]:
    """An AdamW step per batch: each step's milliseconds and loss."""
    times, losses = [], []
    for x, y in data:
        sync(device)
        start = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync(device)
        times.append((time.perf_counter() - start) * 1e3)
        losses.append(loss.item())
    return times, losses


COMPILED_MODE_IMPLS = {"compiled": shardkit.compiled.fully_shard, "eager": shardkit.fully_shard, "fsdp2": torch_fully_shard}
WARMUP = 3  # steps before the timed ones: compiled mode compiles in the first; the parity losses


def check_compiled_mode(mesh, device: torch.device) -> None:
    """Compiled mode against eager shardkit and FSDP2 (eager) on the same GPT and batches: the
    same losses over the warm-up steps, then median step time, peak memory and the first step's
    time. One model at a time: each is built, trained and freed before the next, and its peak
    is ``max_memory_allocated`` over the timed steps above what was allocated before it was built."""
    data = batches(device, gpt_config(), WARMUP + 10)
    losses, ms, peaks, first = {}, {}, {}, {}
    for name, fully_shard in COMPILED_MODE_IMPLS.items():
        gc.collect()
        reset_peak(device)
        base = allocated(device)
        model = apply_fully_shard(gpt(device), fully_shard, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if name == "compiled":
            model = torch.compile(model, fullgraph=True)
        warm_times, losses[name] = train_timed(model, opt, data[:WARMUP], device)
        reset_peak(device)
        times, _ = train_timed(model, opt, data[WARMUP:], device)
        ms[name], peaks[name], first[name] = statistics.median(times), peak(device) - base, warm_times[0] / 1e3
        del model, opt
        if name == "compiled":
            torch._dynamo.reset()  # drop its compiled graphs (and what they hold) before the next model
    worst = max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))
    fsdp2_gap = max(abs(a - b) for a, b in zip(losses["eager"], losses["fsdp2"]))
    report("compiled mode parity", worst <= 1e-4, f"{WARMUP} AdamW steps against eager shardkit: largest loss difference {worst:.2e} "
           f"(FSDP2 against eager shardkit: {fsdp2_gap:.2e})")
    c, e, f = ms["compiled"], ms["eager"], ms["fsdp2"]
    if peaks["eager"] > 0 and peaks["fsdp2"] > 0:
        memory = (f"peak {peaks['compiled'] / 2**20:.0f} / {peaks['eager'] / 2**20:.0f} / {peaks['fsdp2'] / 2**20:.0f} MiB "
                  f"({peaks['compiled'] / peaks['eager']:.2f}x eager, {peaks['compiled'] / peaks['fsdp2']:.2f}x FSDP2)")
    else:
        memory = "peak n/a on the CPU"
    report("compiled mode speed", None, f"compiled / eager shardkit / FSDP2: step {c:.1f} / {e:.1f} / {f:.1f} ms "
           f"(compiled {c / e:.2f}x eager, {c / f:.2f}x FSDP2; eager {e / f:.2f}x FSDP2), {memory}; "
           f"first step {first['compiled']:.1f} / {first['eager']:.1f} / {first['fsdp2']:.1f} s (compiled mode's compile)")


def check_muon(mesh, device: torch.device) -> None:
    """shardkit.optim.Muon against torch.optim.Muon on the same sharded weights and on the
    unsharded ones: parity after 5 steps, then the median of 20 more steps."""
    dim = 256 if device.type == "cuda" else 64  # the CPU's bf16 products are slow: there we check the script
    torch.manual_seed(0)
    base = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(8))).to(device)
    models = {"shardkit": copy.deepcopy(base), "torch": copy.deepcopy(base), "local": base}
    for name in ("shardkit", "torch"):
        for block in models[name]:
            shardkit.fully_shard(block, mesh=mesh)
        shardkit.fully_shard(models[name], mesh=mesh)
    kinds = {"shardkit": shardkit.optim.Muon, "torch": torch.optim.Muon, "local": torch.optim.Muon}
    weights = {name: [block.weight for block in m] for name, m in models.items()}  # Muon steps the matrices only
    optims = {name: kinds[name](weights[name], lr=0.02) for name in models}
    g = torch.Generator().manual_seed(1)
    grads = [[torch.randn(dim, dim, generator=g).to(device) for _ in range(8)] for _ in range(5)]  # per step, (D, D) each
    times = {name: [] for name in models}
    for step in range(25):
        for name in models:  # the same gradients for all three; the sharded ones get their rows
            for w, grad in zip(weights[name], grads[step % 5]):
                w.grad = distribute_tensor(grad, mesh, w.placements, src_data_rank=None) if isinstance(w, DTensor) else grad.clone()
            sync(device)
            start = time.perf_counter()
            optims[name].step()
            sync(device)
            times[name].append((time.perf_counter() - start) * 1e3)
        if step == 4:
            error = {name: max((w.full_tensor() - ref).abs().max().item() for w, ref in zip(weights[name], weights["local"]))
                     for name in ("shardkit", "torch")}
    report("Muon parity", error["shardkit"] == 0.0,
           f"8 x Linear({dim}, {dim}), 5 steps against torch.optim.Muon unsharded: shardkit.optim.Muon max |diff| "
           f"{error['shardkit']:.3g} (bit-identical expected), torch.optim.Muon on the DTensors {error['torch']:.3g}")
    ms = {name: statistics.median(t[5:]) for name, t in times.items()}
    report("Muon speed", None, f"step {ms['shardkit']:.2f} ms vs torch.optim.Muon on the DTensors {ms['torch']:.2f} ms "
           f"({ms['shardkit'] / ms['torch']:.2f}x), unsharded {ms['local']:.2f} ms ({ms['shardkit'] / ms['local']:.2f}x)")


def model_name(size: dict) -> str:
    return f"GPT {size.get('n_layer', 4)} x {size.get('n_embd', 256)}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="check this script on the CPU (gloo, simulated streams)")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="the delay put before each all-gather")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29633")
    if args.cpu:
        device, backend = torch.device("cpu"), "gloo"
    elif not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU (use --cpu to check the script itself)")
        return 2
    else:
        device, backend = torch.device("cuda", 0), "nccl"
        torch.cuda.set_device(device)
    start = time.perf_counter()
    run_gpu_tests(device)
    dist.init_process_group(backend, rank=0, world_size=1)
    try:
        mesh = init_device_mesh(device.type, (1,))
        with sim.checking() if args.cpu else contextlib.nullcontext() as checker:
            check_parity(mesh, device)
            check_overlap(mesh, device, args.delay_ms)
            measure_against_fsdp2(mesh, device)
            check_muon(mesh, device)
            check_host_overhead(mesh, device)
        if checker is not None:
            report("simulated streams", checker.races == 0, checker.summary())
        check_compiled_mode(mesh, device)  # outside the checker: dynamo compiles nothing under a dispatch mode
    finally:
        dist.destroy_process_group()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\ngpu-check on {name}, torch {torch.__version__}, {time.perf_counter() - start:.0f} s")
    width = max(len(c) for c, _, _ in RESULTS)
    for check, passed, detail in RESULTS:
        print(f"  {check:<{width}}  {({True: 'ok', False: 'FAIL', None: '--'}[passed]):<4}  {detail}")
    return 1 if any(passed is False for _, passed, _ in RESULTS) else 0


if __name__ == "__main__":
    sys.exit(main())
