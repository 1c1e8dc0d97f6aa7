"""Under torch's threaded process group (one rank per thread, every rank in this process: what
torch's own FSDP tests use), shardkit trains like FSDP2 (``impl="torch"``), checked against an
unsharded reference. The two cases of torch's test_fully_shard_extensions.py that failed:

- all-gather extensions end to end (``reshard_after_forward=False``): one rank's optimizer step
  made every rank's gathered parameters stale (``optim.groups`` is process-wide), so another
  rank all-gathered again in backward while the others reduce-scattered;
- HSDP with the hooks monkey-patched onto the local shards after ``fully_shard``: shardkit
  looked for the hooks only at ``fully_shard``, so ``fsdp_pre_all_gather`` never ran and the
  thread-local state it sets was never there.

Every rank runs in a thread, with a deadline: a hang fails with each hung rank's stack.
"""

from __future__ import annotations

import copy
import sys
import threading
import time
import traceback
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup, _install_threaded_pg, _uninstall_threaded_pg
from torch.testing._internal.two_tensor import TwoTensor

import shardkit

FULLY_SHARD = {"shardkit": shardkit.fully_shard, "torch": torch_fully_shard}
STEPS = 3
TIMEOUT_S = 60.0  # a few seconds when it works
# Ranks are never in lockstep: one reaches its optimizer step while another is already in the
# next forward. The test makes that order certain by delaying one rank's step this long.
LAG_S = 0.2


def run_ranks(world: int, fn: Callable[[int], Any], timeout: float = TIMEOUT_S) -> list[Any]:
    """``fn(rank)`` on ``world`` threads, each a rank of torch's threaded process group (as
    ``MultiThreadedTestCase`` runs them); raises the first rank's error, or a TimeoutError with
    the stacks of the ranks still running after ``timeout`` seconds."""
    multithreading = torch._C._is_multithreading_enabled()  # the threaded PG turns it off
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world_data = _install_threaded_pg()
    store = dist.HashStore()
    results: list[Any] = [None] * world
    errors: dict[int, str] = {}  # each failed rank's traceback
    stopped: dict[int, str] = {}  # where the others were when a failure woke them

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # SystemExit: woken by another rank's failure
            (stopped if isinstance(exc, SystemExit) else errors)[rank] = traceback.format_exc()
            ProcessLocalGroup.exception_handle(exc)  # wake the ranks waiting in a collective
        finally:
            if dist.distributed_c10d._world is world_data:
                dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            frames = sys._current_frames()
            stacks = "".join(f"\n--- rank {r} ---\n" + "".join(traceback.format_stack(frames[threads[r].ident])) for r in hung if threads[r].ident in frames)
            ProcessLocalGroup.exception_handle(TimeoutError())
            for t in threads:
                t.join(5.0)
            raise TimeoutError(f"ranks {hung} still running after {timeout:.0f} s (a hang: ranks issuing different collectives?):{stacks}")
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        torch._C._set_multithreading_enabled(multithreading)
    if errors:
        rank = min(errors)
        others = "".join(f"\n--- rank {r}, stopped by it, was in ---\n{tb}" for r, tb in sorted(stopped.items()))
        raise AssertionError(f"rank {rank} of {world} failed:\n{errors[rank]}{others}")
    return results


