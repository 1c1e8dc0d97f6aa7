"""Grouped collectives: copy-in, ONE collective, copy-out, issued now and finished later.

A bucket is the parameters of one group with one dtype. Its all-gather input is every
parameter's padded shard laid end to end (``per_rank`` elements); the all-gather output is
``world`` such rows, rank-major, and copy-out scatters each parameter's column block into
its own unsharded buffer. The reduce-scatter is the mirror image: copy-in lays every
gradient out as ``world`` padded chunks (``torch._chunk_cat``), one reduction, and each
parameter's reduced rows are a view of this rank's chunk.

Every collective is split in two: ``all_gather`` / ``reduce_scatter`` issue it and return a
pending object, ``finish_all_gather`` / ``finish_reduce_scatter`` wait for it and hand the
result over. In between the caller computes (``comm/streams.py`` says where the work runs
and how buffers stay alive).

The reduce-scatter carries one extra column per parameter, the **grad-presence column**: 1
where this rank produced a gradient, else 0. After the sum it tells every rank whether any
rank used the parameter, so a parameter unused on every rank keeps ``.grad = None`` (as in
a single process), while one unused on some ranks only is reduced with zeros there. (A
whole group used on some ranks only still issues its collectives in a different order on
different ranks; that needs a fixed reduction order and is not handled yet.)

On gloo the reduce-scatter is an all-reduce of the same buffer, of which each rank keeps its
chunk: gloo's all-reduce is about twice as fast as its reduce-scatter for 1-12 MiB on 2
ranks (measured; see docs/design.md), although it moves twice the bytes. The trace says so.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardkit.comm import check, trace
from shardkit.comm.streams import Streams
from shardkit.dtensor.sharded_param import ShardedParam, alloc_storage

# torch 2.13 renamed the single-tensor collectives; older torch (e.g. on GPU images) has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Bucket:
    """Parameters of one group that travel in one collective: one dtype, one layout. Built at
    lazy init, when the padded shards and unsharded buffers exist; everything a collective
    needs from it each step (views, flags) is worked out here, once."""

    params: list[ShardedParam]
    dtype: torch.dtype  # what the collective carries
    world: int  # ranks it spans
    shard_numels: list[int]  # padded shard elements per parameter
    per_rank: int  # sum of shard_numels: one rank's all-gather input / reduce-scatter output
    post_forward: bool = False  # all-gather the post-forward shards instead of the padded shards

    def __post_init__(self) -> None:
        # Every parameter split along dim 0: the collectives' layout is the unsharded one.
        self.by_rows = all(p.dim == 0 for p in self.params)
        # Copy-in casts (mixed precision) or moves host-to-device (offload); post-forward
        # shards are already in param_dtype on the device.
        self.copy_in_converts = not self.post_forward and any(
            p.dtype != self.dtype or p.shard_device != p.device for p in self.params
        )
        self._padded_inputs = [p.padded_shard.view(-1) for p in self.params]
        self._all_present: torch.Tensor | None = None
        self._subsets: dict[tuple[int, ...], Bucket] = {}

    @functools.cached_property
    def columns(self) -> list[torch.Tensor]:
        """Copy-out targets: each unsharded buffer as (world, shard_numel). Made at the first
        all-gather, while the storage is allocated; views survive its later resizes."""
        return [p.unsharded_flat[: self.world * n].view(self.world, n) for p, n in zip(self.params, self.shard_numels)]

    def all_present(self, device: torch.device) -> torch.Tensor:
        """The grad-presence column when every parameter has a gradient, made once."""
        if self._all_present is None:
            self._all_present = torch.ones(len(self.params), dtype=self.dtype, device=device)
        return self._all_present

    def inputs(self) -> list[torch.Tensor]:
        """Each parameter's all-gather input, flat (cast or moved on copy-in if need be)."""
        if self.post_forward:
            return [p.post_forward_shard for p in self.params]
        return self._padded_inputs

    def subset(self, params: list[ShardedParam]) -> "Bucket":
        """The same layout for some of the parameters (the trainable ones), made once per set."""
        key = tuple(map(id, params))
        if key not in self._subsets:
            numels = [n for p, n in zip(self.params, self.shard_numels) if p in params]
            self._subsets[key] = Bucket(params, self.dtype, self.world, numels, sum(numels), self.post_forward)
        return self._subsets[key]


