"""Compiled mode: FSDP as ops of the model's own graph, for ``torch.compile``.

    from shardkit.compiled import fully_shard   # instead of: from shardkit import fully_shard

The same calls (``fully_shard`` on each block, then on the root) and the same sharded
parameters: each is an ``nn.Parameter`` holding the same ``Shard(0)`` DTensor as in eager mode,
so the optimizer, ``state_dict()`` and ``shardkit.checkpoint`` files are the eager mode's. What
differs is how the parameters are gathered: no hooks and no schedule. A group's forward runs
``gather``: the group's shards, cast to ``param_dtype``, laid end to end and all-gathered in
ONE functional collective (``_c10d_functional.all_gather_into_tensor``), whose autograd
backward is ONE reduce-scatter of the gradients in ``reduce_dtype``, divided by the ranks.
The modules read their parameters through class properties that return the gathered
tensors while their group's forward runs (the sharded DTensors otherwise). Dynamo traces all
of it: ``torch.compile(model, fullgraph=True)`` gives one forward and one backward graph,
with one all-gather per group in forward and one reduce-scatter per group in backward, which
the compiler is free to schedule around the compute.

``reshard_after_forward=True`` (every group but the root, by default) wraps the gather in a
selective activation checkpoint that recomputes it: the compiled backward all-gathers the
group again instead of keeping its unsharded parameters from forward (the eager schedule).

Without ``torch.compile`` the same code runs eagerly and trains to the same numbers, but
every collective blocks and the unsharded parameters stay alive until backward (eager
autograd saves them): use ``shardkit.fully_shard`` for eager training.

The trace (``shardkit.trace()``) records each collective where the graph issues it and where
its wait returns, through an ordered-effect op (``shardkit::trace_collective``); the all-gathers
the partitioner recomputes in backward are not recorded (it does not recompute effectful ops).

Not in this mode (they raise): ``shard_placement_fn`` other than ``Shard(0)``, CPU offload,
an int ``reshard_after_forward``, HSDP and ``dp_mesh_dims`` meshes, weights tied across two
``fully_shard`` calls, tensor subclasses with FSDP2's all-gather hooks, and the
``FSDPModule`` methods (a compiled-mode module is not an ``FSDPModule``).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch._library.effects import EffectType
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from shardkit import api, meshes
from shardkit.comm import trace
from shardkit.dtensor.sharded_param import ShardedParam
from shardkit.policies import MixedPrecisionPolicy, OffloadPolicy, check_policies
from shardkit.state import class_name, state_of
from shardkit.tensors import cast_inputs, cast_output


class CompiledFSDPModule:
    """What ``shardkit.compiled.fully_shard`` makes a module's class also derive from."""

    _orig_cls_mro_index = 2  # (FSDPFoo, CompiledFSDPModule, Foo): class_name() reports Foo

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # .to()/.to_empty() replace the sharded parameters' data: the layout follows it
        result = super()._apply(*args, **kwargs)
        group = self.__dict__["_shardkit_state"]
        for p in group.params:
            p.reset_from_registered()
        group.make_buckets()
        return result


@dataclass
class GraphBucket:
    """The parameters of a group that travel in one collective of the graph: one original, one
    param and one reduce dtype (usually the whole group). Not eager mode's buckets
    (``comm/buckets.py``): no bytes, no grad-presence column, one reduce-scatter per all-gather."""

    indices: list[int]  # into the group's params
    numels: list[int]  # padded shard elements per parameter
    dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype


