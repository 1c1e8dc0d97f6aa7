"""Compiled mode's gather: a group's shards all-gathered as ops of the graph, whose autograd
backward reduce-scatters the gradients, and the trace op that records them."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Partial
from torch._library.effects import EffectType
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardkit.comm import trace
from shardkit.compiled.group import CompiledGroup, Copy, GraphBucket, by_uid
from shardkit.core.reduction import ReduceOps, reduce_ops
from shardkit.dtensor import extension
from shardkit.dtensor.sharded_param import ShardedParam


class _GatherGraphBucket(torch.autograd.Function):
    """Forward: cast to ``param_dtype`` and all-gather the flat shards. Backward: reduce-scatter
    the gradient in ``reduce_dtype`` (HSDP: then all-reduce it over the replicas), with the ops
    and divisions eager mode uses (core/reduction.py's ``reduce_ops``: AVG where the backend
    averages, else SUM and ``divide_by``, fp16 partly before the sum), in the shards' dtype.
    HSDP without the all-reduce (``set_requires_all_reduce(False)``): the reduce-scattered rows
    go to the ``partial`` leaf's gradient instead, as sums (times the shard ranks where the
    reduce-scatter averaged), and the next backward with it adds them before its all-reduce, in
    its own rows' units, as eager mode. Frozen parameters next to trainable ones
    (``trains``: per parameter, or None where all train) are cut out of the reductions, as eager
    mode reduces the trainable ones only (``Bucket.subset``)."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, unreduced: torch.Tensor | None, partial: torch.Tensor | None, presence: torch.Tensor, reuse: torch.Tensor | None,
                keep: torch.Tensor | None, group: CompiledGroup, bucket: GraphBucket, settings: "Settings", traced: bool,
                trains: tuple[bool, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``unreduced``: without ``settings.sync``, the leaf that keeps the unsharded gradient
        (``CompiledGroup.unreduced_leaf``); with it, what earlier backwards kept (added before the
        reduce-scatter), or None. ``partial`` the same for the all-reduce (``settings.all_reduce``,
        ``CompiledGroup.partial_leaf``). ``presence``: the leaf that gets the grad-presence
        counts (unused.py). ``reuse``: the all-gather output a backward kept
        (``set_reshard_after_backward(False)``), used instead of all-gathering; ``keep``: with
        ``settings.keep``, the leaf whose gradient gets this one (``CompiledGroup.kept_leaf``).
        ``traced``: run the trace ops here (False inside a nested compile region, which records
        its collectives outside: region.py). Returns the gathered rows and one zero mark per
        parameter. A carrier bucket (its group gathers apart: ``_gathered_apart``) gathers
        nothing here: its rows are zeros that only carry the gradient (no memory)."""
        ctx.group, ctx.reduce_dtype, ctx.dtype, ctx.settings, ctx.traced = group, bucket.reduce_dtype, flat.dtype, settings, traced
        marks = presence.new_zeros(presence.shape)
        ctx.marks = marks.numel()
        ctx.cut = None if trains is None else Cut(bucket.numels, trains)
        if bucket.carrier:
            gathered = flat.new_zeros((), dtype=bucket.param_dtype).expand(flat.numel() * group.shard_comm.world)
        else:
            gathered = reuse.view_as(reuse) if reuse is not None else _gathered_rows(flat.to(bucket.param_dtype), flat, group, settings, traced)
        # (else: the leaves); the gathered rows, recomputed in backward when the group reshards after forward
        ctx.save_for_backward(unreduced if settings.sync else None, partial if settings.all_reduce else None, gathered if settings.keep else None)
        return gathered, marks

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, used: torch.Tensor) -> tuple:
        """The gradients of (flat, unreduced, partial, presence), then None for ``reuse``, the
        gathered rows for ``keep`` (``settings.keep``), and None for the rest."""
        unreduced, partial, gathered = ctx.saved_tensors
        return (*_reduced(ctx, grad, used, unreduced, partial), None, gathered) + (None,) * 5


class Cut(NamedTuple):
    """A bucket's reduction without its frozen parameters: their rows and grad-presence counts
    left out of the collectives, zeros in their place after."""

    numels: list[int]  # per parameter, its rows per rank
    trains: tuple[bool, ...]  # per parameter

    def out(self, x: torch.Tensor, ranks: int) -> torch.Tensor:
        """``x`` (``ranks`` rows of (rows..., counts)) without the frozen parameters' parts, flat."""
        rows = x.view(ranks, -1)
        *blocks, counts = rows.split([*self.numels, len(self.numels)], dim=1)
        keep = [k for k, t in enumerate(self.trains) if t]
        return torch.cat([*(blocks[k] for k in keep), counts[:, keep]], dim=1).reshape(-1)

    def back(self, x: torch.Tensor) -> torch.Tensor:
        """``out``'s inverse on one rank's part: zeros for the frozen parameters' rows and counts."""
        kept = [n for n, t in zip(self.numels, self.trains) if t]
        *blocks, counts = x.split([*kept, len(kept)])
        blocks, counts = iter(blocks), iter(counts.split(1))
        rows = [next(blocks) if t else x.new_zeros(n) for n, t in zip(self.numels, self.trains)]
        return torch.cat([*rows, *(next(counts) if t else x.new_zeros(1) for t in self.trains)])


def _reduced(ctx: Any, grad: torch.Tensor, used: torch.Tensor, unreduced: torch.Tensor | None, partial: torch.Tensor | None) -> tuple:
    """``_GatherGraphBucket``'s gradients of (flat, unreduced, partial, presence)."""
    group, shard, replicate, settings = ctx.group, ctx.group.shard_comm, ctx.group.replicate_comm, ctx.settings
    # the grad-presence columns after each rank's rows, as eager mode: (world, per_rank + n)
    grad = torch.cat([grad.to(ctx.reduce_dtype).reshape(shard.world, -1), used.to(ctx.reduce_dtype).expand(shard.world, -1)], dim=1).view(-1)
    if not settings.sync:  # set_requires_gradient_sync(False): the unsharded gradient is kept, not reduced
        return None, grad, None, None
    ops = reduction_ops(group, settings, ctx.reduce_dtype)
    shard_op, replicate_op = "avg" if ops.shard_averages else "sum", "avg" if ops.replicate_averages else "sum"
    if unreduced is not None:  # as eager mode: the kept sum, plus this backward's gradient
        grad = unreduced + grad
    cut = ctx.cut
    if cut is not None:
        grad = cut.out(grad, shard.world)
    if ops.before != 1:
        grad = grad / ops.before
    reduced = grad
    if shard.world > 1:
        _trace(ctx.traced, grad, "reduce_scatter", group.name, shard, False, shard_op)
        reduced = _reduce_scatter(grad, shard, shard_op)  # (per_rank + n,)
        _trace(ctx.traced, reduced, "reduce_scatter", group.name, shard, True)
    if group.hsdp and not settings.all_reduce:  # kept for the next all-reduce, as sums (their ops may differ)
        kept = reduced * shard.world if ops.shard_averages else reduced
        return None, None, kept if cut is None else cut.back(kept), None
    if partial is not None:  # as eager mode: this backward's rows, plus the sums kept, in the rows' units
        partial = partial if cut is None else cut.out(partial, 1)
        reduced = reduced + (partial / shard.world if ops.shard_averages else partial)
    if group.all_reduces:
        _trace(ctx.traced, reduced, "all_reduce", group.name, replicate, False, replicate_op)
        reduced = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(reduced, replicate_op, replicate.pg_name))
        _trace(ctx.traced, reduced, "all_reduce", group.name, replicate, True)
    if ops.after != 1:
        reduced = reduced / ops.after
    if cut is not None:
        reduced = cut.back(reduced)
    rows, counts = reduced.split([reduced.numel() - ctx.marks, ctx.marks])
    return rows.to(ctx.dtype), None, None, counts


