"""Grouped collectives: copy-in, ONE collective, copy-out, issued now and finished later.

A bucket (``comm/buckets.py``) is the parameters of one group with one dtype. Its all-gather
input is every parameter's padded shard laid end to end (``per_rank`` elements); the
all-gather output is ``world`` such rows, rank-major, and copy-out scatters each parameter's
column block into its own unsharded buffer. The reduce-scatter is the mirror image: copy-in
lays every gradient out as ``world`` padded chunks (``torch._chunk_cat``), one reduction, and
each parameter's reduced rows are a view of this rank's chunk.

Every collective is split in two: ``all_gather`` / ``reduce_scatter`` issue it (copy-in and
the collective, through ``comm/streams.py``, which says where they run) and return a pending
record; ``finish_all_gather`` / ``Reduction.finish`` wait for it and hand the result over
(copy-out, on the compute stream). The same steps on every device. A reduction takes one of
four routes, each a ``Reduction`` subclass with its own collective and read-back; making one
issues nothing, its ``issue`` does.

The reduce-scatter carries one extra column per parameter, the **grad-presence column**: 1
where this rank produced a gradient, else 0. After the sum it tells every rank whether any
rank used the parameter, so a parameter unused on every rank keeps ``.grad = None`` (as in
a single process), while one unused on some ranks only is reduced with zeros there.

On gloo (whose reduce-scatter is slow, docs/design.md) it is an all-to-all of the buffer and
a sum of the received chunks ("via all_to_all" in the trace), or with HSDP or hooks an
all-reduce ("via all_reduce").
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardkit.comm import check, trace
from shardkit.comm.buckets import Bucket, GatherBucket
from shardkit.comm.streams import Collective, Handle, Streams, call_on
from shardkit.core.meshes import resizable
from shardkit.core.reduction import divides_in_collectives, reduce_ops

# torch 2.13 renamed the single-tensor collectives; older torch (e.g. on GPU images) has the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# A one-rank shard dim runs no collective (``_alone``, ``OneRank``), as FSDP2; tests/gpu and
# gpu_check.py's overlap check turn this off to put NCCL's collectives on their side streams at
# world 1, the one GPU they have.
ONE_RANK_SKIPS = True


@dataclass
class Comm:
    """Where a group's collectives go: fixed when the group is made, so no per-step lookups."""

    process_group: dist.ProcessGroup
    world: int
    rank: int  # this rank's index in ``process_group``
    streams: Streams
    gloo: bool  # its reduce_scatter is slow: reductions go another way (see reduce_scatter)
    mesh_dim: str  # the mesh dimension's name, for the trace
    averages: bool = False  # the backend divides by the ranks itself (ReduceOp.AVG)
    at_once: bool = False  # the backend's work is done once issued (see backend_of)
    resizable: bool = False  # its size may change between steps (core/meshes.py): ``size()`` asks it

    def size(self) -> int:
        """The ranks taking part now: ``world``, or what a resizable group says at this moment
        (torchft's managed group: the replicas in this step's quorum)."""
        return self.process_group.size() if self.resizable else self.world

    @classmethod
    def of(cls, mesh: DeviceMesh, dim: int, streams: Streams, name: str | None = None, separate: bool = False) -> "Comm":
        pg = mesh.get_group(dim)
        if separate:  # a second process group over the same ranks, one per process group
            if pg not in _separate_groups:  # (dropped with it: weakly keyed)
                _separate_groups[pg] = dist.new_group(dist.get_process_group_ranks(pg), use_local_synchronization=True)
            pg = _separate_groups[pg]
        name = name or dim_name(mesh, dim)
        if resizable(pg):  # not in c10d's registry; SUM and a division by its size at each reduction
            return cls(pg, pg.size(), pg.rank(), streams, False, name, resizable=True)
        gloo, averages, at_once = backend_of(pg)
        world = dist.get_world_size(pg)
        return cls(pg, world, dist.get_rank(pg), streams, gloo, name, averages and world > 1, at_once)


def dim_name(mesh: DeviceMesh, dim: int) -> str:
    """A mesh dim's name in the trace (both modes): its name, or ``dim<i>`` on an unnamed mesh."""
    return mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else f"dim{dim}"


