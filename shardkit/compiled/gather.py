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
from shardkit.comm.collectives import _divide_factors
from shardkit.compiled.group import CompiledGroup
from shardkit.dtensor.sharded_param import ShardedParam


class _GatherGraphBucket(torch.autograd.Function):
    """Forward: cast to ``param_dtype`` and all-gather the flat shards. Backward: reduce-scatter
    the gradient in ``reduce_dtype`` (HSDP: then all-reduce it over the replicas), divided as
    eager mode divides it (``_divide_factors``: by ``divide_by``, fp16 partly before the sum),
    in the shards' dtype. HSDP without the all-reduce (``set_requires_all_reduce(False)``): the
    reduce-scattered sums go to the ``partial`` leaf's gradient instead, undivided, and the next
    backward with it adds them before its all-reduce, as eager mode."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, unreduced: torch.Tensor | None, partial: torch.Tensor | None, presence: torch.Tensor, group: CompiledGroup,
                param_dtype: torch.dtype, reduce_dtype: torch.dtype, settings: "Settings", traced: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``unreduced``: without ``settings.sync``, the leaf that keeps the unsharded gradient
        (``CompiledGroup.unreduced_leaf``); with it, what earlier backwards kept (added before the
        reduce-scatter), or None. ``partial`` the same for the all-reduce (``settings.all_reduce``,
        ``CompiledGroup.partial_leaf``). ``presence``: the leaf that gets the grad-presence
        counts (unused.py). ``traced``: run the trace ops here (False inside a nested compile
        region, which records its collectives outside: region.py). Returns the gathered rows
        and one zero mark per parameter."""
        ctx.group, ctx.reduce_dtype, ctx.dtype, ctx.settings, ctx.traced = group, reduce_dtype, flat.dtype, settings, traced
        ctx.save_for_backward(unreduced if settings.sync else None, partial if settings.all_reduce else None)  # (else: the leaves)
        shard = group.shard
        marks = presence.new_zeros(presence.shape)
        ctx.marks = marks.numel()
        send = flat.to(param_dtype)
        if shard.world == 1:  # nothing to gather (HSDP with one rank per replica), as eager mode
            return (send if send is not flat else send.clone()), marks
        _trace(traced, send, "all_gather", group.name, shard, False)
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(send, shard.world, shard.pg_name)
        gathered = torch.ops._c10d_functional.wait_tensor(gathered)  # (world * per_rank,)
        _trace(traced, gathered, "all_gather", group.name, shard, True)
        return gathered, marks

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, used: torch.Tensor) -> tuple:
        group, shard, replicate, settings = ctx.group, ctx.group.shard, ctx.group.replicate, ctx.settings
        nones = (None,) * 5
        # the grad-presence columns after each rank's rows, as eager mode: (world, per_rank + n)
        grad = torch.cat([grad.to(ctx.reduce_dtype).reshape(shard.world, -1), used.to(ctx.reduce_dtype).expand(shard.world, -1)], dim=1).view(-1)
        if not settings.sync:  # set_requires_gradient_sync(False): the unsharded gradient is kept, not reduced
            return None, grad, None, None, *nones
        unreduced, partial = ctx.saved_tensors
        pre, post = _divide_factors(settings.divide_by, ctx.reduce_dtype)
        if unreduced is not None:  # as eager mode: the kept sum, plus this backward's gradient
            grad = unreduced + grad
        if pre != 1:
            grad = grad / pre
        reduced = grad
        if shard.world > 1:
            _trace(ctx.traced, grad, "reduce_scatter", group.name, shard, False)
            reduced = _reduce_scatter(grad, shard)  # (per_rank + n,)
            _trace(ctx.traced, reduced, "reduce_scatter", group.name, shard, True)
        if group.all_reduces and not settings.all_reduce:  # kept for the next all-reduce
            return None, None, reduced, None, *nones
        if partial is not None:  # as eager mode: this backward's sums, plus those kept
            reduced = reduced + partial
        if group.all_reduces:
            _trace(ctx.traced, reduced, "all_reduce", group.name, replicate, False)
            reduced = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(reduced, "sum", replicate.pg_name))
            _trace(ctx.traced, reduced, "all_reduce", group.name, replicate, True)
        reduced = reduced / post
        rows, counts = reduced.split([reduced.numel() - ctx.marks, ctx.marks])
        return rows.to(ctx.dtype), None, None, counts, *nones


