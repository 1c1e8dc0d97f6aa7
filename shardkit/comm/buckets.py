"""Buckets: the parameters of a group that travel in one collective (one dtype, one layout).

A group with parameters of several dtypes (under a ``MixedPrecisionPolicy``, or mixed
already) issues one all-gather per ``param_dtype`` and one reduce-scatter per
``reduce_dtype``; usually a group is one bucket each way. ``comm/collectives.py`` draws the
layout.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from shardkit.dtensor.sharded_param import ShardedParam


@dataclass
class Bucket:
    """Parameters of one group that travel in one collective: one dtype, one layout. Built at
    lazy init, when the padded shards and unsharded buffers exist; what a collective needs
    from it each step (views, flags) is worked out once."""

    params: list[ShardedParam]
    dtype: torch.dtype  # what the collective carries
    world: int  # ranks it spans
    shard_numels: list[int]  # padded shard elements per parameter
    post_forward: bool = False  # all-gather the post-forward shards instead of the padded shards

    @functools.cached_property
    def per_rank(self) -> int:
        """One rank's all-gather input / reduce-scatter output (without the presence column)."""
        return sum(self.shard_numels)

    @functools.cached_property
    def by_rows(self) -> bool:
        """Every parameter split along dim 0: the collectives' layout is the unsharded one."""
        return all(p.dim == 0 for p in self.params)

    @functools.cached_property
    def copy_in_converts(self) -> bool:
        """Copy-in casts (mixed precision) or moves host-to-device (offload); post-forward
        shards are already in param_dtype on the device."""
        return not self.post_forward and any(p.dtype != self.dtype or p.shard_device != p.device for p in self.params)

    @functools.cached_property
    def in_place(self) -> bool:
        """One parameter split by rows: gathered straight into its unsharded buffer, no copy-out."""
        return len(self.params) == 1 and self.by_rows

    @functools.cached_property
    def padded_inputs(self) -> list[torch.Tensor]:
        return [p.padded_shard.view(-1) for p in self.params]

    @functools.cached_property
    def columns(self) -> list[torch.Tensor]:
        """Copy-out targets: each unsharded buffer as (world, shard_numel). Made at the first
        all-gather, while the storage is allocated; views survive its later resizes."""
        return [p.unsharded_flat[: self.world * n].view(self.world, n) for p, n in zip(self.params, self.shard_numels)]

    @functools.cached_property
    def all_present(self) -> torch.Tensor:
        """The grad-presence column when every parameter has a gradient, made once (on the
        reduce-scatter's stream, the only one that reads it)."""
        return torch.ones(len(self.params), dtype=self.dtype, device=self.params[0].device)

    @functools.cached_property
    def subsets(self) -> dict[tuple[int, ...], "Bucket"]:
        return {}

    def inputs(self) -> list[torch.Tensor]:
        """Each parameter's all-gather input, flat (cast or moved on copy-in if need be)."""
        if self.post_forward:
            return [p.post_forward_shard for p in self.params]
        return self.padded_inputs

    def subset(self, params: list[ShardedParam]) -> "Bucket":
        """The same layout for some of the parameters (the trainable ones), made once per set."""
        key = tuple(map(id, params))
        if key not in self.subsets:
            numels = [n for p, n in zip(self.params, self.shard_numels) if p in params]
            self.subsets[key] = Bucket(params, self.dtype, self.world, numels, self.post_forward)
        return self.subsets[key]


def buckets(params: list[ShardedParam], key: str, world: int, post_forward: bool = False) -> list[Bucket]:
    """One bucket per value of ``p.<key>`` (``param_dtype`` for all-gathers, ``reduce_dtype``
    for reduce-scatters)."""
    by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
    for p in params:
        by_dtype.setdefault(getattr(p, key), []).append(p)
    numel = (lambda p: p.post_forward_numel) if post_forward else (lambda p: p.shard_numel)
    return [Bucket(ps, dtype, world, [numel(p) for p in ps], post_forward) for dtype, ps in by_dtype.items()]