def reduction_ops(group: CompiledGroup, settings: "Settings", reduce_dtype: torch.dtype) -> ReduceOps:
    """The ops and divisions of the group's reduction (core/reduction.py's rule, as eager mode's)."""
    shard, replicate = group.shard_comm, group.replicate_comm
    over_replicas = (replicate.world, replicate.averages) if group.hsdp else None
    return reduce_ops(settings.divide_by, reduce_dtype, settings.force_sum, settings.user_factor, (shard.world, shard.averages), over_replicas)


def _gathered_rows(send: torch.Tensor, flat: torch.Tensor, group: CompiledGroup, settings: "Settings", traced: bool) -> torch.Tensor:
    """Every rank's ``send`` (``flat`` in param_dtype), rank after rank: ``(world * per_rank,)``."""
    shard = group.shard_comm
    if shard.world == 1:  # nothing to gather (HSDP with one rank per replica), as eager mode
        return send if send is not flat else send.clone()
    if not settings.post_forward:
        return _all_gather(send, group.name, shard, traced)
    # reshard_after_forward=R: first from the ranks equal to this one modulo R, what this
    # rank keeps after forward (the checkpoint saves it: _Recompute), then from R consecutive
    # ranks, as backward gathers it again; the same bytes arrive as in one all-gather.
    across, within = group.post_forward.across, group.post_forward.within
    kept = _all_gather(send, group.name, across, traced)  # (world / R * per_rank,): ranks i, R + i, 2R + i, ...
    gathered = _all_gather(kept, group.name, within, traced)  # (R, world / R, per_rank): rank j + R * g at [j, g]
    return gathered.view(within.world, across.world, -1).transpose(0, 1).reshape(-1)  # (world * per_rank,), rank-major


