"""Pipeline parallel (torch.distributed.pipelining) x FSDP on 4 gloo ranks: torch's FSDP2 and
shardkit side by side, against an unsharded reference.

Run with ``torchrun --standalone --nproc-per-node 4 tests/gloo/pp_worker.py`` (OMP_NUM_THREADS=1);
tests/gloo/test_pipeline.py does. For each implementation ("fsdp2", "shardkit") and each
schedule (GPipe, 1F1B, Interleaved1F1B) it builds a (pp=2, dp=2) mesh, a model of 4 residual
MLP blocks split into pipeline stages, each block and each stage module ``fully_shard``-ed on
"dp", trains 2 SGD steps with 4 microbatches, and prints on rank 0 one JSON line per case::

    {"impl": ..., "schedule": ..., "ok": true, "max_diff": ..., "all_gathers": ..., "reductions": ...,
     "groups_with_params": ..., "step_counts": [...], "error": null, ...}

``max_diff``: the largest |parameter - reference| after the 2 steps, over every parameter of
every rank (``full_tensor()`` of the DTensors). ``all_gathers`` / ``reductions``: the
collectives rank 0 issued in the second step (the first also runs torch's metadata inference,
a real forward and backward, so it is reported apart in ``step_counts``), on any process group
but the "pp" one, P2P (send/recv) excluded. A reduction is a reduce-scatter, an all-reduce, or
an all-to-all (shardkit's gloo route for a reduce-scatter: an all-to-all, then a local sum).

The reference is the same full model trained on the global batch (both dp ranks' rows) with the
same SGD: the schedules' default ``scale_grads=True`` divides the gradients by the number of
microbatches (the loss is a per-microbatch mean), and FSDP averages over dp, so with equal
microbatches the gradient is that of the mean loss over the global batch.

A case that raises (on any rank) is reported with its error and the others still run: each case
gets fresh process groups with a short timeout, so a rank stuck in a collective of a failed case
gives up, and all ranks agree on each case's outcome on the world group. A watchdog ends the
process should a case still outlast ``CASE_WALL_S`` (the lines printed so far stay).

``--trace`` adds, per case, the FSDPModule methods the pipelining schedule called on rank 0 in
each step (unshard, reshard, set_* and FSDP2's FSDPParamGroup.post_backward and
_root_post_backward_final_callback), run-length encoded.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import functools
import json
import os
import sys
import threading
import time
import traceback
from contextlib import ExitStack, contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

IMPLS = ("fsdp2", "shardkit")
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}
DIM, N_BLOCKS, ROWS_PER_DP, N_MICROBATCHES, STEPS, LR = 16, 4, 8, 4, 2, 0.1
PP, DP = 2, 2
CASE_GROUP_TIMEOUT_S = 20  # each case's pp/dp groups: a rank stuck in a failed case's collective gives up
WORLD_TIMEOUT_S = 90  # the world group, used only to agree on each case's outcome (> the above)
CASE_WALL_S = 150  # the watchdog: a case that outlasts this ends the process
# torch 2.13's share_comm_ctx breaks FSDP2 under ScheduleInterleaved1F1B: the stages share one
# comm_ctx.post_forward_order, which the first stage to finish its last backward clears (in
# _root_post_backward_final_callback, is_last_backward=True) while the rank's other stage still
# holds indices into it for its remaining backwards: IndexError in FSDPParamGroup._backward_prefetch
# on the last pp rank (stage 3 finishes before stage 1). So FSDP2 runs without it by default
# (--share-comm-ctx both reproduces the error).
FSDP2_SHARE_COMM_CTX = False


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, DIM)
        self.lin2 = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + self.lin2(torch.tanh(self.lin1(x)))


class Stage(nn.Module):
    """A pipeline stage: some of the model's blocks, run in order."""

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def full_model() -> nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same one
    return nn.Sequential(*(Block() for _ in range(N_BLOCKS)))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both dp ranks' rows of a step: dp rank d holds rows [d * ROWS_PER_DP, (d + 1) * ROWS_PER_DP)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(DP * ROWS_PER_DP, DIM, generator=g), torch.randn(DP * ROWS_PER_DP, DIM, generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


def stage_layout(schedule: str) -> tuple[int, dict[int, list[int]]]:
    """(number of stages, {stage index: the global block indices it holds}); stage i runs on pp rank i % PP."""
    n_stages = PP * 2 if schedule == "Interleaved1F1B" else PP
    per = N_BLOCKS // n_stages
    return n_stages, {s: list(range(s * per, (s + 1) * per)) for s in range(n_stages)}