def backend_of(pg: dist.ProcessGroup) -> tuple[bool, bool, bool]:
    """What the collectives need to know of a process group's backend: (gloo: its
    reduce-scatter is slow; it averages with ReduceOp.AVG; its work is done once issued). The
    one place that knows torch's fake process group (tests at any world size in one process):
    it stands in for NCCL, so it averages as NCCL does, and its work never says
    ``is_completed()``, though its future is done at once."""
    backend = str(dist.get_backend(pg))
    return backend == "gloo", backend in ("nccl", "fake"), backend == "fake"


_separate_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # process group -> its second one


# All-gather --------------------------------------------------------------------------------
# The all-gather output's whole life, in order:
#   1. allocate: ``all_gather`` makes room in the unsharded buffers (on the compute stream: see
#      the Note in streams.py), or the collective gets an output of its own;
#   2. copy-in and the collective: ``all_gather``'s launch (on the side stream on CUDA);
#   3. copy-out: ``finish_all_gather``, after waiting (on the compute stream);
#   4. free: ``free_all_gather``, at reshard.
# The layouts (what goes where) are the bucket's: ``GatherBucket.copy_in`` / ``copy_out``.
@dataclass
class PendingAllGather:
    bucket: GatherBucket
    handle: Handle
    output: torch.Tensor  # (world * per_rank,): copied out once the handle is waited for
    custom: bool = False  # a user's AllGather made the output: copy out even when in place


def all_gather(bucket: GatherBucket, comm: Comm, name: str, custom=None) -> PendingAllGather:
    """Issue one all-gather of the bucket's shards (``finish_all_gather`` copies them out);
    ``custom``: the user's ``AllGather`` (``set_custom_all_gather``) allocates and runs it.
    Over one rank there is nothing to gather: the shards are copied into the unsharded
    buffers and no collective runs, as FSDP2 does (``_alone``)."""
    inputs = bucket.inputs()
    bucket.alloc_outputs(inputs)
    if comm.world == 1 and ONE_RANK_SKIPS:
        return _alone(bucket, comm, name, inputs)
    numel = comm.world * bucket.per_rank
    # (no keyword arguments packed per call unless a trace records)
    traced = trace.record("all_gather", name, dtype=bucket.dtype, numel=numel, world=comm.world, mesh_dim=comm.mesh_dim) if trace.is_recording() else None
    check.before(comm.process_group, "all_gather", name, bucket.dtype, numel, comm.world)

    def launch(async_op: bool):
        send = bucket.copy_in(inputs)  # (per_rank,)
        if custom is not None:
            output = custom.allocate((numel,), dtype=bucket.dtype, device=send.device)
            work = custom(output_tensor=output, input_tensor=send, group=comm.process_group, async_op=async_op)
            return work, {"input": send, "output": output}
        output = bucket.columns[0].view(-1) if bucket.in_place else send.new_empty(numel)  # (world * per_rank,)
        work = _all_gather_single(output, send, group=comm.process_group, async_op=async_op)
        return work, {"input": send, "output": output}

    handle = comm.streams.issue(Collective("all_gather", name, traced, comm.at_once), {"shards": inputs}, launch)
    return PendingAllGather(bucket, handle, handle.buffers["output"], custom is not None)


def _alone(bucket: GatherBucket, comm: Comm, name: str, inputs: list[torch.Tensor]) -> PendingAllGather:
    """The all-gather of a one-rank dim (a single process, HSDP with one rank per replica):
    its output is the copy-in (copied once more into the buffer when gathered in place); no
    collective, no trace line, and a user's all-gather is not called, as FSDP2."""

    def launch(async_op: bool):
        send = bucket.copy_in(inputs)
        output = bucket.columns[0].view(-1).copy_(send) if bucket.in_place else send
        return None, {"input": send, "output": output}

    handle = comm.streams.issue(Collective("all_gather", name, None, True), {"shards": inputs}, launch)
    return PendingAllGather(bucket, handle, handle.buffers["output"])


def finish_all_gather(pending: PendingAllGather) -> None:
    """Wait for the all-gather; then the unsharded parameters hold the gathered data."""
    pending.handle.wait()
    pending.bucket.copy_out(pending.output, pending.custom)
    for p in pending.bucket.params:
        p.gathered()