def _all_gather(send: torch.Tensor, name: str, comm: Any, traced: bool) -> torch.Tensor:
    _trace(traced, send, "all_gather", name, comm, False)
    gathered = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(send, comm.world, comm.pg_name))
    _trace(traced, gathered, "all_gather", name, comm, True)
    return gathered


def _reduce_scatter(grad: torch.Tensor, shard: Any, op: str) -> torch.Tensor:
    """The summed rows of this rank. On gloo, whose reduce-scatter is slow, the bytes of one as
    an all-to-all (chunk r to rank r) and the sum of the received chunks here, as eager mode
    (docs/design.md, "On gloo, reduce-scatter is an all-to-all"): the same sum, in the same order.
    A complex gradient goes as its real view (gloo's all-to-all takes no complex dtype)."""
    if grad.is_complex():
        return torch.view_as_complex(_reduce_scatter(torch.view_as_real(grad).reshape(-1), shard, op).view(-1, 2))
    if shard.gloo:  # (gloo never averages: op is "sum")
        splits = [grad.numel() // shard.world] * shard.world
        chunks = torch.ops._c10d_functional.all_to_all_single(grad, splits, splits, shard.pg_name)
        return torch.ops._c10d_functional.wait_tensor(chunks).view(shard.world, -1).sum(0)
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.reduce_scatter_tensor(grad, op, shard.world, shard.pg_name))


def _trace(traced: bool, x: torch.Tensor, kind: str, group: str, comm: Any, done: bool, op: str = "") -> None:
    if traced:
        torch.ops.shardkit.trace_collective(x, kind, group, comm.world, comm.mesh_dim, done, op=op)


# The trace (``shardkit.trace()``) sees compiled-mode collectives as eager mode's: an op that
# runs where the collective runs, compiled or not, before it (issued) and after its wait (done).
# Ordered effects keep the compiler from dropping or moving it.
_issued: dict[tuple[str, str], list] = {}  # (kind, group) -> its records issued, not yet done


@torch.library.custom_op("shardkit::trace_collective", mutates_args=())
def _trace_collective(x: torch.Tensor, kind: str, group: str, world: int, mesh_dim: str, done: bool, numel: int = -1, dtype: torch.dtype | None = None,
                      op: str = "") -> None:
    """``x``: the collective's input (issued) or its output (done): its dtype and size, unless
    ``numel`` (the input's elements) and ``dtype`` say them (a region's trace, region.py);
    ``op``: a reduction's ("sum", "avg"), as eager mode's trace has it."""
    if not trace.is_recording():
        return
    queue = _issued.setdefault((kind, group), [])
    if not done:
        numel = x.numel() if numel < 0 else numel
        numel = numel * world if kind == "all_gather" else numel
        queue.append(trace.record(kind, group, dtype=x.dtype if dtype is None else dtype, numel=numel, world=world, mesh_dim=mesh_dim, op=op))
    elif queue:
        trace.done(queue.pop(0))


@_trace_collective.register_fake
def _(x: torch.Tensor, kind: str, group: str, world: int, mesh_dim: str, done: bool, numel: int = -1, dtype: torch.dtype | None = None,
      op: str = "") -> None:
    return None


_trace_collective.register_effect(EffectType.ORDERED)


