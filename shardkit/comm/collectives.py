"""Grouped collectives: copy-in, ONE collective, copy-out, issued now and finished later.

A bucket (``comm/buckets.py``) is the parameters of one group with one dtype. Its all-gather
input is every parameter's padded shard laid end to end (``per_rank`` elements); the
all-gather output is ``world`` such rows, rank-major, and copy-out scatters each parameter's
column block into its own unsharded buffer. The reduce-scatter is the mirror image: copy-in
lays every gradient out as ``world`` padded chunks (``torch._chunk_cat``), one reduction, and
each parameter's reduced rows are a view of this rank's chunk.

Every collective is split in two: ``all_gather`` / ``reduce_scatter`` issue it (copy-in and
the collective, through ``comm/streams.py``, which says where they run) and return a pending
record; ``finish_all_gather`` / ``finish_reduce_scatter`` wait for it and hand the result
over (copy-out, on the compute stream). The same steps on every device.

The reduce-scatter carries one extra column per parameter, the **grad-presence column**: 1
where this rank produced a gradient, else 0. After the sum it tells every rank whether any
rank used the parameter, so a parameter unused on every rank keeps ``.grad = None`` (as in
a single process), while one unused on some ranks only is reduced with zeros there.

On gloo (whose reduce-scatter is slow, docs/design.md) it is an all-to-all of the buffer and
a sum of the received chunks ("via all_to_all" in the trace).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardkit.comm import check, trace
from shardkit.comm.buckets import Bucket, GatherBucket
from shardkit.comm.streams import Collective, Handle, Streams, call_on

# torch 2.13 renamed the single-tensor collectives; older torch (e.g. on GPU images) has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Comm:
    """Where a group's collectives go: fixed when the group is made, so no per-step lookups."""

    group: dist.ProcessGroup
    world: int
    rank: int  # this rank's index in ``group``
    streams: Streams
    gloo: bool  # its reduce_scatter is slow: reductions go another way (see reduce_scatter)
    mesh_dim: str  # the mesh dimension's name, for the trace
    averages: bool = False  # the backend divides by the ranks itself (ReduceOp.AVG): NCCL, and the fake one standing in for it

    @classmethod
    def of(cls, mesh: DeviceMesh, dim: int, streams: Streams, name: str | None = None, separate: bool = False) -> "Comm":
        group = mesh.get_group(dim)
        if separate:  # a second process group over the same ranks, one per rank set and world
            # (keyed by the world group too: a new init_process_group, or each rank's world under
            # torch's threaded process group, gets its own)
            key = (dist.group.WORLD, tuple(dist.get_process_group_ranks(group)))
            if key not in _separate_groups:
                _separate_groups[key] = dist.new_group(list(key[1]), use_local_synchronization=True)
            group = _separate_groups[key]
        backend = str(dist.get_backend(group))
        if name is None:
            name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else f"dim{dim}"
        world = dist.get_world_size(group)
        return cls(group, world, dist.get_rank(group), streams, backend == "gloo", name, backend in ("nccl", "fake") and world > 1)


_separate_groups: dict[tuple, dist.ProcessGroup] = {}


# All-gather --------------------------------------------------------------------------------
@dataclass
class PendingAllGather:
    bucket: GatherBucket
    handle: Handle
    output: torch.Tensor  # (world * per_rank,): copied out once the handle is waited for
    custom: bool = False  # a user's AllGather made the output: copy out even when in place


def all_gather(bucket: GatherBucket, comm: Comm, name: str, custom=None) -> PendingAllGather:
    """Issue one all-gather of the bucket's shards (``finish_all_gather`` copies them out);
    ``custom``: the user's ``AllGather`` (``set_custom_all_gather``) allocates and runs it."""
    inputs = bucket.inputs()  # and room for the outputs, on the compute stream (see the Note in streams.py)
    numel = comm.world * bucket.per_rank
    traced = None  # (no keyword arguments packed per call unless a trace records)
    if trace.is_recording():
        traced = trace.record("all_gather", name, dtype=bucket.dtype, numel=numel, world=comm.world, mesh_dim=comm.mesh_dim)
    check.before(comm.group, "all_gather", name, bucket.dtype, numel, comm.world)

    def launch(async_op: bool):
        send = _copy_in(bucket, inputs)  # (per_rank,)
        if custom is not None:
            output = custom.allocate((numel,), dtype=bucket.dtype, device=send.device)
            work = custom(output_tensor=output, input_tensor=send, group=comm.group, async_op=async_op)
            return work, {"input": send, "output": output}
        output = bucket.columns[0].view(-1) if bucket.in_place else send.new_empty(numel)  # (world * per_rank,)
        work = _all_gather_single(output, send, group=comm.group, async_op=async_op)
        return work, {"input": send, "output": output}

    handle = comm.streams.issue(Collective("all_gather", name, traced), {"shards": inputs}, launch)
    return PendingAllGather(bucket, handle, handle.buffers["output"], custom is not None)


