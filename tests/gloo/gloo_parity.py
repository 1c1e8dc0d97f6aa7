"""A sharded model trained side by side with its non-sharded single-process reference.

Both start from the same weights (the reference is a deepcopy taken before sharding) and
see the same global batch: the reference the whole batch, each rank its ``torch.chunk`` of
it. Losses are compared every step (the sharded one averaged over ranks), parameters by
name at the end (``full_tensor()`` of the sharded ones).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardkit

TOL = dict(atol=1e-5, rtol=1e-5)
FULLY_SHARD = {"shardkit": shardkit.fully_shard, "torch": torch_fully_shard}
Batch = tuple[torch.Tensor, ...]


class Block(nn.Module):
    def __init__(self, d_in: int, d_out: int, unused: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.unused = nn.Linear(d_in, d_out) if unused else None  # never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Stack(nn.Module):
    """Uneven shards: 13 rows split 7 + 6, and ``blocks.1.lin`` has one output row, so
    rank 1 holds none of it."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 13)
        self.blocks = nn.ModuleList([Block(13, 13, unused), Block(13, 1)])
        self.out = nn.Linear(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)  # (B, 13)
        for block in self.blocks:
            x = block(x)
        return self.out(x)  # (B, 3)


def stack_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def stack_batches(n: int, size: int = 8, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 3, generator=g)) for _ in range(n)]


def shard_blocks_then_root(impl: str, mesh: DeviceMesh, **kwargs) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            FULLY_SHARD[impl](block, mesh=mesh, **kwargs)
        FULLY_SHARD[impl](model, mesh=mesh)

    return shard


def local(batch: Batch, mesh: DeviceMesh) -> Batch:
    """This rank's share of a global batch (every rank gets an equal chunk)."""
    return tuple(t.chunk(mesh.size())[mesh.get_local_rank()] for t in batch)


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


# Collective counts --------------------------------------------------------------------------
@dataclass
class Counts:
    all_gather: int = 0
    reduce_scatter: int = 0


@contextlib.contextmanager
def count_collectives(impl: str) -> Iterator[Counts]:
    """Collectives issued inside the block: shardkit's own trace, or (for torch's FSDP2)
    the ``dist.*_single`` calls it makes."""
    counts = Counts()
    if impl == "shardkit":
        with shardkit.trace() as t:
            yield counts
        summary = t.summary()
        counts.all_gather, counts.reduce_scatter = summary["all_gather"].calls, summary["reduce_scatter"].calls
        return
    originals = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather(*args, **kwargs):
        counts.all_gather += 1
        return originals[0](*args, **kwargs)

    def reduce_scatter(*args, **kwargs):
        counts.reduce_scatter += 1
        return originals[1](*args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = all_gather, reduce_scatter
    try:
        yield counts
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = originals


# The pair -----------------------------------------------------------------------------------
@dataclass
class Pass:
    """One forward + backward: the loss (mean over ranks), the reference's, and the collectives."""

    loss: torch.Tensor
    ref_loss: torch.Tensor
    forward: Counts
    backward: Counts


@dataclass
class Parity:
    model: nn.Module
    ref: nn.Module
    mesh: DeviceMesh
    impl: str
    loss_of: Callable[[nn.Module, Batch], torch.Tensor]
    opt: torch.optim.Optimizer = field(init=False)
    ref_opt: torch.optim.Optimizer = field(init=False)
    optim_kwargs: dict = field(default_factory=lambda: dict(lr=1e-2))

    def __post_init__(self) -> None:
        self.opt = torch.optim.AdamW(self.model.parameters(), **self.optim_kwargs)
        self.ref_opt = torch.optim.AdamW(self.ref.parameters(), **self.optim_kwargs)

    @classmethod
    def build(cls, make_model: Callable[[], nn.Module], shard: Callable[[nn.Module], None], mesh: DeviceMesh, impl: str, loss_of=stack_loss, **optim_kwargs) -> "Parity":
        torch.manual_seed(0)  # the same weights on every rank
        model = make_model()
        ref = copy.deepcopy(model)
        shard(model)
        return cls(model, ref, mesh, impl, loss_of, optim_kwargs=dict(lr=1e-2) | optim_kwargs)

    def forward_backward(self, batch: Batch, scale: float = 1.0) -> Pass:
        with count_collectives(self.impl) as forward:
            loss = self.loss_of(self.model, local(batch, self.mesh)) * scale
        with count_collectives(self.impl) as backward:
            loss.backward()
        ref_loss = self.loss_of(self.ref, batch) * scale
        ref_loss.backward()
        return Pass(mean_over_ranks(loss), ref_loss.detach(), forward, backward)

    def optimizer_step(self) -> None:
        for opt in (self.opt, self.ref_opt):
            opt.step()
            opt.zero_grad()

    def step(self, batch: Batch) -> Pass:
        result = self.forward_backward(batch)
        self.optimizer_step()
        return result

    def train(self, batches: list[Batch]) -> list[Pass]:
        """A step per batch, checking the loss of each (the ranks agree on it, so they fail together)."""
        passes = []
        for i, batch in enumerate(batches):
            passes.append(self.step(batch))
            assert_close(passes[-1].loss, passes[-1].ref_loss, f"loss at step {i}")
        return passes

    def assert_params_match(self) -> None:
        ref = dict(self.ref.named_parameters())
        sharded = {name: full(p.detach()) for name, p in self.model.named_parameters()}  # collectives first
        assert list(sharded) == list(ref), f"parameter names differ: {list(sharded)} != {list(ref)}"
        for name, p in sharded.items():
            assert_close(p, ref[name].detach(), f"parameter {name}")