class _Recompute:
    """The selective checkpoint's policy: recompute the gather in backward, but not the trace
    op, an ordered effect (which AOTAutograd refuses to recompute from torch 2.15 on, and never
    recomputed before: it has nothing to save), and not the first all-gather of
    ``reshard_after_forward=R`` (``across``'s): its waited output, 1/R of the group, is what
    forward keeps, and backward gathers only ``within``. One per checkpoint call: the ops come
    in program order, each all-gather right before its wait."""

    def __init__(self, kept: str | None) -> None:
        self.kept = kept  # the process group whose all-gather forward keeps, if any
        self.waits_to_keep = 0

    @staticmethod
    def contexts(kept: str | None) -> tuple:
        """The checkpoint's ``context_fn`` (a partial of this with a constant: dynamo's rule)."""
        return create_selective_checkpoint_contexts(_Recompute(kept))

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op is torch.ops.shardkit.trace_collective.default or op is torch.ops.higher_order.with_effects:
            return CheckpointPolicy.PREFER_SAVE
        if op is torch.ops._c10d_functional.all_gather_into_tensor.default and args[2] == self.kept:
            self.waits_to_keep += 1
            return CheckpointPolicy.MUST_SAVE  # (what it keeps is its wait's output; eager: not run again)
        if op is torch.ops._c10d_functional.wait_tensor.default and self.waits_to_keep:
            self.waits_to_keep -= 1
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.MUST_RECOMPUTE


def _keep_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The selective checkpoint's policy of a group that does not reshard after forward: save
    every op of the gather. Alone it changes nothing (AOTAutograd's partitioner saves the
    gathered parameters either way); inside the user's checkpoint around the block, whose policy
    recomputes everything, it keeps backward from all-gathering the group again."""
    return CheckpointPolicy.MUST_SAVE


def _keep_all_contexts() -> tuple:
    return create_selective_checkpoint_contexts(_keep_all)


class Settings(NamedTuple):
    """What a group's gather reads of its settings (module.py), read once per forward (a tuple:
    a region call takes it as an argument, region.py)."""

    sync: bool  # set_requires_gradient_sync
    reshard: bool  # reshard after forward: backward gathers again
    divide_by: float
    user_factor: bool  # divide_by is set_gradient_divide_factor's
    force_sum: bool  # set_force_sum_reduction_for_comms
    all_reduce: bool  # set_requires_all_reduce (HSDP)
    post_forward: bool  # reshard_after_forward=R (with grad): gather in two steps, keep 1/R
    keep: bool  # set_reshard_after_backward(False) (with grad): backward keeps the gathered rows

    @staticmethod
    def of(group: CompiledGroup) -> "Settings":
        options = group.options
        reshard = options.reshard_after_forward if options.reshard_after_forward is not None else not group.is_root
        grad = torch.is_grad_enabled()
        post_forward = bool(reshard) and group.two_step and grad
        keep = not options.reshard_after_backward and grad
        return Settings(bool(options.requires_gradient_sync), bool(reshard), group.divide_by, options.gradient_divide_factor is not None,
                        bool(options.force_sum_reduction), bool(options.requires_all_reduce), post_forward, keep)

    def per_bucket(self, group: CompiledGroup) -> list["Settings"]:
        """Each bucket's: a bucket of weights tied to an earlier call's is reduced with that
        call's settings (sync, divide factor, all-reduce), as eager mode reduces them there; a
        carrier bucket keeps nothing after backward (its group gathers again)."""
        own = (self if b.owner is None else Settings.of(b.owner)._replace(reshard=self.reshard, post_forward=self.post_forward, keep=self.keep) for b in group.buckets)
        return [s._replace(keep=s.keep and not b.carrier) for s, b in zip(own, group.buckets)]


KEPT = ("unreduced", "partial", "presence", "reuse", "keep")  # gather_inputs's second, per bucket each, in this order


def gather_inputs(group: CompiledGroup, settings: Settings) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
    """The group's shards as the modules hold them now (their leaves: ``CompiledGroup.inputs``), and what ``_GatherGraphBucket`` takes as
    ``unreduced`` (per bucket), as ``partial`` (per bucket: the kept sums or the leaves), as
    ``presence``, as ``reuse`` and as ``keep`` (per bucket each)."""
    shards = group.inputs()
    buckets = list(enumerate(settings.per_bucket(group)))
    unreduced = tuple(group.take_unreduced(b) if s.sync else group.unreduced_leaf(b) for b, s in buckets)
    partial = tuple(None if not group.hsdp or not s.sync else group.take_partial(b) if s.all_reduce else group.partial_leaf(b) for b, s in buckets)
    presence = tuple(group.presence_leaf(b) for b, _ in buckets)
    reuse = tuple(group.kept(b, take=torch.is_grad_enabled()) for b, _ in buckets)  # (None where nothing was kept)
    keep = tuple(group.kept_leaf(b) if s.keep else None for b, s in buckets)
    return shards, unreduced + partial + presence + reuse + keep


def reused(group: CompiledGroup, kept: tuple) -> list[bool]:
    """Per bucket, whether ``gather_inputs``'s ``kept`` hands it a ``reuse`` (no all-gather)."""
    n = len(group.buckets)
    i = KEPT.index("reuse")
    return [r is not None for r in kept[i * n : (i + 1) * n]]


