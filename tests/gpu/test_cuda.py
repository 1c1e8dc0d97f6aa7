"""CUDA paths (device placement, NCCL, storage freeing on the caching allocator), world 1.

Skipped without CUDA; run on a GPU machine with ``pytest tests/gpu``.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from shardkit import fully_shard

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def cuda_mesh():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield init_device_mesh("cuda", (1,))
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def collectives_at_world_1(monkeypatch):
    """The checks here are of NCCL's collectives on their side streams, at world 1 (one GPU):
    issue them though a one-rank dim needs none (``collectives.ONE_RANK_SKIPS``)."""
    from shardkit.comm import collectives

    monkeypatch.setattr(collectives, "ONE_RANK_SKIPS", False)


def test_one_rank_runs_no_collective_and_trains_as_the_unsharded_model(cuda_mesh, monkeypatch):
    import shardkit
    from shardkit.comm import collectives

    monkeypatch.setattr(collectives, "ONE_RANK_SKIPS", True)  # as users run it
    ref = mlp("cuda")
    model = shard(copy.deepcopy(ref), cuda_mesh)
    x = torch.randn(8, 64, device="cuda")
    with shardkit.trace() as t:
        model(x).sum().backward()
    ref(x).sum().backward()
    assert not t.collectives(), t.format()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=lambda s: f"{name}: {s}")


def mlp(device="cpu") -> nn.Sequential:
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)], nn.Linear(64, 3))


def shard(model, mesh):
    for block in model[:4]:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_cuda_training_matches_reference_and_moves_inputs(cuda_mesh):
    cpu_model = mlp("cpu")
    ref = copy.deepcopy(cpu_model).cuda()
    model = shard(cpu_model, cuda_mesh)  # fully_shard moves the shards to the GPU
    assert all(isinstance(p, DTensor) and p.device.type == "cuda" for p in model.parameters())
    train_against(model, ref, steps=3, input_device="cpu")  # CPU input: the root moves it to the GPU


def train_against(model, ref, steps: int, input_device: str) -> None:
    """AdamW steps on both; losses and final parameters match at 1e-5."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.randn(8, 64, device=input_device)
        loss = model(x).square().mean()
        loss.backward()
        ref_loss = ref(x.cuda()).square().mean()
        ref_loss.backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-5, rtol=1e-5, msg=name)


def test_cuda_reshard_frees_unsharded_memory(cuda_mesh):
    model = shard(mlp("cpu"), cuda_mesh)
    model(torch.randn(2, 64)).sum().backward()
    torch.cuda.synchronize()
    block = model[0]
    block.unshard()
    before = torch.cuda.memory_allocated()
    block.reshard()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= 64 * 64 * 4  # the block's weight at least


def test_cuda_meta_init_then_to_empty(cuda_mesh):
    with torch.device("meta"):
        model = mlp("meta")
    shard(model, cuda_mesh)
    model.to_empty(device="cuda")
    for p in model.parameters():
        nn.init.normal_(p.to_local())
    out = model(torch.randn(2, 64, device="cuda"))
    out.sum().backward()
    assert all(p.grad is not None and p.grad.device.type == "cuda" for p in model.parameters())


def test_cuda_collectives_run_on_side_streams_and_compute_waits_for_them(cuda_mesh, monkeypatch):
    """Each collective is delayed ~5 ms on its side stream (``torch.cuda._sleep`` before it):
    if the compute stream did not wait for the all-gather's event, forward would read
    unfilled parameters; if the optimizer did not wait for the reduce-scatter's, it would
    step on unreduced gradients. Either way the numerics would differ from the reference."""
    from shardkit.comm import collectives

    streams = {"all_gather": [], "reduce_scatter": []}

    def delayed(kind, fn):
        def run(*args, **kwargs):
            streams[kind].append(torch.cuda.current_stream())
            torch.cuda._sleep(5_000_000)  # cycles on the current (side) stream
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(collectives, "_all_gather_single", delayed("all_gather", collectives._all_gather_single))
    monkeypatch.setattr(collectives, "_reduce_scatter_single", delayed("reduce_scatter", collectives._reduce_scatter_single))
    cpu_model = mlp("cpu")
    ref = copy.deepcopy(cpu_model).cuda()
    model = shard(cpu_model, cuda_mesh)
    train_against(model, ref, steps=4, input_device="cuda")
    default = torch.cuda.default_stream()
    for kind, seen in streams.items():
        assert seen and all(s != default for s in seen), f"{kind} ran on the compute stream"
    assert streams["all_gather"][0] != streams["reduce_scatter"][0]