class CompiledGroup:
    """One ``fully_shard`` call in compiled mode: its parameters (a ``ShardedParam`` each, for
    the layout), where the modules register them, and the gathered tensors while its forward runs."""

    def __init__(self, modules: tuple[nn.Module, ...], params: list[ShardedParam], mesh: DeviceMesh, reshard_after_forward: bool | None, mp_policy: MixedPrecisionPolicy) -> None:
        self.modules, self.params, self.mesh, self.mp_policy = modules, params, mesh, mp_policy
        self.name = ""  # the modules' FQN under the outermost fully_shard call so far ("" for it)
        self.mesh_dim = mesh.mesh_dim_names[0] if mesh.mesh_dim_names else "dim0"
        self.reshard_after_forward = reshard_after_forward  # None: True unless this is the root
        self.parent: CompiledGroup | None = None  # the fully_shard call around this one
        self.gathered: list[torch.Tensor] | None = None  # while the group's forward runs
        self.pg_name, self.world = mesh.get_group().group_name, mesh.size()
        self.make_buckets()

    def nest_in(self, parent: "CompiledGroup") -> None:
        """A later ``fully_shard`` call on a module around ours: it is our parent."""
        self.parent = parent

    def make_buckets(self) -> None:
        """The parameters by (dtype, param dtype, reduce dtype): one collective each."""
        buckets: dict[tuple, GraphBucket] = {}
        for i, p in enumerate(self.params):
            key = (p.dtype, p.param_dtype, p.reduce_dtype)
            bucket = buckets.setdefault(key, GraphBucket([], [], *key))
            bucket.indices.append(i)
            bucket.numels.append(p.shard_numel)
        self.buckets = list(buckets.values())


class _GatherGraphBucket(torch.autograd.Function):
    """Forward: cast to ``param_dtype`` and all-gather the flat shards. Backward: reduce-scatter
    the gradient in ``reduce_dtype``, divided by the ranks, in the shards' dtype."""

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, group: CompiledGroup, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> torch.Tensor:
        ctx.group, ctx.reduce_dtype, ctx.dtype = group, reduce_dtype, flat.dtype
        send = flat.to(param_dtype)
        torch.ops.shardkit.trace_collective(send, "all_gather", group.name, group.world, group.mesh_dim, False)
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(send, group.world, group.pg_name)
        gathered = torch.ops._c10d_functional.wait_tensor(gathered)  # (world * per_rank,)
        torch.ops.shardkit.trace_collective(gathered, "all_gather", group.name, group.world, group.mesh_dim, True)
        return gathered

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        group = ctx.group
        grad = grad.to(ctx.reduce_dtype).contiguous()
        torch.ops.shardkit.trace_collective(grad, "reduce_scatter", group.name, group.world, group.mesh_dim, False)
        reduced = torch.ops._c10d_functional.reduce_scatter_tensor(grad, "sum", group.world, group.pg_name)
        reduced = torch.ops._c10d_functional.wait_tensor(reduced)  # (per_rank,)
        torch.ops.shardkit.trace_collective(reduced, "reduce_scatter", group.name, group.world, group.mesh_dim, True)
        return (reduced / group.world).to(ctx.dtype), None, None, None


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

    def run(*shards: torch.Tensor) -> list[torch.Tensor]:
        unsharded: list[Any] = [None] * len(shards)
        for bucket in group.buckets:
            flat = torch.cat([_padded(shards[i], group.params[i]).reshape(-1) for i in bucket.indices])
            gathered = _GatherGraphBucket.apply(flat, group, bucket.param_dtype, bucket.reduce_dtype)
            for i, column in zip(bucket.indices, gathered.view(group.world, -1).split(bucket.numels, dim=1)):
                unsharded[i] = _unsharded(column, group.params[i])
        return unsharded

    reshard = group.reshard_after_forward if group.reshard_after_forward is not None else group.parent is not None
    if reshard and torch.is_grad_enabled():
        context = functools.partial(create_selective_checkpoint_contexts, _recompute)
        return checkpoint(run, *shards, use_reentrant=False, context_fn=context)
    return run(*shards)


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
    param = DTensor.from_local(full, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)
    return _GradSummedInReduceDtype.apply(param, p.reduce_dtype) if p.reduce_dtype != full.dtype else param