def gather(group: CompiledGroup, call: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The group's unsharded parameters, from one all-gather per bucket (recomputed in backward
    when the group reshards after forward), and their marks (unused.py)."""
    settings = Settings.of(group)
    return gathered(group, settings, *gather_inputs(group, settings), traced=True, call=call)


def gathered(group: CompiledGroup, settings: Settings, shards: tuple, kept: tuple, traced: bool, call: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``gather`` from its inputs (``kept``: ``gather_inputs``'s second); ``traced``: with the
    trace ops (see ``_GatherGraphBucket``)."""
    n = len(group.params)
    buckets = group.buckets
    per_bucket = settings.per_bucket(group)

    def run(*inputs: torch.Tensor | None) -> list[torch.Tensor]:
        b = len(buckets)
        shards = inputs[:n]
        unreduced, partial, presence, reuse, keep = (inputs[n + k * b : n + (k + 1) * b] for k in range(len(KEPT)))  # per bucket each
        unsharded: list[Any] = [None] * n
        marks: list[Any] = [None] * len(buckets)  # per bucket
        # Gathering apart, the buckets' autograd functions only reduce: made last to first, as
        # autograd runs the latest first, so that they reduce-scatter in eager mode's order
        order = range(len(buckets)) if not group.gathers_apart else reversed(range(len(buckets)))
        for b in order:
            bucket, copies = buckets[b], _copies(buckets[b])
            *params, marks[b] = _bucket_gathered(group.uid, b, tuple(per_bucket[b]), traced, call, unreduced[b], partial[b], presence[b], reuse[b], keep[b],
                                                 *(shards[c.index] for c in copies))
            for c, param in zip(copies, params):
                unsharded[c.index] = param
        if group.gathers_apart:
            _attach(group, _gathered_apart(group, settings, shards, traced), shards, unsharded, marks)
        for bucket in buckets:
            for c in _copies(bucket):
                if c.tp:
                    unsharded[c.index] = _with_tp(unsharded[c.index], group.params[c.index])
        return unsharded + marks

    if torch.is_grad_enabled() and (settings.reshard or torch.compiler.is_compiling()):
        # resharding: a selective checkpoint that recomputes the gather in backward; not, in a
        # graph: one that keeps all of it, so that the user's own checkpoint around the block does
        # not recompute it either (eager mode's backward uses the parameters it kept: no
        # all-gather). Run without torch.compile, that one would only cost time every step.
        kept_pg = group.post_forward.across.pg_name if settings.post_forward else None
        context = functools.partial(_Recompute.contexts, kept_pg) if settings.reshard else _keep_all_contexts
        out = checkpoint(run, *shards, *kept, use_reentrant=False, context_fn=context)
        # Dynamo (torch 2.13, 2.14) drops a checkpoint's unused outputs (a parameter the forward
        # does not read) after tracing, and in a region called more than once it renumbers them
        # once per call and fails ("Expected unused getitem node ... to have no users"). A dead
        # use of each keeps them until AOTAutograd's own dead-code pass drops them.
        for t in out:
            t.view_as(t)
    else:
        out = run(*shards, *kept)
    marks: list[Any] = [None] * n
    for bucket, bucket_marks in zip(buckets, out[n:]):
        for c, mark in zip(_copies(bucket), bucket_marks.unbind()):  # (one op; its backward one stack)
            marks[c.index] = mark
    return list(out[:n]), marks