def reference_step(ref: nn.Module, optim: torch.optim.Optimizer, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One data-parallel step on the unsharded model, in this thread: each rank's loss, and
    the gradient of their mean (what FSDP's reduce-scatter averages)."""
    losses = [ref(x).sum() for x in inputs]
    (sum(losses) / len(inputs)).backward()
    optim.step()
    optim.zero_grad()
    return [loss.detach() for loss in losses]


def parts(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A TwoTensor's two tensors (compared one by one), or the tensor."""
    t = t.detach()
    return (t.a, t.b) if isinstance(t, TwoTensor) else (t,)


def assert_matches(model: nn.Module, ref: nn.Module, loss: torch.Tensor, ref_loss: torch.Tensor, rank: int, world: int, what: str) -> None:
    for got, want in zip(parts(loss), parts(ref_loss)):
        torch.testing.assert_close(got, want, msg=lambda m: f"{what}, rank {rank}, loss: {m}")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        shards = p.device_mesh.size(p.device_mesh.ndim - 1)
        mine = q.detach().chunk(shards)[p.device_mesh.get_local_rank(p.device_mesh.ndim - 1)]
        for got, want in zip(parts(p.to_local()), parts(mine)):
            torch.testing.assert_close(got, want, msg=lambda m: f"{what}, rank {rank}, {name}: {m}")


def rank_inputs(world: int) -> list[torch.Tensor]:
    """Every rank's batch (each rank's differs), the same in every thread. (Random values are
    drawn in the main thread: the ranks' threads share torch's one CPU generator, so a seed
    set in one of them does not make its draws the same as another's.)"""
    g = torch.Generator().manual_seed(42)
    return [torch.randn(2, 8, generator=g) for _ in range(world)]


# All-gather extensions end to end: TwoTensor with the hooks on its class ---------------------
def two_tensor_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.a, self.b), None


def two_tensor_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
    a, b = outputs
    if out is not None:  # the outputs were refilled in place; ``out`` views them
        assert out.a.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
        return None
    return TwoTensor(a, b), (a, b)


@pytest.fixture
def two_tensor_hooks():
    TwoTensor.fsdp_pre_all_gather = two_tensor_pre_all_gather
    TwoTensor.fsdp_post_all_gather = two_tensor_post_all_gather
    try:
        yield
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


def two_tensor_mlps() -> nn.Sequential:
    """torch's test model: three MLPs whose weights are TwoTensors (no biases: a reference
    bias would get a TwoTensor gradient)."""
    model = nn.Sequential(*[MLP(8, bias=False) for _ in range(3)])
    for mlp in model:
        for lin in (mlp.in_proj, mlp.out_proj):
            lin.weight = nn.Parameter(TwoTensor(lin.weight.detach(), lin.weight.detach().clone()))
    return model


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_all_gather_extensions_train_under_the_threaded_process_group(impl, reshard_after_forward, two_tensor_hooks):
    world = 2
    inputs = rank_inputs(world)
    torch.manual_seed(0)
    initial = two_tensor_mlps()

    def rank_main(rank: int) -> None:
        ref = copy.deepcopy(initial)
        ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
        with torch.device("meta"):  # torch's test: meta-device init, then to_empty
            model = two_tensor_mlps()
        mesh = init_device_mesh("cpu", (world,))
        for mlp in model:
            FULLY_SHARD[impl](mlp, mesh=mesh, reshard_after_forward=reshard_after_forward)
        FULLY_SHARD[impl](model, mesh=mesh, reshard_after_forward=reshard_after_forward)
        model.to_empty(device="cpu")
        with torch.no_grad():  # the reference's values: this rank's rows
            for p, q in zip(model.parameters(), ref.parameters()):
                p._local_tensor.copy_(q.detach().chunk(world)[rank])
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        for step in range(STEPS):
            loss = model(inputs[rank]).sum()
            loss.backward()
            ref_loss = reference_step(ref, ref_optim, inputs)[rank]
            if rank == 1 and step < STEPS - 1:
                time.sleep(LAG_S)  # rank 1 steps late: rank 0 has issued its next forward's all-gather
            optim.step()
            optim.zero_grad()
            assert_matches(model, ref, loss, ref_loss, rank, world, f"step {step}")

    run_ranks(world, rank_main)


# HSDP, the hooks monkey-patched onto the local shards after fully_shard --------------------
@pytest.mark.parametrize("impl", ["shardkit", "torch"])
def test_hsdp_extension_post_all_gather_sees_what_pre_all_gather_set(impl):
    replicas, shards = 2, 2
    world = replicas * shards
    inputs = rank_inputs(world)
    torch.manual_seed(0)
    initial = MLP(8)

    def rank_main(rank: int) -> None:
        tls = threading.local()  # this rank's thread only, as in torch's test
        tls.pre_calls = tls.post_calls = 0

        def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
            tls.mesh, tls.pre_thread = mesh, threading.get_ident()
            tls.pre_calls += 1
            return (self,), ("from pre", rank)

        @torch.no_grad()
        def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
            assert metadata == ("from pre", rank), metadata
            assert tls.pre_calls > 0 and tls.pre_thread == threading.get_ident(), "post-all-gather without this thread's pre-all-gather"
            tls.post_calls += 1
            (tensor,) = outputs
            if out is not None:  # refilled in place: ``out`` views the output
                return None
            return tensor, (tensor,)

        ref = copy.deepcopy(initial)
        ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=True)
        model = copy.deepcopy(ref)
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("dp_replicate", "dp_shard"))
        FULLY_SHARD[impl](model.in_proj, mesh=mesh)
        FULLY_SHARD[impl](model.out_proj, mesh=mesh)
        FULLY_SHARD[impl](model, mesh=mesh)
        for name, p in model.named_parameters():
            if "weight" in name:  # on the local tensor object: no subclass (FSDP2 allows it)
                local = p._local_tensor
                local.fsdp_pre_all_gather = fsdp_pre_all_gather.__get__(local)
                local.fsdp_post_all_gather = fsdp_post_all_gather.__get__(local)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
        for step in range(STEPS):
            loss = model(inputs[rank]).sum()
            if step == 0:  # torch's check: the pre-all-gather gets the 1-D shard mesh only
                assert tls.pre_calls > 0, "fsdp_pre_all_gather never ran"
                assert (tls.mesh.ndim, tls.mesh.size()) == (1, shards)
            loss.backward()
            optim.step()
            optim.zero_grad()
            ref_loss = reference_step(ref, ref_optim, inputs)[rank]
            assert_matches(model, ref, loss, ref_loss, rank, world, f"step {step}")
        assert tls.post_calls > 0

    run_ranks(world, rank_main)