def _reduce_scatter(grad: torch.Tensor, shard: Any) -> torch.Tensor:
    """The summed rows of this rank. On gloo, whose reduce-scatter is slow, the bytes of one as
    an all-to-all (chunk r to rank r) and the sum of the received chunks here, as eager mode
    (docs/design.md, "On gloo, reduce-scatter is an all-to-all"): the same sum, in the same order."""
    if shard.gloo:
        splits = [grad.numel() // shard.world] * shard.world
        chunks = torch.ops._c10d_functional.all_to_all_single(grad, splits, splits, shard.pg_name)
        return torch.ops._c10d_functional.wait_tensor(chunks).view(shard.world, -1).sum(0)
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.reduce_scatter_tensor(grad, "sum", shard.world, shard.pg_name))


def _trace(traced: bool, x: torch.Tensor, kind: str, group: str, comm: Any, done: bool) -> None:
    if traced:
        torch.ops.shardkit.trace_collective(x, kind, group, comm.world, comm.mesh_dim, done)


# The trace (``shardkit.trace()``) sees compiled-mode collectives as eager mode's: an op that
# runs where the collective runs, compiled or not, before it (issued) and after its wait (done).
# Ordered effects keep the compiler from dropping or moving it.
_issued: dict[tuple[str, str], list] = {}  # (kind, group) -> its records issued, not yet done


@torch.library.custom_op("shardkit::trace_collective", mutates_args=())
def _trace_collective(x: torch.Tensor, kind: str, group: str, world: int, mesh_dim: str, done: bool, numel: int = -1, dtype: torch.dtype | None = None) -> None:
    """``x``: the collective's input (issued) or its output (done): its dtype and size, unless
    ``numel`` (the input's elements) and ``dtype`` say them (a region's trace, region.py)."""
    if not trace.is_recording():
        return
    queue = _issued.setdefault((kind, group), [])
    if not done:
        numel = x.numel() if numel < 0 else numel
        numel = numel * world if kind == "all_gather" else numel
        queue.append(trace.record(kind, group, dtype=x.dtype if dtype is None else dtype, numel=numel, world=world, mesh_dim=mesh_dim))
    elif queue:
        trace.done(queue.pop(0))


@_trace_collective.register_fake
def _(x: torch.Tensor, kind: str, group: str, world: int, mesh_dim: str, done: bool, numel: int = -1, dtype: torch.dtype | None = None) -> None:
    return None


_trace_collective.register_effect(EffectType.ORDERED)


def _recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Recompute the gather in backward; not the trace op, an ordered effect (which AOTAutograd
    refuses to recompute from torch 2.15 on, and never recomputed before: it has nothing to save)."""
    if op is torch.ops.shardkit.trace_collective.default or op is torch.ops.higher_order.with_effects:
        return CheckpointPolicy.PREFER_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


class Settings(NamedTuple):
    """What a group's gather reads of its settings (module.py), read once per forward (a tuple:
    a region call takes it as an argument, region.py)."""

    sync: bool  # set_requires_gradient_sync
    reshard: bool  # reshard after forward: backward gathers again
    divide_by: float
    all_reduce: bool  # set_requires_all_reduce (HSDP)

    @staticmethod
    def of(group: CompiledGroup) -> "Settings":
        reshard = group.reshard_after_forward if group.reshard_after_forward is not None else group.parent is not None
        return Settings(bool(group.requires_gradient_sync), bool(reshard), group.divide_by, bool(group.requires_all_reduce))

    def per_bucket(self, group: CompiledGroup) -> list["Settings"]:
        """Each bucket's: a bucket of weights tied to an earlier call's is reduced with that
        call's settings (sync, divide factor, all-reduce), as eager mode reduces them there."""
        return [self if b.owner is None else Settings.of(b.owner)._replace(reshard=self.reshard) for b in group.buckets]