@torch._dynamo.allow_in_graph
def _bucket_gathered(uid: str, b: int, settings: tuple, traced: bool, call: int, unreduced: torch.Tensor | None, partial: torch.Tensor | None, presence: torch.Tensor,
                     reuse: torch.Tensor | None, keep: torch.Tensor | None, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Bucket ``b`` of group ``uid`` all-gathered (``_GatherGraphBucket``) from its parameters'
    ``shards``: each parameter unsharded (TP-local, not yet a DTensor), then the bucket's marks.
    One op to dynamo, which runs it once on fake tensors instead of tracing it line by line
    (AOTAutograd traces through it): fewer dynamo steps, so a shorter first compiled step. A region's body, traced for the first block of its
    key, names that block's group: the other blocks of the key have its layout, so the same ops."""
    group = by_uid(uid)
    bucket = group.buckets[b]
    if call and group.params[bucket.copies[0].index].extension is None:  # (compiled._gatherer: the same view of the first shard, in ops of its own)
        shards = (shards[0][: shards[0].shape[0] + call], *shards[1:])
    # (a bucket that carries the gradients of several dtypes: each shard's in the bucket's, reduce_dtype)
    flat = torch.cat([_padded(shard, c.padded_rows).to(bucket.dtype) for shard, c in zip(shards, bucket.copies)])
    trains = tuple(shard.requires_grad for shard in shards)  # (a frozen parameter's leaf comes detached: CompiledGroup.inputs)
    trains = None if all(trains) or not any(trains) else trains
    gathered, marks = _GatherGraphBucket.apply(flat, unreduced, partial, presence, reuse, keep, group, bucket, Settings(*settings), traced, trains)
    rows = gathered.view(group.shard_comm.world, -1)
    # each parameter's column (world, shard_numel), copied out contiguous in one op (no copy for one parameter)
    columns = torch.split_with_sizes_copy(rows, bucket.numels, dim=1) if len(shards) > 1 else (rows,)
    # a frozen parameter, as eager mode's, takes no gradient: its module computes none
    params = (_unsharded(column if trains is None or trains[k] else column.detach(), c) for k, (c, column) in enumerate(zip(bucket.copies, columns)))
    return (*params, marks)


@torch.compiler.assume_constant_result
def _copies(bucket: GraphBucket) -> tuple[Copy, ...]:
    """``bucket.copies``, a constant to dynamo (no guard on each field it reads: they never change)."""
    return bucket.copies


def _gathered_apart(group: CompiledGroup, settings: Settings, shards: tuple, traced: bool) -> dict[int, torch.Tensor]:
    """The unsharded form of each parameter of a group that gathers apart, by index, from ONE
    all-gather (two with ``reshard_after_forward=R``: ``_gathered_rows``), as eager mode's: each
    parameter's padded shard in its param dtype, or, for one that all-gathers itself
    (dtensor/extension.py), its ``fsdp_pre_all_gather`` inputs, end to end, as bytes where the
    dtypes differ; then ``fsdp_post_all_gather`` on each such parameter's outputs (rank-major),
    the others' columns viewed back. No autograd here: ``_Attach`` carries the gradients."""
    world = group.shard_comm.world
    copies = sorted((c for b in group.buckets if b.carrier for c in _copies(b)), key=lambda c: c.index)
    with torch.no_grad():
        sent = [_send(group, c.index, shards[c.index]) for c in copies]  # (inputs, metadata) per parameter
        inputs = [t.contiguous() for ins, _ in sent for t in ins]
        as_bytes = len({t.dtype for t in inputs}) > 1
        send = torch.cat([t.view(-1).view(torch.uint8) if as_bytes else t.view(-1) for t in inputs])  # this rank's
        received = _gathered_rows(send, None, group, settings, traced)
        sizes = [t.numel() * t.element_size() if as_bytes else t.numel() for t in inputs]
        columns = iter(received.view(world, -1).split(sizes, dim=1))
        built = {}
        for c, (ins, metadata) in zip(copies, sent):
            i, p = c.index, group.params[c.index]
            if p.extension is None:
                built[i] = _unsharded(_as(next(columns), p.param_dtype, as_bytes), c)  # (world, shard_numel) -> the parameter
                continue
            outputs = tuple(_as(next(columns), t.dtype, as_bytes).view(-1, *t.shape[1:]) for t in ins)  # (world * rows, ...)
            tensor, _ = shards[i].fsdp_post_all_gather(outputs, metadata, p.param_dtype)
            built[i] = tensor if tensor.shape == p.shape else tensor[: p.shape[0]]
    return built


def _as(column: torch.Tensor, dtype: torch.dtype, as_bytes: bool) -> torch.Tensor:
    """A piece's column ``(world, size)`` of the all-gather output, copied out flat in its own
    dtype (a copy: a view of bytes as a wider dtype needs an aligned offset)."""
    return column.clone(memory_format=torch.contiguous_format).view(-1).view(dtype) if as_bytes else column.contiguous()


def _attach(group: CompiledGroup, built: dict[int, torch.Tensor], shards: tuple, unsharded: list, marks: list) -> None:
    """What ``_gathered_apart`` built, in ``unsharded`` in place of the carriers' columns, with
    their gradients going to the carriers (``_Attach``); a frozen parameter's takes none, as
    eager mode's."""
    for bucket, bucket_marks in zip(group.buckets, marks):
        for c, mark in zip(_copies(bucket), bucket_marks.unbind()):
            if not shards[c.index].requires_grad:
                unsharded[c.index] = built[c.index]
                continue
            hooked = group.params[c.index].extension is not None  # (the others are marked where read: unused.reading)
            unsharded[c.index] = _Attach.apply(unsharded[c.index], mark if hooked else None, built[c.index])


def _send(group: CompiledGroup, i: int, shard: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
    """What parameter ``i`` sends when its group gathers apart: its hook's inputs and metadata, or its padded shard in param dtype."""
    p = group.params[i]
    if p.extension is None:
        return [_padded(shard, p.layout.padded_rows).to(p.param_dtype)], None
    return extension.pre_all_gather(shard, group.extension_mesh, p.shape, p.slots[0].module, group.mp_policy, f"parameter '{p.fqn}'", group.hook_arity[i])


class _Attach(torch.autograd.Function):
    """A parameter its group gathered apart (``built``) as what autograd sees: its gradient goes
    to ``carrier``, the parameter's column of its bucket's rows (reduce-scattered as any other),
    and, for a parameter that all-gathers itself, a one to its ``mark`` (it was used:
    unused.py; the others' marks are given where the forward reads them, ``unused.reading``)."""

    @staticmethod
    def forward(ctx: Any, carrier: torch.Tensor, mark: torch.Tensor | None, built: torch.Tensor) -> torch.Tensor:
        ctx.mark = None if mark is None else (mark.dtype, mark.device)
        return built

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None if ctx.mark is None else torch.ones((), dtype=ctx.mark[0], device=ctx.mark[1]), None


def _padded(shard: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """This rank's rows followed by zero rows up to ``padded_rows``, flat (the all-gather's input)."""
    missing = padded_rows - shard.shape[0]
    return shard.reshape(-1) if missing == 0 else torch.cat([shard, shard.new_zeros(missing, *shard.shape[1:])]).reshape(-1)


def _unsharded(column: torch.Tensor, copy: Copy) -> torch.Tensor:
    """A parameter's column ``(world, shard_numel)`` of the all-gather output as the unsharded
    (TP-local) parameter: its padded shape, the padding rows cut (none cut where there are none:
    a slice of every row would cost a copy in backward)."""
    full = column.view(copy.shape)
    return full[: copy.keep] if copy.keep >= 0 else full


def _with_tp(full: torch.Tensor, p: ShardedParam) -> DTensor:
    """Under tensor parallel, the TP-local unsharded parameter as a DTensor with its TP placements again."""
    spec = p.tp_spec
    # On a full SPMD mesh (dp_mesh_dims) the gradient keeps a Partial on the data-parallel dims
    # as this rank's part of the sum the reduce-scatter adds up (as eager mode); from_local's
    # backward would otherwise all-reduce it over dp first, and the sum would be taken twice.
    grads = tuple(Partial() if i in p.dp_dims else placement for i, placement in enumerate(spec.placements))
    param = DTensor.from_local(full, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride, grad_placements=grads)
    return _GradSummedInReduceDtype.apply(param, p.reduce_dtype) if p.reduce_dtype != full.dtype else param


class _GradSummedInReduceDtype(torch.autograd.Function):
    """The identity; in backward, a tensor-parallel ``Partial`` gradient is summed over tp in
    ``reduce_dtype`` (``from_local``'s backward would sum it in ``param_dtype``), then rounded
    to ``param_dtype`` once, on its way to the group's reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, param: DTensor, reduce_dtype: torch.dtype) -> DTensor:
        ctx.reduce_dtype, ctx.mesh, ctx.placements = reduce_dtype, param.device_mesh, param.placements
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple:
        if grad.placements != ctx.placements:
            grad = grad.to(ctx.reduce_dtype).redistribute(ctx.mesh, ctx.placements).to(grad.dtype)
        return grad, None


