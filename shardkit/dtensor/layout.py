"""A parameter's layout: how it is split, padded and cast. Values only, no tensors.

``layout_of`` makes one, a pure function of the parameter's shape and dtype, its place in the
mesh and the options; eager mode (``ShardedParam``), compiled mode and the planner all read
their geometry from it. It is frozen: ``.to(dtype)`` and ``reshard_after_forward=R`` make a new
one (``with_dtype``, ``with_post_forward``) instead of editing fields.

Rows are slices along ``dim`` (0 unless ``shard_placement_fn`` says otherwise), split like
``torch.chunk``: ``padded_rows = ceil(rows / world)`` per rank, the tail ranks holding fewer
or none (``local_rows``); every rank's shard is padded to ``padded_rows`` so that collectives
have equal sizes everywhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from shardkit import versions
from shardkit.dtensor.placements import local_rows, padded_rows, with_size
from shardkit.core.options import ParamOptions


@dataclass(frozen=True)
class Layout:
    shape: torch.Size  # what FSDP shards: the parameter's shape (its TP-local shape under tensor parallel)
    dtype: torch.dtype  # its own dtype: the shards', the sharded gradient's, the optimizer state's
    param_dtype: torch.dtype  # the all-gather's and the compute's
    reduce_dtype: torch.dtype  # the gradient reduction's
    world: int  # ranks of the shard mesh dim
    rank: int  # this rank's place in it
    dim: int = 0  # the dim rows are taken along
    spec: DTensorSpec | None = None  # the sharded parameter's DTensor spec (None in the planner: no mesh)
    post_forward_world: int = 0  # reshard_after_forward=int: ranks of the backward all-gather (0: none)
    post_forward_index: int = 0  # this rank's chunk among them
    # derived in __post_init__
    padded_rows: int = field(init=False)
    local_rows: int = field(init=False)
    padded_shape: torch.Size = field(init=False)
    unsharded_padded_shape: torch.Size = field(init=False)  # the all-gather's output as a tensor: ``world`` padded shards along ``dim``
    shard_numel: int = field(init=False)  # every rank's padded shard: the collectives' unit
    post_forward_rows: int = field(init=False)
    post_forward_numel: int = field(init=False)

    def __post_init__(self) -> None:
        rows = self.shape[self.dim]
        derived = dict(padded_rows=padded_rows(rows, self.world), local_rows=local_rows(rows, self.world, self.rank))
        derived["padded_shape"] = with_size(self.shape, self.dim, derived["padded_rows"])
        derived["shard_numel"] = derived["padded_shape"].numel()
        derived["unsharded_padded_shape"] = with_size(self.shape, self.dim, self.world * derived["padded_rows"])
        derived["post_forward_rows"] = padded_rows(self.shape[0], self.post_forward_world) if self.post_forward_world else 0
        derived["post_forward_numel"] = derived["post_forward_rows"] * self.row_numel
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    @property
    def row_numel(self) -> int:
        """Elements in one dim-0 row."""
        return math.prod(self.shape[1:])

    def local_numel(self, rank: int) -> int:
        """Elements ``rank`` really holds (the optimizer state's size there)."""
        rows = self.shape[self.dim]
        return local_rows(rows, self.world, rank) * (self.shape.numel() // rows) if rows else 0

    def with_dtype(self, dtype: torch.dtype, options: ParamOptions, param: nn.Parameter | None = None) -> "Layout":
        """After ``.to(dtype)``: the dtypes derived from the policy again, as at ``fully_shard``."""
        param_dtype, reduce_dtype = dtypes(dtype, options, param)
        return dataclasses.replace(self, dtype=dtype, param_dtype=param_dtype, reduce_dtype=reduce_dtype)

    def with_spec(self, spec: DTensorSpec) -> "Layout":
        return dataclasses.replace(self, spec=spec)

    def with_post_forward(self, world: int, index: int) -> "Layout":
        """``reshard_after_forward=world``: this rank keeps chunk ``index`` of ``world`` after forward."""
        return dataclasses.replace(self, post_forward_world=world, post_forward_index=index)


def dtypes(dtype: torch.dtype, options: ParamOptions, param: nn.Parameter | None = None) -> tuple[torch.dtype, torch.dtype]:
    """The all-gather/compute dtype and the reduction dtype of a parameter of ``dtype``. Mixed
    precision applies to floating-point parameters only (as in FSDP2). Without a
    ``reduce_dtype``: ``param_dtype`` before torch 2.15, the accumulation dtype from 2.15 (the
    parameter's own, or its explicit ``grad_dtype``), as that release's FSDP2."""
    if not dtype.is_floating_point:
        return dtype, dtype
    param_dtype = options.param_dtype or dtype
    if options.reduce_dtype is not None:
        return param_dtype, options.reduce_dtype
    if versions.REDUCE_DTYPE_FOLLOWS_GRAD_DTYPE:
        override = param is not None and getattr(param, "_has_grad_dtype_override", False)
        return param_dtype, (param.grad_dtype or param_dtype) if override else dtype
    return param_dtype, param_dtype


def layout_of(shape: torch.Size, dtype: torch.dtype, options: ParamOptions, *, world: int, rank: int, dim: int = 0,
              spec: DTensorSpec | None = None, param: nn.Parameter | None = None) -> Layout:
    """The layout of a parameter of ``shape`` and ``dtype`` (TP-local under tensor parallel) on
    ``world`` ranks of its shard dim, as ``rank`` holds it."""
    param_dtype, reduce_dtype = dtypes(dtype, options, param)
    return Layout(torch.Size(shape), dtype, param_dtype, reduce_dtype, world, rank, dim, spec)