def finish_all_gather(pending: PendingAllGather) -> None:
    """Wait for the all-gather; then the unsharded parameters hold the gathered data."""
    pending.handle.wait()
    _copy_out(pending.bucket, pending.output, pending.custom)
    for p in pending.bucket.params:
        p.gathered()


def _copy_in(bucket: GatherBucket, inputs: list[torch.Tensor]) -> torch.Tensor:
    """The inputs end to end in the bucket's dtype on the compute device: a view of the one
    input, a ``torch.cat``, or, when a cast (mixed precision, bytes) or a host-to-device copy
    (offload) is due, one ``copy_`` per input into a fresh buffer."""
    if not bucket.copy_in_converts:
        return inputs[0] if len(inputs) == 1 else torch.cat(inputs)
    device = bucket.params[0].device
    send = torch.empty(bucket.per_rank, dtype=bucket.dtype, device=device)
    for piece, x, dtype in zip(send.split(bucket.sizes), inputs, bucket.dtypes):
        if bucket.dtype is torch.uint8 and dtype is not torch.uint8:
            x = x.to(device, dtype, non_blocking=True).view(torch.uint8)
        piece.copy_(x, non_blocking=True)  # pinned host memory: asynchronous on the side stream
    return send


def _copy_out(bucket: GatherBucket, output: torch.Tensor, custom: bool = False) -> None:
    """Each piece's column block of the (world, per_rank) output into its own buffer."""
    if bucket.in_place and not custom:
        return
    rows = output.view(bucket.world, -1)  # (world, per_rank)
    if bucket.by_rows:
        torch.split_with_sizes_copy(rows, bucket.sizes, dim=1, out=bucket.columns)  # each (world, size)
        return
    for p, dtype, block, column in zip(bucket.owners, bucket.dtypes, rows.split(bucket.sizes, dim=1), bucket.columns):
        if p.dim == 0 or p.extension is not None:
            column.copy_(block)
        else:  # split along another dim: rearranged per parameter
            p.copy_out(block if block.dtype == dtype else block.contiguous().view(dtype))


# Reduce-scatter ----------------------------------------------------------------------------
@dataclass
class Reduction:
    """How a group's gradients are reduced, besides the bucket and its process group."""

    divide_by: float  # the sum over ranks is divided by this (the ranks, or the user's factor)
    replicate: Comm | None = None  # HSDP: all-reduce the chunk over the replicas after (unless keep_partial)
    partial: tuple | None = None  # HSDP: (chunk, ranks it is averaged over) kept without all-reduce, added first
    keep_partial: dict | None = None  # HSDP without all-reduce: store the chunk here (by bucket key)
    custom: Any = None  # the user's ReduceScatter (set_custom_reduce_scatter)
    hook: tuple | None = None  # (hook, stream) of set_all_reduce_hook
    force_sum: bool = False  # set_force_sum_reduction_for_comms: ReduceOp.SUM, then divide
    user_factor: bool = False  # divide_by is set_gradient_divide_factor's (FSDP2 picks other ops for it)


@dataclass
class PendingReduction:
    bucket: Bucket
    handles: list[Handle]  # the reduce-scatter, then (HSDP) what continues it over the replicas
    chunk: torch.Tensor  # (per_rank + n,): this rank's reduced rows, then the presence counts
    missing: list[int]  # indices of the parameters this rank has no gradient for
    divide_by: float  # after the reduction
    keep_partial: dict | None  # see Reduction
    averaged_over: int  # 1: ``chunk`` holds sums; else the backend averaged over this many ranks
    via: str  # "": ``chunk`` is the reduced chunk; "all_reduce": a row of the whole all-reduce buffer;
    # "all_to_all": (world, per_rank + n), every rank's rows for this rank, to sum (gloo)
    hook: tuple | None = None  # see Reduction