def buckets(params: list[ShardedParam], key: str, world: int, post_forward: bool = False) -> list[Bucket]:
    """One bucket per value of ``p.<key>`` (``param_dtype`` for all-gathers, ``reduce_dtype``
    for reduce-scatters): a group with mixed dtypes issues one collective per dtype."""
    by_dtype: dict[torch.dtype, list[ShardedParam]] = {}
    for p in params:
        by_dtype.setdefault(getattr(p, key), []).append(p)
    result = []
    for dtype, ps in by_dtype.items():
        numels = [p.post_forward_numel if post_forward else p.shard_numel for p in ps]
        result.append(Bucket(ps, dtype, world, numels, sum(numels), post_forward))
    return result


@dataclass
class Comm:
    """Where a group's collectives go: fixed at lazy init, so no per-step lookups."""

    group: dist.ProcessGroup
    world: int
    rank: int  # this rank's index in ``group``
    streams: Streams
    reduce_by_all_reduce: bool  # gloo: all-reduce and keep our chunk (faster there)
    mesh_dim: str  # the mesh dimension's name, for the trace

    @classmethod
    def of(cls, mesh: DeviceMesh, dim: int, streams: Streams, name: str | None = None) -> "Comm":
        group = mesh.get_group(dim)
        backend = str(dist.get_backend(group))
        if name is None:
            name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else f"dim{dim}"
        return cls(group, dist.get_world_size(group), dist.get_rank(group), streams, backend == "gloo", name)


# All-gather --------------------------------------------------------------------------------
@dataclass
class PendingAllGather:
    bucket: Bucket
    name: str  # the group's FQN
    send: torch.Tensor | None  # (per_rank,) on CPU: alive until the work completes
    output: torch.Tensor | None  # (world * per_rank,) on CPU: copied out at finish
    work: dist.Work | None  # CPU: the process group's work handle
    event: torch.cuda.Event | None  # CUDA: the copy-out is done
    traced: trace.Event | None = None  # while a trace records


def all_gather(bucket: Bucket, comm: Comm, name: str) -> PendingAllGather:
    """Issue one all-gather of the bucket's shards into the unsharded buffers."""
    device = bucket.params[0].device
    for p in bucket.params:
        alloc_storage(p.unsharded_flat)  # on the compute stream (see the Note in streams.py)
    world, cuda = comm.world, comm.streams.is_cuda
    traced = trace.record("all_gather", name, dtype=bucket.dtype, numel=world * bucket.per_rank, world=world, mesh_dim=comm.mesh_dim)
    check.before(comm.group, "all_gather", name, bucket.dtype, world * bucket.per_rank, world)
    with comm.streams.side("all_gather"), trace.label("all_gather", name):
        timing = comm.streams.start_timing(traced)
        send = _copy_in(bucket, bucket.inputs(), device)  # (per_rank,)
        if len(bucket.params) == 1 and bucket.by_rows:  # gather straight into the unsharded buffer
            output = bucket.columns[0].view(-1)
        else:
            output = send.new_empty(world * bucket.per_rank)  # (world * per_rank,)
        work = _all_gather_single(output, send, group=comm.group, async_op=not cuda)
        trace.on_completion(traced, work)
        if cuda:
            _copy_out(bucket, output, world)
            comm.streams.end_timing(timing, traced)
            return PendingAllGather(bucket, name, None, None, None, comm.streams.done("all_gather"), traced)
    return PendingAllGather(bucket, name, send, output, work, None, traced)