def free_all_gather(bucket: GatherBucket) -> None:
    """Let the all-gather's output go (reshard; the next ``all_gather`` makes room again)."""
    for p in bucket.params:
        p.free_unsharded()


# Reduce-scatter ----------------------------------------------------------------------------
@dataclass
class ReduceSettings:
    """How a group's gradients are reduced, besides the bucket and its process group."""

    divide_by: float  # the sum over ranks is divided by this (the ranks, or the user's factor)
    replicate: Comm | None = None  # HSDP: all-reduce the chunk over the replicas after (unless keep_partial)
    partial: tuple | None = None  # HSDP: (chunk, ranks it is averaged over) kept without all-reduce, added first
    keep_partial: Callable[[tuple], None] | None = None  # HSDP without all-reduce: called with (chunk, ranks averaged over) instead
    custom: Any = None  # the user's ReduceScatter (set_custom_reduce_scatter)
    hook: tuple | None = None  # (hook, stream) of set_all_reduce_hook
    force_sum: bool = False  # set_force_sum_reduction_for_comms: ReduceOp.SUM, then divide
    user_factor: bool = False  # divide_by is set_gradient_divide_factor's (FSDP2 picks other ops for it)


def reduce_scatter(bucket: Bucket, grads: list[torch.Tensor | None], comm: Comm, name: str, settings: ReduceSettings) -> "Reduction":
    """Issue one reduction of the bucket's unsharded grads (None where this rank has none), by
    the route that suits the backend: a reduce-scatter; on gloo (whose reduce-scatter is slow,
    docs/design.md) an all-to-all and a sum here over one dim, else (HSDP, hooks) an
    all-reduce (twice the bytes); or the user's reduce-scatter. Over one rank, none
    (``OneRank``)."""
    if comm.world == 1 and ONE_RANK_SKIPS:
        route = OneRank
    elif settings.custom is not None:
        route = UserReduceScatter
    elif comm.gloo:  # an all-to-all over the shard dim alone: no hook, no HSDP
        plain = settings.hook is None and settings.replicate is None and settings.keep_partial is None and settings.partial is None
        route = AllToAllSum if plain else AllReduceRow
    else:
        route = ReduceScatter
    reduction = route(bucket, comm, name, settings)
    reduction.issue(grads)
    return reduction