def reduce_scatter(bucket: Bucket, grads: list[torch.Tensor | None], comm: Comm, name: str, how: Reduction) -> PendingReduction:
    """Issue one reduction of the bucket's unsharded grads (None where this rank has none),
    in the bucket's dtype (``reduce_dtype``), and divide the sum by ``how.divide_by``.

    In a dtype with little range (fp16) part of the division comes before the sum, so that the
    sum of ``world`` gradients cannot overflow (FSDP2's pre/post factors). With
    ``how.replicate`` (HSDP), the reduced chunk is then all-reduced over the replicas; with
    ``how.keep_partial`` it is not, and is kept (undivided) for the next reduction to add.
    ``_reduce_ops`` picks the ops (SUM, or AVG where the backend averages).
    """
    world, n = comm.world, len(bucket.params)
    pre, post, op, replicate_op = _reduce_ops(comm, how, bucket.dtype)
    plain = how.custom is None and how.hook is None and how.replicate is None and how.keep_partial is None and how.partial is None
    missing = [i for i, g in enumerate(grads) if g is None]
    numel = world * (bucket.per_rank + n)
    # gloo's reduce_scatter is slow: over one dim an all-to-all (the same bytes) and the sum
    # here; else (HSDP, hooks) an all-reduce (twice the bytes). See docs/design.md.
    by_all_to_all = comm.gloo and plain
    by_all_reduce = comm.gloo and how.custom is None and not by_all_to_all
    via = "all_to_all" if by_all_to_all else "all_reduce" if by_all_reduce else ""
    traced = None
    if trace.is_recording():
        op_name = _op_name(op)
        traced = trace.record("reduce_scatter", name, f"via {via}" if via else "", dtype=bucket.dtype, numel=numel, world=world, mesh_dim=comm.mesh_dim, op=op_name, divide_by=post)
    check.before(comm.group, "reduce_scatter", name, bucket.dtype, numel, world)

    def launch(async_op: bool):
        send = bucket.reduce_scatter_input(grads, missing)  # (world, per_rank + n)
        if pre != 1:
            send.div_(pre)  # the presence column too: it only has to stay above zero
        if by_all_to_all:  # row r of ``chunk``: rank r's rows for this rank, summed by finish_reduce_scatter
            chunk = torch.empty_like(send)  # (world, per_rank + n)
            work = dist.all_to_all_single(chunk, send, group=comm.group, async_op=async_op)
        elif by_all_reduce:
            work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=comm.group, async_op=async_op)
            chunk = send[comm.rank]  # (per_rank + n,)
        elif how.custom is not None:
            work, chunk, send = _custom_reduce_scatter(how.custom, send, bucket.per_rank + n, comm.group, op, async_op)
        else:
            chunk = send.new_empty(bucket.per_rank + n)
            work = _reduce_scatter_single(chunk, send.view(-1), op=op, group=comm.group, async_op=async_op)
        return work, {"input": send, "output": chunk}

    handle = comm.streams.issue(Collective("reduce_scatter", name, traced), {"unsharded gradients": grads}, launch)
    chunk = handle.buffers["output"]
    handles = [handle]
    averaged_over = world if op == dist.ReduceOp.AVG else 1
    if how.partial is not None or how.replicate is not None and how.keep_partial is None:
        handles.append(_over_replicas(handle, chunk, comm.streams, name, how, replicate_op, averaged_over))
    return PendingReduction(bucket, handles, chunk, missing, post, how.keep_partial, averaged_over, via, how.hook)


def _custom_reduce_scatter(custom, send: torch.Tensor, chunk_numel: int, group, op, async_op: bool):
    """``set_custom_reduce_scatter``: the user's buffers and collective; (work, chunk, input)."""
    buffer = custom.allocate((send.numel(),), dtype=send.dtype, device=send.device)
    buffer.copy_(send.view(-1))
    chunk = custom.allocate((chunk_numel,), dtype=send.dtype, device=send.device)
    work = custom(output_tensor=chunk, input_tensor=buffer, group=group, op=op, async_op=async_op)
    return work, chunk, buffer


def _reduce_ops(comm: Comm, how: Reduction, dtype: torch.dtype) -> tuple[float, float, Any, Any]:
    """(divide before, divide after, the reduce-scatter's op, the HSDP all-reduce's op). SUM
    and a division, except for fp32/bf16 divided by the ranks on a backend that averages
    (NCCL): there the collectives average (as FSDP2), in both with HSDP, and nothing is
    divided after; a user's divide factor equal to the shard dim's ranks averages there only
    (FSDP2's choice); not with ``set_force_sum_reduction_for_comms``. (A user's reduce-scatter is
    given the op; an all-reduce hook sees the chunk as the collectives left it, before any
    division: as FSDP2.)"""
    pre, post = _divide_factors(how.divide_by, dtype)
    comms = (comm,) if how.replicate is None else (comm, how.replicate)
    averages = all(c.averages or c.world == 1 for c in comms) and dtype in (torch.float32, torch.bfloat16) and not how.force_sum
    if averages and not how.user_factor and how.divide_by == math.prod(c.world for c in comms):
        return pre, 1, _average(comm), _average(how.replicate or comm)
    if averages and how.user_factor and how.divide_by == comm.world:  # the shard dim's average, summed over replicas
        return pre, 1, _average(comm), dist.ReduceOp.SUM
    return pre, post, dist.ReduceOp.SUM, dist.ReduceOp.SUM