def gather_inputs(group: CompiledGroup, settings: Settings) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor | None, ...]]:
    """The group's shards as the modules hold them now, and what ``_GatherGraphBucket`` takes as
    ``unreduced`` (per bucket), as ``partial`` (per bucket: the kept sums or the leaves), then
    as ``presence`` (per bucket)."""
    registered = [p.slots[0].module._parameters[p.slots[0].name] for p in group.params]  # what the modules hold now
    shards = tuple(param.to_local() for param in registered)
    buckets = list(enumerate(settings.per_bucket(group)))
    unreduced = tuple(group.take_unreduced(b) if s.sync else group.unreduced_leaf(b) for b, s in buckets)
    partial = tuple(None if not group.all_reduces or not s.sync else group.take_partial(b) if s.all_reduce else group.partial_leaf(b) for b, s in buckets)
    presence = tuple(group.presence_leaf(b) for b, _ in buckets)
    return shards, unreduced + partial + presence


def gather(group: CompiledGroup) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The group's unsharded parameters, from one all-gather per bucket (recomputed in backward
    when the group reshards after forward), and their marks (unused.py)."""
    settings = Settings.of(group)
    return gathered(group, settings, *gather_inputs(group, settings), traced=True)


def gathered(group: CompiledGroup, settings: Settings, shards: tuple, kept: tuple, traced: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``gather`` from its inputs (``kept``: ``gather_inputs``'s second); ``traced``: with the
    trace ops (see ``_GatherGraphBucket``)."""
    n = len(group.params)

    def run(*inputs: torch.Tensor | None) -> list[torch.Tensor]:
        b = len(group.buckets)
        shards, unreduced, partial, presence = inputs[:n], inputs[n : n + b], inputs[n + b : n + 2 * b], inputs[n + 2 * b :]
        unsharded: list[Any] = [None] * n
        marks = []  # per bucket
        for b, (bucket, s) in enumerate(zip(group.buckets, settings.per_bucket(group))):
            flat = torch.cat([_padded(shards[i], group.params[i]).reshape(-1) for i in bucket.indices])
            gathered, bucket_marks = _GatherGraphBucket.apply(flat, unreduced[b], partial[b], presence[b], group, bucket.param_dtype, bucket.reduce_dtype, s, traced)
            marks.append(bucket_marks)
            for i, column in zip(bucket.indices, gathered.view(group.shard.world, -1).split(bucket.numels, dim=1)):
                unsharded[i] = _unsharded(column, group.params[i])
        return unsharded + marks

    if settings.reshard and torch.is_grad_enabled():
        context = functools.partial(create_selective_checkpoint_contexts, _recompute)
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
    for bucket, bucket_marks in zip(group.buckets, out[n:]):
        for k, i in enumerate(bucket.indices):
            marks[i] = bucket_marks[k]
    return list(out[:n]), marks


def _padded(shard: torch.Tensor, p: ShardedParam) -> torch.Tensor:
    """This rank's rows followed by zero rows up to ``padded_rows`` (the all-gather's input)."""
    missing = p.padded_rows - shard.shape[0]
    return shard if missing == 0 else torch.cat([shard, shard.new_zeros(missing, *shard.shape[1:])])


def _unsharded(column: torch.Tensor, p: ShardedParam) -> torch.Tensor:
    """A parameter's column ``(world, shard_numel)`` of the all-gather output as the unsharded
    (TP-local) parameter; a DTensor with its TP placements again under tensor parallel."""
    full = column.reshape(p.layout.unsharded_padded_shape)[: p.shape[0]]
    if p.tp_spec is None:
        return full
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


