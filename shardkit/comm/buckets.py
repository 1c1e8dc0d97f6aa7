"""Buckets: the parameters of a group that travel in one collective, and their layout.

A group's all-gather is always one collective (``GatherBucket``): inputs of several dtypes
travel as bytes. Its reduce-scatter is one per ``reduce_dtype`` (``Bucket``); usually one.
Both kinds know their copy-in (the parameters' data laid out as one collective's input) and
copy-out (its output handed back to each parameter); ``comm/collectives.py`` draws the
layout and runs the steps in order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from shardkit.dtensor.sharded_param import ShardedParam


@dataclass
class Bucket:
    """Parameters of one group whose gradients travel in one reduce-scatter (one
    ``reduce_dtype``). Built at lazy init."""

    params: list[ShardedParam]
    dtype: torch.dtype  # what the collective carries
    world: int  # ranks it spans
    shard_numels: list[int]  # padded shard elements per parameter

    @functools.cached_property
    def per_rank(self) -> int:
        """One rank's reduce-scatter output (without the presence column)."""
        return sum(self.shard_numels)

    @functools.cached_property
    def by_rows(self) -> bool:
        """Every parameter split along dim 0: the collectives' layout is the unsharded one."""
        return all(p.dim == 0 for p in self.params)

    @functools.cached_property
    def all_present(self) -> torch.Tensor:
        """The grad-presence columns (world, n) when every parameter has a gradient: contiguous,
        which ``torch._chunk_cat`` copies twice as fast as an expanded row. Read-only, so one
        per shape is shared by every bucket (made on the reduce-scatter's stream, the only one
        that reads it)."""
        key = (self.world, len(self.params), self.dtype, self.params[0].device)
        if key not in _ONES:
            _ONES[key] = torch.ones(key[:2], dtype=self.dtype, device=key[3])
        return _ONES[key]

    def copy_in(self, grads: list[torch.Tensor | None], missing: list[int]) -> torch.Tensor:
        """Copy-in: every gradient (zeros where missing) as ``world`` padded chunks, rank-major,
        then the grad-presence columns: ``(world, per_rank + n)``."""
        params, device, world = self.params, self.params[0].device, self.world
        present = self.all_present  # (world, n) ones, made once: no host-to-device copy per step
        if missing:
            present = present.clone()
            present[:, missing] = 0
        filled = [
            torch.zeros(p.shape, dtype=self.dtype, device=device) if g is None else g if g.dtype == self.dtype else g.to(self.dtype)
            for p, g in zip(params, grads)
        ]
        if self.by_rows:
            nonempty = [g for g in filled if g.numel()]  # a (0, 5) parameter has no rows to send
            return torch._chunk_cat([*nonempty, present], dim=0, num_chunks=world)
        send = torch.empty(world, self.per_rank + len(params), dtype=self.dtype, device=device)
        blocks = send.split([*self.shard_numels, len(params)], dim=1)
        for p, g, block in zip(params, filled, blocks):
            p.chunk_grad_into(g, block)  # split along another dim: rearranged per parameter
        blocks[-1].copy_(present)
        return send

    def copy_out(self, reduced: torch.Tensor, counts: list[float] | None, missing: list[int]) -> None:
        """Each parameter's rows of this rank's reduced ``(per_rank,)`` chunk into its ``.grad``;
        none for a parameter that no rank had a gradient for (``counts``: the summed presence
        columns, read only when this rank lacks a gradient)."""
        for i, (p, rows) in enumerate(zip(self.params, reduced.split_with_sizes(self.shard_numels))):
            if counts is None or i not in missing or counts[i] > 0:
                p.set_sharded_grad(p.local_grad(rows))

    @functools.cached_property
    def subsets(self) -> dict[tuple[int, ...], "Bucket"]:
        return {}

    def subset(self, params: list[ShardedParam]) -> "Bucket":
        """The same layout for some of the parameters (the trainable ones), made once per set."""
        key = tuple(map(id, params))
        if key not in self.subsets:
            numels = [n for p, n in zip(self.params, self.shard_numels) if p in params]
            self.subsets[key] = Bucket(params, self.dtype, self.world, numels)
        return self.subsets[key]


_ONES: dict[tuple, torch.Tensor] = {}  # Bucket.all_present, by shape, dtype and device