def _average(comm: Comm):
    """AVG, or SUM over one rank (the same; NCCL's AVG over one rank is unreliable)."""
    return dist.ReduceOp.AVG if comm.world > 1 else dist.ReduceOp.SUM


def _op_name(op) -> str:
    return "avg" if op == dist.ReduceOp.AVG else "sum"


def _over_replicas(first: Handle, chunk: torch.Tensor, streams: Streams, name: str, how: Reduction, op, averaged_over: int) -> Handle:
    """HSDP, once the reduce-scatter is done: add the sums kept from reductions without an
    all-reduce, then all-reduce the chunk over the replicas (unless it is kept instead)."""
    replicate = how.replicate if how.keep_partial is None else None
    traced = None
    if replicate is not None:
        traced = trace.record("all_reduce", name, dtype=chunk.dtype, numel=chunk.numel(), world=replicate.world, mesh_dim=replicate.mesh_dim, op=_op_name(op))

    def launch(async_op: bool):
        if how.partial is not None:  # in the units of this chunk (sums, or averages over the shard dim)
            partial, partial_over = how.partial
            chunk.add_(partial, alpha=partial_over / averaged_over)
        if replicate is None:
            return None, {}
        check.before(replicate.group, "all_reduce", name, chunk.dtype, chunk.numel(), replicate.world)
        work = dist.all_reduce(chunk, op=op, group=replicate.group, async_op=async_op)
        return work, {}

    inputs = {"buffer": chunk, "partial sums": how.partial[0] if how.partial is not None else None}
    return streams.issue(Collective("all_reduce", name, traced), inputs, launch, after=first)


def reduce_done(pending: PendingReduction) -> bool:
    """Whether the reduction has completed, moving it on without blocking (starting the HSDP
    all-reduce once its reduce-scatter is done, on the CPU)."""
    return all(h.poll() for h in pending.handles)  # in order, stopping at the first not done


def finish_reduce_scatter(pending: PendingReduction, keep: bool = True) -> None:
    """Wait for the reduction and give each parameter its rows as (part of) ``.grad``
    (``keep=False``: drop them, after an aborted step)."""
    for handle in pending.handles:
        handle.wait()
    bucket = pending.bucket
    if not keep:
        return
    if pending.keep_partial is not None:  # HSDP, all-reduce skipped: .grad waits for the next one
        pending.keep_partial[tuple(map(id, bucket.params))] = (pending.chunk, pending.averaged_over)
        return
    # Our own gradient implies a nonzero count, so we read the counts back (a device sync on
    # GPU) only when this rank lacks one. Under a fake process group they are garbage.
    per_rank, n, chunk, counts = bucket.per_rank, len(bucket.params), pending.chunk, None
    if pending.via == "all_to_all":  # (world, per_rank + n): every rank's rows for this rank
        reduced = chunk.narrow(1, 0, per_rank).sum(0)
        if pending.missing:
            counts = chunk.narrow(1, per_rank, n).sum(0).tolist()
    else:  # (per_rank + n,): the reduced rows, then the presence counts
        reduced = chunk.narrow(0, 0, per_rank)
        if pending.missing:
            counts = chunk.narrow(0, per_rank, n).tolist()
    if pending.hook is not None:  # set_all_reduce_hook: the summed chunk, before the division
        call_on(pending.hook[1], pending.hook[0], reduced)
    # After an all-reduce, divide into a new tensor, so that the gradients do not keep every
    # rank's rows alive; else in place (not at all when the collective averaged).
    if pending.via == "all_reduce":
        reduced = reduced / pending.divide_by
    elif pending.divide_by != 1:
        reduced.div_(pending.divide_by)
    for i, (p, rows) in enumerate(zip(bucket.params, reduced.split_with_sizes(bucket.shard_numels))):
        if counts is None or i not in pending.missing or counts[i] > 0:
            p.set_sharded_grad(p.local_grad(rows))


def _divide_factors(factor: float, dtype: torch.dtype) -> tuple[float, float]:
    """(before, after) the sum. fp32/bf16/fp64: all after. Otherwise (fp16) about sqrt(factor)
    before, a power of two, and the rest after (FSDP2's split)."""
    if dtype in (torch.float32, torch.bfloat16, torch.float64):
        return 1.0, factor
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return float(pre), factor / pre
