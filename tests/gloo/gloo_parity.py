"""A sharded model trained side by side with its non-sharded single-process reference.

Both start from the same weights (the reference is a deepcopy taken before sharding) and
see the same global batch: the reference the whole batch, each rank its ``torch.chunk`` of
it. Losses and gradients are compared every step (the sharded loss averaged over ranks),
parameters by name at the end (``full_tensor()`` of the sharded ones).
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
from shardkit.models.gpt import GPT, GPTConfig

TOL = dict(atol=1e-5, rtol=1e-5)
# Adam moves a parameter by about lr * sign(grad) even where the gradient is only rounding
# noise (a key bias, whose exact gradient is 0), so the sharded and reference runs would part
# by lr wherever their summation orders differ. eps=1e-5 damps those updates; gradients are
# compared directly every step, since Adam would also hide a wrongly scaled gradient.
OPTIM = dict(lr=1e-2, eps=1e-5)
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


class Chain(Stack):
    """Stack's input and output layers around ``blocks`` of 13 features in and out."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.out = nn.Linear(13, 3)


def stack_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def stack_batches(n: int, size: int = 8, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 3, generator=g)) for _ in range(n)]


def small_gpt(n_layer: int = 2) -> GPT:
    return GPT(GPTConfig(vocab_size=65, block_size=16, n_layer=n_layer, n_head=2, n_embd=32, dropout=0.0, tie_weights=True))


def mixed_gpt() -> GPT:
    """``small_gpt`` with three blocks, the first with 4 heads instead of 2 (a plain attribute:
    the same parameters, other code): under ``compiled_parity.regions(2)`` blocks 1 and 2 share
    one nested compile region while block 0, alone of its structure, and the root are traced
    inline, so that one compile runs both of compiled mode's ways of gathering a block."""
    model = small_gpt(n_layer=3)
    model.blocks[0].attn.n_head = 4
    return model


def one_block_gpt() -> GPT:
    """``small_gpt`` with one block (a root and one group): for checks of a per-group setting
    that compile on 4 ranks, where each block costs every rank its trace."""
    return small_gpt(n_layer=1)


def gpt_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    idx, targets = batch
    return model(idx, targets)[1]


def gpt_batches(n: int, size: int = 4, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, 65, (size, 16), generator=g) for _ in range(2)) for _ in range(n)]


def shard_blocks_then_root(impl: str, mesh: DeviceMesh, **kwargs) -> Callable[[nn.Module], None]:
    def shard(model: nn.Module) -> None:
        for block in model.blocks:
            FULLY_SHARD[impl](block, mesh=mesh, **kwargs)
        FULLY_SHARD[impl](model, mesh=mesh)

    return shard


def local(batch: Batch, mesh: DeviceMesh) -> Batch:
    """This rank's share of a global batch (every rank gets an equal chunk)."""
    return tuple(t.chunk(mesh.size())[mesh.get_local_rank()] for t in batch)


def mean_over_ranks(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    t = t.detach().clone()
    dist.all_reduce(t, group=mesh.get_group())
    return t / mesh.size()


def gather_rows(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Every rank's ``t`` stacked along dim 0, rank order: the global batch's rows."""
    out = t.new_empty(mesh.size() * t.shape[0], *t.shape[1:])
    dist.all_gather_single(out, t.contiguous(), group=mesh.get_group())
    return out


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
    optim_kwargs: dict = field(default_factory=lambda: dict(OPTIM))
    optimizer: type = torch.optim.AdamW

    def __post_init__(self) -> None:
        self.opt = self.optimizer(self.model.parameters(), **self.optim_kwargs)
        self.ref_opt = self.optimizer(self.ref.parameters(), **self.optim_kwargs)

    @classmethod
    def build(cls, make_model: Callable[[], nn.Module], shard: Callable[[nn.Module], None], mesh: DeviceMesh, impl: str, loss_of=stack_loss, optimizer: type = torch.optim.AdamW, **optim_kwargs) -> "Parity":
        """``optim_kwargs`` add to OPTIM for AdamW, and are the whole settings for another optimizer."""
        torch.manual_seed(0)  # the same weights on every rank
        model = make_model()
        ref = copy.deepcopy(model)
        shard(model)
        kwargs = OPTIM | optim_kwargs if optimizer is torch.optim.AdamW else optim_kwargs
        return cls(model, ref, mesh, impl, loss_of, optim_kwargs=kwargs, optimizer=optimizer)

    def forward_backward(self, batch: Batch, scale: float = 1.0) -> Pass:
        with count_collectives(self.impl) as forward:
            loss = self.loss_of(self.model, local(batch, self.mesh)) * scale
        with count_collectives(self.impl) as backward:
            loss.backward()
        ref_loss = self.loss_of(self.ref, batch) * scale
        ref_loss.backward()
        return Pass(mean_over_ranks(loss, self.mesh), ref_loss.detach(), forward, backward)

    def optimizer_step(self) -> None:
        for opt in (self.opt, self.ref_opt):
            opt.step()
            opt.zero_grad()

    def step(self, batch: Batch) -> Pass:
        result = self.forward_backward(batch)
        self.assert_grads_match()
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
        _assert_match(self.model, self.ref, "parameter", lambda p: p.detach())

    def assert_grads_match(self, scale: float = 1.0) -> None:
        """The sharded gradients equal ``scale`` times the reference's (None where it has None)."""
        _assert_match(self.model, self.ref, "gradient", lambda p: p.grad, scale)


def _assert_match(model: nn.Module, ref: nn.Module, what: str, get: Callable, scale: float = 1.0) -> None:
    expected = {name: get(p) for name, p in ref.named_parameters()}
    # checkpoint_wrapper and torch.compile add a module level; compare by the model's own names
    strip = lambda name: name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")  # noqa: E731
    actual = {strip(name): get(p) for name, p in model.named_parameters()}
    assert list(actual) == list(expected), f"parameter names differ: {list(actual)} != {list(expected)}"
    actual = {name: None if t is None else full(t) for name, t in actual.items()}  # collectives first
    for name, t in actual.items():
        if t is None or expected[name] is None:
            assert t is None and expected[name] is None, f"{what} {name}: {t} but the reference has {expected[name]}"
        else:
            assert_close(t, expected[name] * scale, f"{what} {name}")