class GatherBucket:
    """What one all-gather carries: every parameter of a group, end to end. Each parameter
    sends one input (its padded shard in ``param_dtype``, or its post-forward shard), or the
    inputs its ``fsdp_pre_all_gather`` returns (``dtensor/extension.py``). All inputs of one
    dtype travel as that dtype; inputs of several (float8 weights next to fp32 norms, mixed
    ``param_dtype``s) travel as bytes: still one collective.

    The pieces (inputs) and their sizes are known at the first all-gather, when the hooks
    have run once; they must not change afterwards."""

    def __init__(self, params: list[ShardedParam], world: int, post_forward: bool = False) -> None:
        self.params, self.world, self.post_forward = params, world, post_forward
        self.hooked = not post_forward and any(p.extension is not None for p in params)
        self.owners: list[ShardedParam] = []  # per piece, its parameter
        self.dtypes: list[torch.dtype] = []  # per piece, the dtype it travels in (before bytes)
        self.numels: list[int] = []  # per piece, elements of that dtype
        if not self.hooked:
            numel = (lambda p: p.post_forward_numel) if post_forward else (lambda p: p.shard_numel)
            self._set_pieces(params, [numel(p) for p in params])

    def _set_pieces(self, owners: list[ShardedParam], numels: list[int], dtypes=None) -> None:
        self.owners, self.numels = owners, numels
        self.dtypes = dtypes or [p.param_dtype for p in owners]
        self.dtype = self.dtypes[0] if len(set(self.dtypes)) == 1 else torch.uint8
        self.sizes = self.numels if self.dtype is not torch.uint8 else [n * d.itemsize for n, d in zip(numels, self.dtypes)]
        self.per_rank = sum(self.sizes)  # one rank's input, in ``dtype`` elements

    def inputs(self) -> list[torch.Tensor]:
        """Every piece, flat: the padded shards (cast or moved by ``copy_in`` if need be), the
        post-forward shards, or what the parameters' ``fsdp_pre_all_gather`` returns."""
        if not self.hooked:
            return [p.post_forward_shard for p in self.params] if self.post_forward else self._padded_inputs
        inputs, owners, dtypes = [], [], []
        for p in self.params:
            mine = p.all_gather_inputs()
            inputs += mine
            owners += [p] * len(mine)
            dtypes += [p.param_dtype] if p.extension is None else [x.dtype for x in mine]
        numels = [x.numel() for x in inputs]
        if not self.owners:
            self._set_pieces(owners, numels, dtypes)
        elif (numels, dtypes) != (self.numels, self.dtypes):
            raise ValueError(f"the all-gather inputs of {[p.fqn for p in self.params]} changed between steps: {numels} {dtypes}, were {self.numels} {self.dtypes}.")
        return inputs

    def alloc_outputs(self, inputs: list[torch.Tensor]) -> None:
        """Make room for the all-gather's output where copy-out puts it: each parameter's
        unsharded buffer (``free_all_gather`` let it go), or the outputs its hooks ask for."""
        for p in self.params:
            if p.extension is None:
                p.alloc_unsharded_storage()
            else:
                p.extension.alloc_outputs([x for x, owner in zip(inputs, self.owners) if owner is p], self.world, p.device)

    def copy_in(self, inputs: list[torch.Tensor]) -> torch.Tensor:
        """The inputs end to end in the bucket's dtype on the compute device, ``(per_rank,)``: a
        view of the one input, a ``torch.cat``, or, when a cast (mixed precision, bytes) or a
        host-to-device copy (offload) is due, one ``copy_`` per input into a fresh buffer."""
        if not self.copy_in_converts:
            return inputs[0] if len(inputs) == 1 else torch.cat(inputs)
        device = self.params[0].device
        send = torch.empty(self.per_rank, dtype=self.dtype, device=device)
        for piece, x, dtype in zip(send.split(self.sizes), inputs, self.dtypes):
            if self.dtype is torch.uint8 and dtype is not torch.uint8:
                x = x.to(device, dtype, non_blocking=True).view(torch.uint8)
            piece.copy_(x, non_blocking=True)  # pinned host memory: asynchronous on the side stream
        return send

    def copy_out(self, output: torch.Tensor, custom: bool = False) -> None:
        """Each piece's column block of the ``(world, per_rank)`` output into its own buffer
        (nothing to copy when gathered in place, unless a user's all-gather made the output)."""
        if self.in_place and not custom:
            return
        rows = output.view(self.world, -1)  # (world, per_rank)
        if self.by_rows:
            torch.split_with_sizes_copy(rows, self.sizes, dim=1, out=self.columns)  # each (world, size)
            return
        for p, dtype, block, column in zip(self.owners, self.dtypes, rows.split(self.sizes, dim=1), self.columns):
            if p.dim == 0 or p.extension is not None:
                column.copy_(block)
            else:  # split along another dim: rearranged per parameter
                p.copy_out(block if block.dtype == dtype else block.contiguous().view(dtype))

    @functools.cached_property
    def _padded_inputs(self) -> list[torch.Tensor]:
        return [p.padded_shard.view(-1) for p in self.params]

    @functools.cached_property
    def by_rows(self) -> bool:
        """Every piece is laid out rank-major (a plain parameter split along dim 0, or a hooked
        one): copy-out is one split of the output."""
        return all(p.dim == 0 or p.extension is not None for p in self.params)

    @functools.cached_property
    def copy_in_converts(self) -> bool:
        """Copy-in casts (mixed precision, bytes) or moves host-to-device (offload); post-forward
        shards are already in param_dtype on the device, and hooks return what to send."""
        if len(set(self.dtypes)) > 1:  # bytes
            return True
        plain = [p for p in self.params if p.extension is None]
        return not self.post_forward and any(p.dtype != p.param_dtype or p.shard_device != p.device for p in plain)

    @functools.cached_property
    def in_place(self) -> bool:
        """One piece laid out by rows: gathered straight into its buffer, no copy-out."""
        return len(self.owners) == 1 and self.by_rows

    @functools.cached_property
    def columns(self) -> list[torch.Tensor]:
        """Copy-out targets: each piece's buffer as (world, size) in ``dtype``. Made at the
        first all-gather, while the storage is allocated; views survive its later resizes."""
        targets, seen = [], {}
        for p, n in zip(self.owners, self.numels):
            if p.extension is None:
                target = p.unsharded_flat[: self.world * n]
            else:
                seen[p] = seen.get(p, -1) + 1
                target = p.extension.targets[seen[p]]
            target = target.view(self.world, n)
            targets.append(target.view(torch.uint8) if self.dtype is torch.uint8 else target)
        return targets


def reduce_buckets(params: list[ShardedParam], world: int) -> list[Bucket]:
    """One reduce-scatter bucket per ``reduce_dtype``."""
    by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
    for p in params:
        by_dtype.setdefault(p.reduce_dtype, []).append(p)
    return [Bucket(ps, dtype, world, [p.shard_numel for p in ps]) for dtype, ps in by_dtype.items()]