def implementation(impl: str):
    """(fully_shard, FSDPModule class, share_comm_ctx or None) of an implementation."""
    if impl == "fsdp2":
        from torch.distributed.fsdp import FSDPModule, fully_shard, share_comm_ctx
        return fully_shard, FSDPModule, share_comm_ctx
    import shardkit
    return shardkit.fully_shard, shardkit.FSDPModule, getattr(shardkit, "share_comm_ctx", None)


# Collectives ------------------------------------------------------------------------------
# Like tests/fuzz/sequences.py's Collectives (c10d ops seen below the dispatcher, whoever issues
# them), but it also names the process group, so that the pp group's ops can be left out (pp and
# dp both have 2 ranks here, so the group's size cannot tell them apart).
_GROUP_ARG = {"_allgather_base": 2, "allgather": 2, "allgather_into_tensor_coalesced": 2,
              "_reduce_scatter_base": 2, "reduce_scatter": 2, "reduce_scatter_tensor_coalesced": 2,
              "allreduce": 1, "allreduce_coalesced": 1, "alltoall_base": 2, "alltoall": 2,
              "broadcast": 1, "barrier": 1}
_KIND = {"_allgather_base": "all_gather", "allgather": "all_gather", "allgather_into_tensor_coalesced": "all_gather",
         "_reduce_scatter_base": "reduction", "reduce_scatter": "reduction", "reduce_scatter_tensor_coalesced": "reduction",
         "allreduce": "reduction", "allreduce_coalesced": "reduction", "alltoall_base": "reduction", "alltoall": "reduction"}


class Collectives(TorchDispatchMode):
    """Records the c10d collectives (not send/recv) issued below the dispatcher, with their group."""

    def __init__(self, skip_groups: set[str]) -> None:
        super().__init__()
        self.skip_groups = skip_groups
        self.seen: list[tuple[str, str, str, int]] = []  # (kind, c10d op, group name, group size)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("c10d::"):
            op = name.removeprefix("c10d::").rstrip("_")
            if op in _GROUP_ARG:
                group = dist.ProcessGroup.unbox(args[_GROUP_ARG[op]])
                if group.group_name not in self.skip_groups and group.size() > 1:
                    self.seen.append((_KIND.get(op, "other"), op, group.group_name, group.size()))
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict[str, int]:
        kinds = [s[0] for s in self.seen]
        return {"all_gathers": kinds.count("all_gather"), "reductions": kinds.count("reduction"),
                "other": kinds.count("other"), "ops": sorted({s[1] for s in self.seen})}


# Which FSDPModule methods the schedule calls (--trace) ---------------------------------------
TRACED_METHODS = ("unshard", "reshard", "set_requires_gradient_sync", "set_reshard_after_backward",
                  "set_is_last_backward")


@contextmanager
def traced_calls(fsdp_cls: type, stage_modules: list[nn.Module], labels: dict[int, str], log: list[str]):
    """Wraps the FSDPModule methods, and the FSDP2 internals pipelining calls, to log each call.

    The internals: what torch's ``fully_shard.state(stage)`` returns (FSDP2's FSDPState, or
    what an implementation puts there for pipelining): its ``_root_post_backward_final_callback``
    and its param groups' ``post_backward``. FSDP2's own autograd hooks call the same two, so
    its log also holds the calls made by backward itself; another implementation's log holds
    only pipelining's (its hooks run its own code)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    patched: list[tuple[type, str, object]] = []

    def wrap(owner: type, name: str, label_of) -> None:
        original = owner.__dict__.get(name)
        if original is None or any(o is owner and n == name for o, n, _ in patched):
            return

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):
            shown = ",".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items() if k != "async_op"])
            if kwargs.get("async_op"):
                shown = (shown + ",async" if shown else "async")
            log.append(f"{name}({label_of(self)}{':' + shown if shown else ''})")
            return original(self, *args, **kwargs)

        patched.append((owner, name, original))
        setattr(owner, name, wrapper)

    def owner_of(cls: type, name: str) -> type | None:  # where the method is defined (the dynamic FSDP<Module> classes inherit it)
        return next((c for c in cls.__mro__ if name in c.__dict__), None)

    module_label = lambda m: labels.get(id(m), type(m).__name__)
    group_label = lambda g: "+".join(module_label(m) for m in getattr(g, "modules", None) or getattr(getattr(g, "_state", None), "modules", ()))
    for name in TRACED_METHODS:
        if owner := owner_of(fsdp_cls, name):
            wrap(owner, name, module_label)
    for module in stage_modules:
        try:
            state = torch_fully_shard.state(module)
        except Exception:  # noqa: BLE001 - nothing there to trace
            continue
        if state is None:
            continue
        if owner := owner_of(type(state), "_root_post_backward_final_callback"):
            wrap(owner, "_root_post_backward_final_callback", lambda st: "root")
        for sub in state._state_ctx.all_states:
            for group in sub._fsdp_param_groups:
                if owner := owner_of(type(group), "post_backward"):
                    wrap(owner, "post_backward", group_label)
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def run_length(log: list[str]) -> list[str]:
    out: list[list] = []
    for entry in log:
        if out and out[-1][0] == entry:
            out[-1][1] += 1
        else:
            out.append([entry, 1])
    return [e if n == 1 else f"{e} x{n}" for e, n in out]


# One case -----------------------------------------------------------------------------------
def case_mesh():
    """A fresh (pp, dp) mesh whose groups time out after CASE_GROUP_TIMEOUT_S."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=CASE_GROUP_TIMEOUT_S)
    return init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"),
                            backend_override={"pp": ("gloo", options), "dp": ("gloo", options)})


