"""Grouped collectives: copy-in, ONE collective, copy-out.

A bucket is the parameters of one group with one dtype. Its all-gather input is every
parameter's padded shard laid end to end (``per_rank`` elements); the all-gather output is
``world`` such rows, rank-major, and copy-out scatters each parameter's column block into
its own unsharded buffer. The reduce-scatter is the mirror image: copy-in lays every
gradient out as ``world`` padded chunks (``torch._chunk_cat``), one reduce-scatter, and each
parameter's reduced rows are a view of the output.

The reduce-scatter carries one extra column per parameter, the **grad-presence column**: 1
where this rank produced a gradient, else 0. After the sum it tells every rank whether any
rank used the parameter, so a parameter unused on every rank keeps ``.grad = None`` (as in
a single process), while one unused on some ranks only is reduced with zeros there. (A
whole group used on some ranks only still issues its collectives in a different order on
different ranks; that needs a fixed reduction order and is not handled yet.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardkit.comm import trace
from shardkit.dtensor.sharded_param import ShardedParam, alloc_storage

# torch 2.13 renamed the single-tensor collectives; older torch (e.g. on GPU images) has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Bucket:
    """The parameters of one group sharing a dtype, laid out for the collectives."""

    params: list[ShardedParam]
    shard_numels: list[int]  # padded shard elements per parameter
    per_rank: int  # sum of shard_numels: one rank's all-gather input / reduce-scatter output
    _all_present: torch.Tensor | None = None

    @classmethod
    def of(cls, params: list[ShardedParam]) -> "Bucket":
        numels = [p.shard_numel for p in params]
        return cls(params, numels, sum(numels))

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def all_present(self, device: torch.device) -> torch.Tensor:
        """The grad-presence column when every parameter has a gradient, cached."""
        if self._all_present is None or self._all_present.device != device:
            self._all_present = torch.ones(len(self.params), dtype=self.dtype, device=device)
        return self._all_present


def buckets_by_dtype(params: list[ShardedParam]) -> list[Bucket]:
    by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    return [Bucket.of(ps) for ps in by_dtype.values()]


@dataclass
class PendingAllGather:
    bucket: Bucket
    send: torch.Tensor  # (per_rank,): kept alive until the collective is waited for
    output: torch.Tensor  # (world * per_rank,)
    work: dist.Work | None


def all_gather(bucket: Bucket, group: dist.ProcessGroup, world: int, name: str, async_op: bool) -> PendingAllGather:
    """Issue one all-gather of the bucket's padded shards; ``finish_all_gather`` copies out."""
    for p in bucket.params:
        alloc_storage(p.unsharded_flat)
    if len(bucket.params) == 1:  # one parameter: gather straight into its unsharded buffer
        p = bucket.params[0]
        send, output = p.padded_shard.view(-1), p.unsharded_flat
    else:
        send = torch.cat([p.padded_shard.view(-1) for p in bucket.params])  # (per_rank,)
        output = send.new_empty(world * bucket.per_rank)  # (world * per_rank,)
    trace.record("all_gather", name, dtype=bucket.dtype, numel=output.numel(), world=world)
    with _preserve_versions(bucket):
        work = _all_gather_single(output, send, group=group, async_op=async_op)
    return PendingAllGather(bucket, send, output, work)


def finish_all_gather(pending: PendingAllGather, world: int) -> None:
    """Wait for the all-gather and copy each parameter's rows into its unsharded buffer."""
    if pending.work is not None:
        pending.work.wait()
    params = pending.bucket.params
    if len(params) == 1:
        return
    with _preserve_versions(pending.bucket):
        torch.split_with_sizes_copy(
            pending.output.view(world, -1),  # (world, per_rank)
            pending.bucket.shard_numels,
            dim=1,
            out=[p.unsharded_flat.view(world, -1) for p in params],  # each (world, shard_numel)
        )


def reduce_scatter(
    bucket: Bucket,
    grads: list[torch.Tensor | None],
    group: dist.ProcessGroup,
    world: int,
    name: str,
    divide_factor: float | None,
) -> None:
    """Reduce the bucket's unsharded grads into each parameter's sharded ``.grad``.

    ``grads[i]`` is None where this rank has no gradient for ``bucket.params[i]``. The
    result is averaged over the ``world`` ranks (like DDP), or divided by ``divide_factor``.
    """
    params = bucket.params
    missing = [i for i, g in enumerate(grads) if g is None]
    present = bucket.all_present(params[0].device)  # (n,) ones, made once: no host-to-device copy per step
    if missing:
        present = present.clone()
        present[missing] = 0
    filled = [g if g is not None else torch.zeros(p.shape, dtype=p.dtype, device=p.device) for p, g in zip(params, grads)]
    send = torch._chunk_cat(filled + [present.expand(world, -1)], dim=0, num_chunks=world)  # (world, per_rank + n)
    output = send.new_empty(bucket.per_rank + len(params))
    trace.record("reduce_scatter", name, dtype=bucket.dtype, numel=send.numel(), world=world)
    _reduce_scatter_single(output, send.view(-1), op=dist.ReduceOp.SUM, group=group)
    reduced = output[: bucket.per_rank]
    reduced.div_(world if divide_factor is None else divide_factor)
    # Our own gradient implies a nonzero count, so we read the counts back (a device sync on
    # GPU) only when this rank lacks one. Under a fake process group they are garbage.
    counts = output[bucket.per_rank :].tolist() if missing else [1] * len(params)
    offset = 0
    for p, g, count, numel in zip(params, grads, counts, bucket.shard_numels):
        if g is not None or count > 0:
            rows = reduced[offset : offset + numel].view(p.padded_rows, *p.shape[1:])  # (padded_rows, *rest)
            p.set_sharded_grad(rows[: p.local_rows])
        offset += numel


@contextlib.contextmanager
def _preserve_versions(bucket: Bucket):
    """Writing gathered data into unsharded parameters must not look like an in-place edit to
    autograd, which saved those parameters in forward and checks their version in backward."""
    with contextlib.ExitStack() as stack:
        for p in bucket.params:
            stack.enter_context(torch.autograd._unsafe_preserve_version_counter(p.unsharded_param))
        yield
