"""Compiled mode's gather: a group's shards all-gathered as ops of the graph, whose autograd
backward reduce-scatters the gradients, and the trace op that records them."""

from __future__ import annotations

import functools
from typing import Any

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
    in the shards' dtype."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, unreduced: torch.Tensor | None, group: CompiledGroup, param_dtype: torch.dtype, reduce_dtype: torch.dtype, divide_by: float, sync: bool) -> torch.Tensor:
        """``unreduced``: without ``sync``, the leaf that keeps the unsharded gradient
        (``CompiledGroup.unreduced``); with it, what earlier backwards kept (added before the
        reduce-scatter), or None."""
        ctx.group, ctx.reduce_dtype, ctx.dtype, ctx.divide_by, ctx.sync = group, reduce_dtype, flat.dtype, divide_by, sync
        ctx.save_for_backward(unreduced if sync else None)
        shard = group.shard
        send = flat.to(param_dtype)
        if shard.world == 1:  # nothing to gather (HSDP with one rank per replica), as eager mode
            return send if send is not flat else send.clone()
        torch.ops.shardkit.trace_collective(send, "all_gather", group.name, shard.world, shard.mesh_dim, False)
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(send, shard.world, shard.pg_name)
        gathered = torch.ops._c10d_functional.wait_tensor(gathered)  # (world * per_rank,)
        torch.ops.shardkit.trace_collective(gathered, "all_gather", group.name, shard.world, shard.mesh_dim, True)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        group, shard, replicate = ctx.group, ctx.group.shard, ctx.group.replicate
        if not ctx.sync:  # set_requires_gradient_sync(False): the unsharded gradient is kept, not reduced
            return None, grad.to(ctx.reduce_dtype), None, None, None, None, None
        (unreduced,) = ctx.saved_tensors
        pre, post = _divide_factors(ctx.divide_by, ctx.reduce_dtype)
        grad = grad.to(ctx.reduce_dtype).contiguous()
        if unreduced is not None:  # as eager mode: the kept sum, plus this backward's gradient
            grad = unreduced + grad
        if pre != 1:
            grad = grad / pre
        reduced = grad
        if shard.world > 1:
            torch.ops.shardkit.trace_collective(grad, "reduce_scatter", group.name, shard.world, shard.mesh_dim, False)
            reduced = torch.ops._c10d_functional.reduce_scatter_tensor(grad, "sum", shard.world, shard.pg_name)
            reduced = torch.ops._c10d_functional.wait_tensor(reduced)  # (per_rank,)
            torch.ops.shardkit.trace_collective(reduced, "reduce_scatter", group.name, shard.world, shard.mesh_dim, True)
        if replicate is not None and replicate.world > 1:
            torch.ops.shardkit.trace_collective(reduced, "all_reduce", group.name, replicate.world, replicate.mesh_dim, False)
            reduced = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(reduced, "sum", replicate.pg_name))
            torch.ops.shardkit.trace_collective(reduced, "all_reduce", group.name, replicate.world, replicate.mesh_dim, True)
        return (reduced / post).to(ctx.dtype), None, None, None, None, None, None


# The trace (``shardkit.trace()``) sees compiled-mode collectives as eager mode's: an op that
# runs where the collective runs, compiled or not, before it (issued) and after its wait (done).
# Ordered effects keep the compiler from dropping or moving it.
_issued: dict[tuple[str, str], list] = {}  # (kind, group) -> its records issued, not yet done


@torch.library.custom_op("shardkit::trace_collective", mutates_args=())
def _trace_collective(x: torch.Tensor, kind: str, group: str, world: int, mesh_dim: str, done: bool) -> None:
    """``x``: the collective's input (issued) or its output (done): its dtype and size."""
    if not trace.is_recording():
        return
    queue = _issued.setdefault((kind, group), [])
    if not done:
        numel = x.numel() * world if kind == "all_gather" else x.numel()
        queue.append(trace.record(kind, group, dtype=x.dtype, numel=numel, world=world, mesh_dim=mesh_dim))
    elif queue:
        trace.done(queue.pop(0))


@_trace_collective.register_fake
def _(x: torch.Tensor, kind: str, group: str, world: int, mesh_dim: str, done: bool) -> None:
    return None


_trace_collective.register_effect(EffectType.ORDERED)


def _recompute(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Recompute the gather in backward; not the trace op, an ordered effect (which AOTAutograd
    refuses to recompute from torch 2.15 on, and never recomputed before: it has nothing to save)."""
    if op is torch.ops.shardkit.trace_collective.default or op is torch.ops.higher_order.with_effects:
        return CheckpointPolicy.PREFER_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


def gather(group: CompiledGroup) -> list[torch.Tensor]:
    """The group's unsharded parameters, from one all-gather per bucket (recomputed in backward
    when the group reshards after forward)."""
    registered = [p.slots[0].module._parameters[p.slots[0].name] for p in group.params]  # what the modules hold now
    shards = [param.to_local() for param in registered]

    sync = group.requires_gradient_sync
    unreduced = [group.take_unreduced(b) if sync else group.unreduced_leaf(b) for b in range(len(group.buckets))]

    def run(*inputs: torch.Tensor | None) -> list[torch.Tensor]:
        shards, unreduced = inputs[: len(group.params)], inputs[len(group.params) :]
        unsharded: list[Any] = [None] * len(shards)
        for b, bucket in enumerate(group.buckets):
            flat = torch.cat([_padded(shards[i], group.params[i]).reshape(-1) for i in bucket.indices])
            gathered = _GatherGraphBucket.apply(flat, unreduced[b], group, bucket.param_dtype, bucket.reduce_dtype, group.divide_by, sync)
            for i, column in zip(bucket.indices, gathered.view(group.shard.world, -1).split(bucket.numels, dim=1)):
                unsharded[i] = _unsharded(column, group.params[i])
        return unsharded

    reshard = group.reshard_after_forward if group.reshard_after_forward is not None else group.parent is not None
    if reshard and torch.is_grad_enabled():
        context = functools.partial(create_selective_checkpoint_contexts, _recompute)
        return checkpoint(run, *shards, *unreduced, use_reentrant=False, context_fn=context)
    return run(*shards, *unreduced)


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