def run_case(impl: str, schedule: str, mesh, trace: bool = False, share: bool | None = None) -> dict:
    """This rank's part of a case: its max |param - reference|, and its collectives per step.

    ``share``: call the implementation's share_comm_ctx on the interleaved schedule's stage
    modules (where it has one); None: shardkit's, not FSDP2's (see FSDP2_SHARE_COMM_CTX)."""
    fully_shard, fsdp_cls, share_comm_ctx = implementation(impl)
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    dp_mesh, pp_group = mesh["dp"], mesh["pp"].get_group()
    n_stages, layout = stage_layout(schedule)
    full = full_model()
    reference = copy.deepcopy(full)

    stages: dict[int, Stage] = {}
    labels: dict[int, str] = {}
    for s in range(pp_rank, n_stages, PP):
        module = Stage([copy.deepcopy(full[b]) for b in layout[s]])
        for b, block in zip(layout[s], module.blocks):
            fully_shard(block, mesh=dp_mesh)
            labels[id(block)] = f"s{s}.b{b}"
        fully_shard(module, mesh=dp_mesh)
        labels[id(module)] = f"s{s}"
        stages[s] = module
    shared = False
    if share is None:
        share = impl != "fsdp2" or FSDP2_SHARE_COMM_CTX
    if schedule == "Interleaved1F1B" and share and share_comm_ctx is not None:
        share_comm_ctx(list(stages.values()))
        shared = True

    pipeline_stages = [PipelineStage(m, s, n_stages, device=torch.device("cpu"), group=pp_group) for s, m in stages.items()]
    cls = SCHEDULES[schedule]
    if cls is ScheduleInterleaved1F1B:
        runner = cls(pipeline_stages, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)
    else:
        (only,) = pipeline_stages
        runner = cls(only, n_microbatches=N_MICROBATCHES, loss_fn=loss_fn)
    params = [p for m in stages.values() for p in m.parameters()]
    optimizer = torch.optim.SGD(params, lr=LR)
    has_first, has_last = 0 in stages, n_stages - 1 in stages

    step_counts, calls = [], []
    rows = slice(dp_rank * ROWS_PER_DP, (dp_rank + 1) * ROWS_PER_DP)
    for step in range(STEPS):
        x, y = global_batch(step)
        x, y = x[rows], y[rows]
        log: list[str] = []
        recorder = Collectives(skip_groups={pp_group.group_name})
        with ExitStack() as stack:
            if trace:
                stack.enter_context(traced_calls(type(next(iter(stages.values()))), list(stages.values()), labels, log))
            stack.enter_context(recorder)
            args = (x,) if has_first else ()
            kwargs = {"target": y} if has_last else {}
            runner.step(*args, **kwargs)
            optimizer.step()
            optimizer.zero_grad()
        step_counts.append(recorder.counts())
        calls.append(run_length(log))

    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = global_batch(step)
        loss_fn(reference(x), y).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()

    max_diff = 0.0
    for s, module in stages.items():
        for b, block in zip(layout[s], module.blocks):
            for name, p in block.named_parameters():
                full_p = p.full_tensor() if isinstance(p, DTensor) else p
                want = reference[b].get_parameter(name)
                max_diff = max(max_diff, (full_p.detach() - want.detach()).abs().max().item())
    groups_with_params = sum(1 for m in stages.values() for mod in m.modules() if isinstance(mod, fsdp_cls) and own_params(mod, fsdp_cls))
    return {"max_diff": max_diff, "step_counts": step_counts, "calls": calls, "shared_comm_ctx": shared,
            "groups_with_params": groups_with_params, "is_fsdp_module": isinstance(next(iter(stages.values())), _torch_fsdp_module())}