class _GradSummedInReduceDtype(torch.autograd.Function):
    """The identity; in backward, a tensor-parallel ``Partial`` gradient is summed over tp in
    ``reduce_dtype`` (``from_local``'s backward would sum it in ``param_dtype``), then rounded
    to ``param_dtype`` once, on its way to the group's reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, param: DTensor, reduce_dtype: torch.dtype) -> DTensor:
        ctx.reduce_dtype, ctx.spec = reduce_dtype, param._spec
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple:
        if grad.placements != ctx.spec.placements:
            grad = grad.to(ctx.reduce_dtype).redistribute(ctx.spec.mesh, ctx.spec.placements).to(grad.dtype)
        return grad, None


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Any = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
):
    """``shardkit.fully_shard`` in compiled mode (see the top of this file): shard ``module``'s
    parameters over ``mesh`` and gather them inside its forward as ops of the graph. The same
    signature; the options this mode does not take raise ``NotImplementedError``."""
    modules = api._check_modules(module)
    mesh = meshes.default_mesh() if mesh is None else mesh
    meshes.check_mesh(mesh)
    _unsupported(mesh, reshard_after_forward, shard_placement_fn, offload_policy, dp_mesh_dims)
    mp_policy, options = check_policies(mp_policy, offload_policy)
    found = api.collect(modules, ignored_params)
    for inner in found.nested:
        if not isinstance(inner, CompiledGroup):
            raise ValueError(f"shardkit: {class_name(inner.modules[0])} was sharded by shardkit.fully_shard (eager); use one mode for the whole model.")
    if found.borrowed:
        names = [slot.name for more in found.borrowed.values() for slot in more]
        raise NotImplementedError(f"shardkit.compiled: parameters {names} are tied to a parameter of another fully_shard call; shard them in one call.")
    # Every parameter gathers in param_dtype here: this mode has never applied param_dtype_override_fn.
    options = dataclasses.replace(options, mp_policy=dataclasses.replace(mp_policy, param_dtype_override_fn=None))
    sharded = api.shard_params(found, options, mesh, meshes.mesh_device(mesh))
    group = CompiledGroup(modules, list(sharded.values()), mesh, reshard_after_forward, mp_policy)
    api.register_sharded(group, sharded, found)
    _install(group)
    for fqn, m in modules[0].named_modules():  # names under this call, the outermost so far
        inner = state_of(m)
        if isinstance(inner, CompiledGroup) and inner is not group:
            inner.name = fqn
    return module


def _unsupported(mesh: DeviceMesh, reshard_after_forward: Any, shard_placement_fn: Any, offload_policy: Any, dp_mesh_dims: Any) -> None:
    why = ""
    if mesh.ndim != 1:
        why = "a 2-D mesh (HSDP)"
    elif reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        why = f"reshard_after_forward={reshard_after_forward!r} (an int)"
    elif shard_placement_fn is not None:
        why = "shard_placement_fn"
    elif type(offload_policy) is not OffloadPolicy:
        why = "CPU offload"
    elif dp_mesh_dims is not None:
        why = "dp_mesh_dims"
    if why:
        raise NotImplementedError(f"shardkit.compiled.fully_shard does not take {why}; use shardkit.fully_shard (eager) for it.")


def _install(group: CompiledGroup) -> None:
    """Each module holding the group's parameters reads them through class properties (the
    gathered tensors during the group's forward); the group's own modules gather in forward."""
    by_module: dict[nn.Module, dict[str, int]] = {}
    for i, p in enumerate(group.params):
        for slot in p.slots:
            by_module.setdefault(slot.module, {})[slot.name] = i
    for m in group.modules:
        by_module.setdefault(m, {})
        m.__dict__["_shardkit_state"] = group
    for m, names in by_module.items():
        namespace: dict[str, Any] = {name: _param_property(group, name, i) for name, i in names.items()}
        if m in group.modules:
            namespace["forward"] = _gathering_forward(group, type(m).forward)
        mixin = CompiledFSDPModule if m in group.modules else None  # None: a submodule, only its parameters' properties
        m.__class__ = api.subclass(type(m), namespace, mixin)


def _param_property(group: CompiledGroup, name: str, i: int) -> property:
    def get(module: nn.Module) -> Any:
        return group.gathered[i] if group.gathered is not None else module._parameters[name]

    return property(get)


def _gathering_forward(group: CompiledGroup, forward: Any) -> Any:
    def gathering_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_inputs(group.mp_policy, args, kwargs)
        if group.gathered is not None:  # re-entry: another module of the group
            output = forward(self, *args, **kwargs)
        else:
            group.gathered = gather(group)
            try:
                output = forward(self, *args, **kwargs)
            finally:
                group.gathered = None
        return cast_output(group.mp_policy, output)

    return gathering_forward