def finish_all_gather(pending: PendingAllGather, comm: Comm) -> None:
    """Wait for the all-gather; afterwards the unsharded buffers hold the gathered data."""
    trace.waiting(pending.traced)
    if pending.work is not None:
        with trace.label("wait_all_gather", pending.name):
            _wait(pending.work)
        trace.done(pending.traced)
        _copy_out(pending.bucket, pending.output, comm.world)
    comm.streams.wait(pending.event)


def _copy_in(bucket: Bucket, inputs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The inputs end to end in the bucket's dtype on the compute device: a view of the one
    input, a ``torch.cat``, or, when a cast (mixed precision) or a host-to-device copy
    (offload) is due, one ``copy_`` per input into a fresh buffer."""
    if not bucket.copy_in_converts:
        return inputs[0] if len(inputs) == 1 else torch.cat(inputs)
    send = torch.empty(bucket.per_rank, dtype=bucket.dtype, device=device)
    for piece, x in zip(send.split(bucket.shard_numels), inputs):
        piece.copy_(x, non_blocking=True)  # pinned host memory: asynchronous on the side stream
    return send


def _copy_out(bucket: Bucket, output: torch.Tensor, world: int) -> None:
    """Each parameter's column block of the (world, per_rank) output into its own buffer."""
    if not bucket.by_rows:  # some parameter is split along another dim: rearrange per parameter
        for p, block in zip(bucket.params, output.view(world, -1).split(bucket.shard_numels, dim=1)):
            p.copy_out(block)
        return
    if len(bucket.params) == 1:
        return  # gathered in place
    torch.split_with_sizes_copy(
        output.view(world, -1),  # (world, per_rank)
        bucket.shard_numels,
        dim=1,
        out=bucket.columns,  # each (world, shard_numel)
    )


# Reduce-scatter ----------------------------------------------------------------------------
@dataclass
class Reduction:
    """How a group's gradients are reduced, besides the bucket and its process group."""

    divide_by: float  # the sum over ranks is divided by this (the ranks, or the user's factor)
    replicate: Comm | None = None  # HSDP: all-reduce the chunk over the replicas after
    partial: torch.Tensor | None = None  # HSDP: earlier sums kept without all-reduce, added first
    keep_partial: dict | None = None  # HSDP without all-reduce: store the chunk here (by bucket key)


@dataclass
class PendingReduceScatter:
    bucket: Bucket
    grads: list[torch.Tensor | None]  # CUDA: the inputs, alive until the compute stream waits
    send: torch.Tensor  # (world, per_rank + n): alive until the work completes
    chunk: torch.Tensor  # (per_rank + n,): this rank's reduced chunk, once finished
    work: dist.Work | None
    event: torch.cuda.Event | None
    divide_by: float  # after the reduction
    missing: list[int]  # indices of the parameters this rank has no gradient for
    chunk_of_all_reduce: bool  # ``chunk`` is a row of the whole all-reduce buffer
    name: str = ""
    replicate: Comm | None = None  # see Reduction
    partial: torch.Tensor | None = None
    keep_partial: dict | None = None
    reduced: torch.Tensor | None = None  # (per_rank,): divided (on the side stream, CUDA)
    all_reduce_started: bool = False  # CPU: ``work`` is now the all-reduce over the replicas
    traced: trace.Event | None = None  # the reduce-scatter, while a trace records
    traced_all_reduce: trace.Event | None = None  # the all-reduce over the replicas


def reduce_scatter(bucket: Bucket, grads: list[torch.Tensor | None], comm: Comm, name: str, how: Reduction) -> PendingReduceScatter:
    """Issue one reduction of the bucket's unsharded grads (None where this rank has none),
    in the bucket's dtype (``reduce_dtype``), and divide the sum by ``how.divide_by``.

    In a dtype with little range (fp16) part of the division comes before the sum, so that the
    sum of ``world`` gradients cannot overflow (FSDP2's pre/post factors). With
    ``how.replicate`` (HSDP), the reduced chunk is then all-reduced over the replicas; with
    ``how.keep_partial`` it is not, and is kept (undivided) for the next reduction to add.
    """
    params, world, cuda = bucket.params, comm.world, comm.streams.is_cuda
    pre, post = _divide_factors(how.divide_by, bucket.dtype)
    via = "via all_reduce" if comm.reduce_by_all_reduce else ""
    numel = world * (bucket.per_rank + len(params))
    traced = trace.record("reduce_scatter", name, via, dtype=bucket.dtype, numel=numel, world=world, mesh_dim=comm.mesh_dim)
    check.before(comm.group, "reduce_scatter", name, bucket.dtype, numel, world)
    with comm.streams.side("reduce_scatter"), trace.label("reduce_scatter", name):
        timing = comm.streams.start_timing(traced)
        missing = [i for i, g in enumerate(grads) if g is None]
        send = _reduce_scatter_input(bucket, grads, missing, world)  # (world, per_rank + n)
        if pre != 1:
            send.div_(pre)  # the presence column too: it only has to stay above zero
        if comm.reduce_by_all_reduce:
            work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=comm.group, async_op=not cuda)
            chunk = send[comm.rank]  # (per_rank + n,)
        else:
            chunk = send.new_empty(bucket.per_rank + len(params))
            work = _reduce_scatter_single(chunk, send.view(-1), op=dist.ReduceOp.SUM, group=comm.group, async_op=not cuda)
        trace.on_completion(traced, work)
        pending = PendingReduceScatter(
            bucket, grads if cuda else [], send, chunk, work, None, post, missing, comm.reduce_by_all_reduce,
            name, how.replicate, how.partial, how.keep_partial, traced=traced,
        )
        if cuda:
            comm.streams.end_timing(timing, traced)
            pending.work, pending.send = None, None  # done on the side stream
            pending.event = comm.streams.done("reduce_scatter")
    if cuda:  # the rest is enqueued now too, ordered after the reduce-scatter by an event
        with comm.streams.side("all_reduce", after=pending.event), trace.label("all_reduce", name):
            _start_all_reduce(pending, async_op=False)
            if pending.keep_partial is None:
                pending.reduced = _divided(pending)
        pending.event = comm.streams.done("all_reduce")
    return pending