def own_params(module: nn.Module, fsdp_cls: type) -> list[nn.Parameter]:
    """The parameters of ``module``'s FSDP group: those below it but not below a nested FSDP module."""
    found = list(module.parameters(recurse=False))
    for child in module.children():
        if not isinstance(child, fsdp_cls):
            found += own_params(child, fsdp_cls)
    return found


def _torch_fsdp_module() -> type:
    from torch.distributed.fsdp import FSDPModule
    return FSDPModule


def describe(e: BaseException) -> str:
    """One line: the error and, when it wraps another (pipelining's RuntimeError around a
    backward's error), the innermost cause."""
    def line(x: BaseException) -> str:
        text = next((t for t in str(x).splitlines() if t.strip()), "")
        return f"{type(x).__name__}: {text}"[:300]

    root = e
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    return line(e) if root is e else f"{line(e)} (caused by {line(root)})"


@contextmanager
def watchdog(what: str, seconds: float):
    """Ends the process (after dumping every thread's stack) should the block outlast ``seconds``."""
    def fire():
        sys.stderr.write(f"[rank {dist.get_rank()}] {what} outlasted {seconds} s: giving up\n")
        faulthandler.dump_traceback(all_threads=True)
        if dist.get_rank() == 0:
            print(json.dumps({"impl": what.split()[0], "schedule": what.split()[1], "ok": False,
                              "error": f"watchdog: no outcome after {seconds} s"}), flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impls", default=",".join(IMPLS))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--trace", action="store_true", help="also log the FSDPModule methods the schedule calls")
    parser.add_argument("--share-comm-ctx", choices=("default", "both", "none"), default="default",
                        help="share_comm_ctx on the interleaved stages: default: shardkit's (where it has one), "
                             "not FSDP2's (see FSDP2_SHARE_COMM_CTX); both; none")
    opts = parser.parse_args(argv)

    dist.init_process_group("gloo", timeout=timedelta(seconds=WORLD_TIMEOUT_S))
    rank = dist.get_rank()
    assert dist.get_world_size() == PP * DP, f"run on {PP * DP} ranks"
    failed = False
    for impl in opts.impls.split(","):
        for schedule in opts.schedules.split(","):
            started = time.perf_counter()
            result: dict = {"impl": impl, "schedule": schedule}
            with watchdog(f"{impl} {schedule}", CASE_WALL_S):
                try:
                    mesh = case_mesh()
                    result.update(run_case(impl, schedule, mesh, opts.trace, {"default": None, "both": True, "none": False}[opts.share_comm_ctx]))
                    result["error"] = None
                except Exception as e:  # noqa: BLE001 - reported, and the next case runs
                    result["error"] = describe(e)
                    result["traceback"] = traceback.format_exc()[-3000:]
                everyone: list = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, result)
            if rank == 0:
                errors = {r: o["error"] for r, o in enumerate(everyone) if o["error"]}
                ok = not errors
                mine = everyone[0]
                line = {"impl": impl, "schedule": schedule, "ok": ok,
                        "max_diff": max(o["max_diff"] for o in everyone) if ok else None}
                if "step_counts" in mine:
                    last = mine["step_counts"][-1]
                    line.update(all_gathers=last["all_gathers"], reductions=last["reductions"],
                                groups_with_params=mine["groups_with_params"],
                                step_counts=mine["step_counts"], is_torch_fsdp_module=mine["is_fsdp_module"],
                                shared_comm_ctx=mine["shared_comm_ctx"])
                    if opts.trace:
                        line["calls"] = mine["calls"]
                line["error"] = "; ".join(f"rank {r}: {e}" for r, e in errors.items()) or None
                line["seconds"] = round(time.perf_counter() - started, 2)
                print(json.dumps(line), flush=True)
                for r, o in enumerate(everyone):
                    if o.get("traceback"):
                        sys.stderr.write(f"--- {impl} {schedule} rank {r}:\n{o['traceback']}\n")
            failed = failed or any(o["error"] for o in everyone)
    sys.stdout.flush()
    if failed:  # a failed case may leave work pending on its groups: do not wait for it at teardown
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
