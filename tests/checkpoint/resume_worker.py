"""One training run for the resume tests, in fresh processes: ``python resume_worker.py MODE
WORLD CKPT OUT``, spawning WORLD gloo ranks.

MODE: ``straight`` (10 steps), ``save`` (5 steps, then save to CKPT), ``resume`` (load CKPT
into a differently initialized model, then steps 5..9), ``crash`` (5 steps, then a save
that dies before it is published), ``save-async`` (5 steps, an asynchronous save, then steps
5..9 while it writes), ``crash-async`` (5 steps, then an asynchronous save that dies before it
is published), ``refuse`` (load CKPT, expecting a CheckpointError). Rank 0 writes
``{"losses": [...], "params": {name: full tensor as list}}`` or the error to OUT.
The global batch of a step is the same at every world size; each rank takes its chunk.

``python resume_worker.py serve``: a fork server for the tests (``serve``), so that torch and
shardkit are imported once for all their runs instead of once per run.
"""

import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import shardkit
from shardkit import checkpoint
from shardkit.models.gpt import GPT, GPTConfig, apply_fully_shard

STEPS, HALF = 10, 5
# Dropout makes the bit-identical resume depend on the restored RNG states; resuming on a
# different number of ranks (other RNG streams) runs without it (DROPOUT=0).
DROPOUT = float(os.environ.get("DROPOUT", "0.1"))


def batch(step: int, world: int, rank: int):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 65, (4, 17), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return x.chunk(world)[rank], y.chunk(world)[rank]


def _flat(state: dict) -> dict:
    return {k: v.flatten().tolist() for k, v in state.items()}


def run(rank: int, world: int, init_file: str, mode: str, ckpt: str, out: str) -> None:
    # Before any other thread: main() set the thread count before forking, so torch's thread
    # pool is rebuilt in this child at its next use. Torch 2.14/2.15 (CUDA builds, on the CPU)
    # start autograd device threads at the first backward after FSDP's lazy init, each of which
    # sets the thread count at its start; left to them, they race to rebuild the pool and one
    # may find none ("pool INTERNAL ASSERT FAILED ... Invalid thread pool!", an abort).
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(1 if mode == "resume" else 0)  # resume: different weights until loaded
    model = apply_fully_shard(GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, dropout=DROPOUT)), shardkit.fully_shard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    result: dict = {"losses": []}
    steps = range(STEPS) if mode in ("straight", "save-async") else range(HALF) if mode in ("save", "crash", "crash-async") else range(HALF, STEPS)
    torch.manual_seed(1234 + rank)  # dropout masks; resume restores the saved RNG state instead
    try:
        if mode in ("resume", "refuse"):
            meta = checkpoint.load(ckpt, model, opt)
            result["step"] = meta["step"]
            result["loaded"] = _flat(checkpoint.full_state_dict(model))
            if mode == "refuse":
                raise AssertionError("loading an incomplete checkpoint should fail")
        for step in steps:
            if step == HALF and mode == "save-async":  # training goes on while the files are written
                started = time.perf_counter()
                writing = checkpoint.save(ckpt, model, opt, step=HALF, extra={"note": "half way"}, async_save=True)
                result["stall_s"] = time.perf_counter() - started
                result["saved"] = _flat(checkpoint.full_state_dict(model))
            x, y = batch(step, world, rank)
            logits, _ = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            result["losses"].append((mean / world).item())
        if mode == "save-async":
            writing.result()
        if mode == "save":
            started = time.perf_counter()
            checkpoint.save(ckpt, model, opt, step=HALF, extra={"note": "half way"})
            result["stall_s"] = time.perf_counter() - started
            result["saved"] = _flat(checkpoint.full_state_dict(model))
        if mode == "crash":
            def die(*args):
                os._exit(3)  # killed after writing every shard, before publishing
            checkpoint._publish = die
            checkpoint.save(ckpt, model, opt, step=HALF)
        if mode == "crash-async":
            def die_later(*args):
                os._exit(3)  # the background half dies after writing every shard, before publishing
            checkpoint._publish = die_later
            checkpoint.save(ckpt, model, opt, step=HALF, async_save=True).result()
        result["params"] = _flat(checkpoint.full_state_dict(model))
    except checkpoint.CheckpointError as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    del model, opt
    dist.destroy_process_group()


def main(mode: str, world: int, ckpt: str, out: str) -> None:
    # A file store, fresh per run, not a TCP port: a free port picked here could be taken by
    # another process before rank 0 binds it (tests run beside other tests).
    fd, init_file = tempfile.mkstemp(prefix="resume-init-")
    os.close(fd)
    os.unlink(init_file)
    torch.set_num_threads(1)
    try:
        # fork: the ranks start without importing torch again (CPU only, nothing initialized yet)
        mp.start_processes(run, args=(world, init_file, mode, ckpt, out), nprocs=world, start_method="fork")
    finally:
        if os.path.exists(init_file):
            os.unlink(init_file)


def serve() -> None:
    """One run per line of stdin, ``{"argv": [MODE, WORLD, CKPT, OUT], "env": {...}, "log": path}``:
    a child forked from this process (which has only imported torch and shardkit) runs it as
    ``python resume_worker.py MODE WORLD CKPT OUT`` would, its output to ``log``, in a session
    of its own (killpg takes its ranks too). Answers two lines: ``{"pid": ...}`` when it starts,
    ``{"returncode": ...}`` when it ends."""
    global DROPOUT
    while line := sys.stdin.readline():
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.setsid()
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.environ.update(request["env"])
                DROPOUT = float(os.environ.get("DROPOUT", "0.1"))
                mode, world, ckpt, out = request["argv"]
                main(mode, int(world), ckpt, out)
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    else:
        main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