def _reduce_scatter_input(bucket: Bucket, grads: list[torch.Tensor | None], missing: list[int], world: int) -> torch.Tensor:
    """Copy-in: every gradient (zeros where missing) as ``world`` padded chunks, rank-major,
    then the grad-presence column: ``(world, per_rank + n)``."""
    params, device = bucket.params, bucket.params[0].device
    present = bucket.all_present(device)  # (n,) ones, made once: no host-to-device copy per step
    if missing:
        present = present.clone()
        present[missing] = 0
    filled = [
        torch.zeros(p.shape, dtype=bucket.dtype, device=device) if g is None else g if g.dtype == bucket.dtype else g.to(bucket.dtype)
        for p, g in zip(params, grads)
    ]
    if bucket.by_rows:
        return torch._chunk_cat(filled + [present.expand(world, -1)], dim=0, num_chunks=world)
    send = torch.empty(world, bucket.per_rank + len(params), dtype=bucket.dtype, device=device)
    blocks = send.split([*bucket.shard_numels, len(params)], dim=1)
    for p, g, block in zip(params, filled, blocks):
        p.chunk_grad_into(g, block)  # split along another dim: rearranged per parameter
    blocks[-1].copy_(present.expand(world, -1))
    return send


def _start_all_reduce(pending: PendingReduceScatter, async_op: bool) -> dist.Work | None:
    """After the reduce-scatter: add the kept partial sums, and issue the all-reduce over the
    replicas (HSDP) unless it is skipped. On CUDA this is enqueued on the all-reduce stream
    behind the reduce-scatter; on CPU it starts once the reduce-scatter has completed."""
    pending.all_reduce_started = True
    if pending.partial is not None:
        pending.chunk.add_(pending.partial)
    replicate = pending.replicate
    if replicate is None or pending.keep_partial is not None:
        return None
    chunk = pending.chunk
    traced = trace.record("all_reduce", pending.name, dtype=chunk.dtype, numel=chunk.numel(), world=replicate.world, mesh_dim=replicate.mesh_dim)
    pending.traced_all_reduce = traced
    check.before(replicate.group, "all_reduce", pending.name, chunk.dtype, chunk.numel(), replicate.world)
    timing = replicate.streams.start_timing(traced)
    work = dist.all_reduce(chunk, op=dist.ReduceOp.SUM, group=replicate.group, async_op=async_op)
    replicate.streams.end_timing(timing, traced)
    trace.on_completion(traced, work)
    return work


