"""The model side of a plan: build it without memory, split it into groups, and work out
what each rank holds of every parameter.

Nothing here allocates: the model is built under a ``FakeTensorMode`` (shapes, dtypes and
devices, no data), tensor parallel is applied by replacing each split weight with a fake
tensor of its local shape, and each parameter's shard sizes and dtypes are the runtime's own
layout of it (``dtensor/layout.py``'s ``layout_of``).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from shardkit.dtensor.layout import Layout, layout_of
from shardkit.core.options import ParamOptions

GiB = 1024**3


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of one group: its name and the runtime's own layout of it
    (``dtensor/layout.py``), as rank 0 of the shard dimension holds it."""

    fqn: str
    layout: Layout
    requires_grad: bool

    shape = property(lambda self: tuple(self.layout.shape), doc="What FSDP shards: the tensor-parallel local shape.")
    dtype = property(lambda self: self.layout.dtype, doc="The parameter's own (sharded parameter, gradient, optimizer state).")
    param_dtype = property(lambda self: self.layout.param_dtype, doc="All-gather and compute.")
    reduce_dtype = property(lambda self: self.layout.reduce_dtype, doc="Reduce-scatter.")
    world = property(lambda self: self.layout.world, doc="Ranks of the shard dimension.")
    row_numel = property(lambda self: self.layout.row_numel)
    shard_numel = property(lambda self: self.layout.shard_numel, doc="Every rank's padded shard (the collectives' unit).")

    def local_numel(self, rank: int) -> int:
        """Elements this rank really holds (the optimizer state's size)."""
        return self.layout.local_numel(rank)

    def post_forward_numel(self, ranks: int) -> int:
        """Elements kept after forward with ``reshard_after_forward=ranks``."""
        return self.layout.with_post_forward(ranks, 0).post_forward_numel


@dataclass
class GroupInfo:
    """The parameters of one ``fully_shard`` call."""

    name: str  # module FQN, "" for the root
    module: nn.Module
    params: list[ParamInfo] = field(default_factory=list)
    reshard_after_forward: bool | int | None = None  # None: True for a block, False for the root

    def choose_reshard(self, value: bool | int) -> None:
        """The planner's setting for this group; the root keeps None (it is not resharded after forward)."""
        self.reshard_after_forward = value if self.name else None

    @property
    def numel(self) -> int:
        return sum(math.prod(p.shape) for p in self.params)

    def buckets(self, key: str) -> dict[torch.dtype, list[ParamInfo]]:
        """Parameters per collective, as the runtime buckets them (``param_dtype`` for
        all-gathers, ``reduce_dtype`` for reduce-scatters)."""
        out: dict[torch.dtype, list[ParamInfo]] = {}
        for p in self.params:
            out.setdefault(getattr(p, key), []).append(p)
        return out

    def unsharded_bytes(self) -> int:
        """The unsharded parameters' storage (padded: ``world * shard_numel`` each)."""
        return sum(p.world * p.shard_numel * p.param_dtype.itemsize for p in self.params)


# Building -----------------------------------------------------------------------------------
def builtin(family: str, **sizes) -> Callable[[], nn.Module]:
    """A factory for a built-in model: ``"gpt"`` (GPTConfig fields) or ``"llama"`` (LlamaConfig)."""
    from shardkit.models import GPT, GPTConfig
    from shardkit.models.llama import Llama, LlamaConfig

    families = {"gpt": (GPT, GPTConfig), "llama": (Llama, LlamaConfig)}
    if family not in families:
        raise ValueError(f"shardkit plan: unknown model family {family!r}; use one of {sorted(families)} or 'module:function'")
    cls, config = families[family]
    return lambda: cls(config(**sizes))


def load_factory(spec: str, **kwargs) -> Callable[[], nn.Module]:
    """``"package.module:function"`` as a factory (called with ``kwargs``)."""
    module_name, _, fn_name = spec.partition(":")
    if not fn_name:
        raise ValueError(f"shardkit plan: model {spec!r} is neither a built-in family nor 'module:function'")
    fn = getattr(importlib.import_module(module_name), fn_name)
    return lambda: fn(**kwargs)


def find_blocks(model: nn.Module) -> list[str]:
    """The usual FSDP recipe's groups: every child of an ``nn.ModuleList`` that holds
    parameters (the transformer blocks), outermost lists only."""
    blocks: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(b + ".") for b in blocks):
            blocks += [f"{name}.{i}" if name else str(i) for i, child in enumerate(module)
                       if any(True for _ in child.parameters())]
    return blocks


def apply_tp(model: nn.Module, blocks: list[str], tp: int, tp_plan: dict) -> None:
    """Shrink every tensor-parallel weight of every block to its local shape (column-wise:
    dim 0 of the weight and the bias split; row-wise: dim 1 of the weight)."""
    for block in blocks:
        for suffix, style in tp_plan.items():
            linear = model.get_submodule(f"{block}.{suffix}")
            kind = style if isinstance(style, str) else type(style).__name__.removesuffix("Parallel").lower()
            for name, p in list(linear.named_parameters(recurse=False)):
                dim = 0 if kind == "colwise" else 1 if name == "weight" else None
                if kind not in ("colwise", "rowwise"):
                    raise ValueError(f"shardkit plan: tp_plan[{suffix!r}] is {style!r}; only colwise/rowwise are modelled")
                if dim is None:
                    continue  # a row-wise layer's bias is replicated
                if p.shape[dim] % tp:
                    raise ValueError(f"shardkit plan: {block}.{suffix}.{name} has {p.shape[dim]} along dim {dim}, not divisible by tp={tp}")
                shape = list(p.shape)
                shape[dim] //= tp
                setattr(linear, name, nn.Parameter(torch.empty(shape, dtype=p.dtype, device=p.device), p.requires_grad))


def group_params(model: nn.Module, blocks: list[str], world: int, mp_param: torch.dtype | None,
                 mp_reduce: torch.dtype | None) -> list[GroupInfo]:
    """The groups in apply order (blocks, then the root) with their parameters. A parameter
    registered in two places belongs to the first group that holds it, as in ``fully_shard``."""
    options = ParamOptions(mp_param, mp_reduce)
    groups = [GroupInfo(name, model.get_submodule(name)) for name in blocks] + [GroupInfo("", model)]
    seen: set[int] = set()
    for group in groups:
        for fqn, p in group.module.named_parameters():
            full = f"{group.name}.{fqn}" if group.name else fqn
            if id(p) in seen:
                continue
            seen.add(id(p))
            layout = layout_of(p.shape, p.dtype, options, world=world, rank=0, param=p)
            group.params.append(ParamInfo(full, layout, p.requires_grad))
    return [g for g in groups if g.params]