class Reduction:
    """One reduction of a bucket's gradients, in the bucket's dtype (``reduce_dtype``), divided
    by ``settings.divide_by``: made (its ops and divisors), then ``issue``d; ``move_on`` starts
    what may start without blocking, and ``finish`` hands each parameter its rows as ``.grad``.
    The subclasses are the routes: each has its own collective (``_launch(send, op, async_op)``
    on ``send`` ``(world, per_rank + n)``, returning the work, its output and its input) and
    reads its own result back (``_reduced``).

    In a dtype with little range (fp16) part of the division comes before the sum, so that the
    sum of ``world`` gradients cannot overflow (FSDP2's pre/post factors). With
    ``settings.replicate`` (HSDP), the reduced chunk is then all-reduced over the replicas;
    with ``settings.keep_partial`` it is not, and is kept (undivided) for the next reduction
    to add. ``_reduce_ops`` picks the ops (SUM, or AVG where the backend averages).
    """

    via = ""  # the trace's detail: how the route reduces
    collective = True  # whether the route runs one (traced and checked)

    def __init__(self, bucket: Bucket, comm: Comm, name: str, settings: ReduceSettings) -> None:
        self.bucket, self.comm, self.name, self.settings = bucket, comm, name, settings
        self.pre, self.divide_by, self.op, self.replicate_op = _reduce_ops(comm, settings, bucket.dtype)
        self.averaged_over = comm.world if self.op == dist.ReduceOp.AVG else 1  # 1: the chunk holds sums
        self.missing: list[int] = []  # parameters this rank has no gradient for
        self.chunk: torch.Tensor | None = None  # this rank's reduced row, once issued
        self.handles: list[Handle] = []  # the reduction, then (HSDP) what continues it over the replicas
        self._complete = False  # as ``move_on`` last found it

    def issue(self, grads: list[torch.Tensor | None]) -> None:
        """Issue the collective on the unsharded grads (None where this rank has none), and
        (HSDP) the all-reduce over the replicas that continues it."""
        bucket, comm, name, settings, pre, op = self.bucket, self.comm, self.name, self.settings, self.pre, self.op
        self.missing = [i for i, g in enumerate(grads) if g is None]
        numel = comm.world * (bucket.per_rank + len(bucket.params))
        traced = None
        if self.collective:
            traced = trace.record("reduce_scatter", name, self.via, dtype=bucket.dtype, numel=numel, world=comm.world, mesh_dim=comm.mesh_dim, op=_op_name(op), divide_by=self.divide_by) if trace.is_recording() else None
            check.before(comm.process_group, "reduce_scatter", name, bucket.dtype, numel, comm.world)

        def launch(async_op: bool):
            send = bucket.copy_in(grads, self.missing)  # (world, per_rank + n)
            if pre != 1:
                send.div_(pre)  # the presence column too: it only has to stay above zero
            work, chunk, send = self._launch(send, op, async_op)
            return work, {"input": send, "output": chunk}

        handle = comm.streams.issue(Collective("reduce_scatter", name, traced, comm.at_once), {"unsharded gradients": grads}, launch)
        self.chunk = handle.buffers["output"]
        self.handles = [handle]
        if settings.partial is not None or settings.replicate is not None and settings.keep_partial is None:
            self.handles.append(_over_replicas(handle, self.chunk, comm.streams, name, settings, self.replicate_op, self.averaged_over))

    def _reduced(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's reduced rows ``(per_rank,)`` and the summed presence columns ``(n,)``."""
        chunk, per_rank = self.chunk, self.bucket.per_rank  # (per_rank + n,)
        return chunk.narrow(0, 0, per_rank), chunk.narrow(0, per_rank, len(self.bucket.params))

    def _divide(self, reduced: torch.Tensor) -> torch.Tensor:
        if self.divide_by != 1:
            reduced.div_(self.divide_by)  # not at all when the collective averaged
        return reduced

    def move_on(self) -> None:
        """Move the reduction on without blocking: start the HSDP all-reduce once its
        reduce-scatter is done (on the CPU); note whether all of it has completed."""
        self._complete = all(h.poll() for h in self.handles)  # in order, stopping at the first not done

    def done(self) -> bool:
        """Whether ``move_on`` found the reduction complete (asks the backend nothing)."""
        return self._complete

    def finish(self, keep: bool = True) -> None:
        """Wait for the reduction and give each parameter its rows as (part of) ``.grad``
        (``keep=False``: drop them, after an aborted step)."""
        for handle in self.handles:
            handle.wait()
        if not keep:
            return
        settings, bucket = self.settings, self.bucket
        if settings.keep_partial is not None:  # HSDP, all-reduce skipped: .grad waits for the next one
            settings.keep_partial((self.chunk, self.averaged_over))
            return
        reduced, counts = self._reduced()
        # Our own gradient implies a nonzero count, so we read the counts back (a device sync on
        # GPU) only when this rank lacks one.
        counts = counts.tolist() if self.missing else None
        # set_all_reduce_hook: the chunk as FSDP2's hook has it (core/reduction.py), so any
        # division that comes after the hook waits for it.
        divide_first = settings.hook is None or divides_in_collectives(bucket.dtype, settings.force_sum)
        if divide_first:
            reduced = self._divide(reduced)
        if settings.hook is not None:
            call_on(settings.hook[1], settings.hook[0], reduced)
        bucket.copy_out(reduced if divide_first else self._divide(reduced), counts, self.missing)


class OneRank(Reduction):
    """Over one rank: the copy-in is the reduced row (divided as the ops say), no collective,
    as FSDP2 (which calls no user's reduce-scatter there either)."""

    collective = False

    def _launch(self, send, op, async_op):
        return None, send.view(-1), send


class ReduceScatter(Reduction):
    """One reduce-scatter (NCCL and the like)."""

    def _launch(self, send, op, async_op):
        chunk = send.new_empty(self.bucket.per_rank + len(self.bucket.params))
        return _reduce_scatter_single(chunk, send.view(-1), op=op, group=self.comm.process_group, async_op=async_op), chunk, send


class AllToAllSum(Reduction):
    """gloo over one dim: an all-to-all (the bytes of a reduce-scatter), then the sum here."""

    via = "via all_to_all"

    def _launch(self, send, op, async_op):
        chunk = torch.empty_like(send)  # row r: rank r's rows for this rank
        return dist.all_to_all_single(chunk, send, group=self.comm.process_group, async_op=async_op), chunk, send

    def _reduced(self):
        chunk, per_rank = self.chunk, self.bucket.per_rank  # (world, per_rank + n)
        return chunk.narrow(1, 0, per_rank).sum(0), chunk.narrow(1, per_rank, len(self.bucket.params)).sum(0)


class AllReduceRow(Reduction):
    """gloo with HSDP or hooks: an all-reduce of the whole buffer; this rank keeps its row."""

    via = "via all_reduce"

    def _launch(self, send, op, async_op):
        work = dist.all_reduce(send, op=dist.ReduceOp.SUM, group=self.comm.process_group, async_op=async_op)
        return work, send[self.comm.rank], send  # (per_rank + n,)

    def _divide(self, reduced):
        return reduced / self.divide_by  # into a new tensor: .grad must not keep every rank's rows alive


class UserReduceScatter(Reduction):
    """``set_custom_reduce_scatter``: the user's buffers and collective."""

    def _launch(self, send, op, async_op):
        custom = self.settings.custom
        buffer = custom.allocate((send.numel(),), dtype=send.dtype, device=send.device)
        buffer.copy_(send.view(-1))
        chunk = custom.allocate((self.bucket.per_rank + len(self.bucket.params),), dtype=send.dtype, device=send.device)
        work = custom(output_tensor=chunk, input_tensor=buffer, group=self.comm.process_group, op=op, async_op=async_op)
        return work, chunk, buffer


def _reduce_ops(comm: Comm, how: ReduceSettings, dtype: torch.dtype) -> tuple[float, float, Any, Any]:
    """(divide before, divide after, the reduce-scatter's op, the HSDP all-reduce's op), as
    ``core/reduction.reduce_ops`` decides them. (A user's reduce-scatter is given the op; what
    an all-reduce hook sees: ``divides_in_collectives``.)"""
    replicate = None if how.replicate is None else (how.replicate.size(), how.replicate.averages)
    ops = reduce_ops(how.divide_by, dtype, how.force_sum, how.user_factor, (comm.size(), comm.averages), replicate)
    return ops.before, ops.after, _op(ops.shard_averages), _op(ops.replicate_averages)


def _op(averages: bool):
    return dist.ReduceOp.AVG if averages else dist.ReduceOp.SUM


def _op_name(op) -> str:
    return "avg" if op == dist.ReduceOp.AVG else "sum"


def _over_replicas(first: Handle, chunk: torch.Tensor, streams: Streams, name: str, how: ReduceSettings, op, averaged_over: int) -> Handle:
    """HSDP, once the reduce-scatter is done: add the sums kept from reductions without an
    all-reduce, then all-reduce the chunk over the replicas (unless it is kept instead)."""
    replicate = how.replicate if how.keep_partial is None else None
    world = replicate.size() if replicate is not None else 1
    traced = trace.record("all_reduce", name, dtype=chunk.dtype, numel=chunk.numel(), world=world, mesh_dim=replicate.mesh_dim, op=_op_name(op)) if replicate is not None else None

    def launch(async_op: bool):
        if how.partial is not None:  # in the units of this chunk (sums, or averages over the shard dim)
            partial, partial_over = how.partial
            chunk.add_(partial, alpha=partial_over / averaged_over)
        if replicate is None:
            return None, {}
        check.before(replicate.process_group, "all_reduce", name, chunk.dtype, chunk.numel(), world)
        work = dist.all_reduce(chunk, op=op, group=replicate.process_group, async_op=async_op)
        return work, {}

    inputs = {"buffer": chunk, "partial sums": how.partial[0] if how.partial is not None else None}
    return streams.issue(Collective("all_reduce", name, traced, replicate is not None and replicate.at_once), inputs, launch, after=first)