def progress(pending: PendingReduceScatter) -> bool:
    """Move the reduction on without blocking: once the reduce-scatter has completed, start
    the all-reduce over the replicas (CPU). Returns whether all of it has completed."""
    if pending.work is None:  # CUDA (all enqueued; the event tells) or nothing left to wait for
        return pending.event is None or pending.event.query()
    if not pending.work.is_completed():
        return False
    if not pending.all_reduce_started:
        _wait(pending.work)
        pending.work = _start_all_reduce(pending, async_op=True)
        return pending.work is None
    return True


def finish_reduce_scatter(pending: PendingReduceScatter, comm: Comm) -> None:
    """Wait for the reduction and give each parameter its rows as (part of) ``.grad``."""
    # CPU: the reduce-scatter (and then the all-reduce), or the all-reduce progress() started.
    if not pending.all_reduce_started:
        _wait_traced(pending.work, pending.traced, "reduce_scatter", pending.name)
        pending.work = _start_all_reduce(pending, async_op=True)
    _wait_traced(pending.work, pending.traced_all_reduce, "all_reduce", pending.name)
    if pending.event is not None:  # CUDA
        trace.waiting(pending.traced)
        trace.waiting(pending.traced_all_reduce)
    comm.streams.wait(pending.event)
    bucket = pending.bucket
    if pending.keep_partial is not None:  # HSDP, all-reduce skipped: .grad waits for the next one
        pending.keep_partial[tuple(map(id, bucket.params))] = pending.chunk
        return
    reduced = pending.reduced if pending.reduced is not None else _divided(pending)
    # Our own gradient implies a nonzero count, so we read the counts back (a device sync on
    # GPU) only when this rank lacks one. Under a fake process group they are garbage.
    counts = pending.chunk[bucket.per_rank :].tolist() if pending.missing else None
    offset = 0
    for i, (p, numel) in enumerate(zip(bucket.params, bucket.shard_numels)):
        if counts is None or i not in pending.missing or counts[i] > 0:
            p.set_sharded_grad(p.local_grad(reduced[offset : offset + numel]))
        offset += numel


def _wait_traced(work: dist.Work | None, traced: trace.Event | None, kind: str, name: str) -> None:
    """Wait for ``work`` (if any), marking the traced collective's wait and completion."""
    if work is None:
        return
    trace.waiting(traced)
    with trace.label(f"wait_{kind}", name):
        _wait(work)
    trace.done(traced)


def _wait(work: dist.Work) -> None:
    try:
        work.wait()
    except Exception as exc:  # a timeout or a dead peer: say what this rank had issued
        raise check.failed(exc) from exc


def _divide_factors(factor: float, dtype: torch.dtype) -> tuple[float, float]:
    """(before, after) the sum. fp32/bf16/fp64: all after. Otherwise (fp16) about sqrt(factor)
    before, a power of two, and the rest after (FSDP2's split)."""
    if dtype in (torch.float32, torch.bfloat16, torch.float64):
        return 1.0, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre


def _divided(pending: PendingReduceScatter) -> torch.Tensor:
    """This rank's reduced rows over the divide factor. After an all-reduce, a new tensor,
    so that the gradients do not keep every rank's rows alive; else in place."""
    reduced = pending.chunk[: pending.bucket.per_rank]
    if pending.chunk_of_all_reduce:
        return reduced / pending.divide_by
    return reduced.div_(pending.divide_by)
