"""Compiled mode: FSDP as ops of the model's own graph, for ``torch.compile``.

    from shardkit.compiled import fully_shard   # instead of: from shardkit import fully_shard

The same calls (``fully_shard`` on each block, then on the root) and the same sharded
parameters: each is an ``nn.Parameter`` holding the same DTensor as in eager mode, so the
optimizer, ``state_dict()`` and ``shardkit.checkpoint`` files are the eager mode's. What differs
is how the parameters are gathered: no schedule and no module hooks around forward and backward.
The hooks it does register: a forward pre-hook before a module's own pre-hooks (which read the
parameters gathered, as in FSDP2), a ``load_state_dict`` pre-hook (what a backward kept is stale)
and a post-accumulate-grad hook on each of the graph's leaves. A group's forward
(forwarding.py, its states in forward_state.py) runs ``gather`` (gather.py): the group's shards, cast to ``param_dtype``, laid end to end and
all-gathered in ONE functional collective, whose autograd backward is ONE reduce-scatter of
the gradients in ``reduce_dtype`` (HSDP: then an all-reduce over the replicas), divided as
eager mode divides. The graph's inputs are plain leaves sharing the shards' storage, not the
DTensors (``CompiledGroup.make_leaves``); their gradients go to the parameters' ``.grad``, with
the parameters' post-accumulate-grad hooks. The modules read their parameters through class
properties that return the gathered tensors while their group's forward runs (the sharded
DTensors otherwise).
Dynamo traces all of it: ``torch.compile(model, fullgraph=True)`` gives one forward and one
backward graph, and inductor's scheduler gets a last pass (overlap.py) that issues each
group's all-gather during the previous group's compute and waits for each reduce-scatter
late, as eager mode's schedule. Many blocks of one structure (``region.REGIONS_FROM``) run as
one nested compile region instead, traced and compiled once (region.py), under
``fullgraph=True`` (a region cannot break the graph).

``reshard_after_forward=True`` (every group but the root, by default) wraps the gather in a
selective activation checkpoint that recomputes it: the compiled backward all-gathers the
group again instead of keeping its unsharded parameters from forward (the eager schedule);
otherwise in one that saves it all (inside the user's checkpoint, backward gathers nothing).

A compiled-mode module is an ``FSDPModule`` whose methods are its own (module.py): settings
the traced forward reads (one more graph per new setting), no-ops where one graph already
does the work, and a ``NotImplementedError`` naming the method otherwise.

Without ``torch.compile`` the same code runs eagerly and trains to the same numbers, but
every collective blocks and the unsharded parameters stay alive until backward (eager
autograd saves them): use ``shardkit.fully_shard`` for eager training.

The trace (``shardkit.trace()``) records each collective where the graph issues it and where
its wait returns, through an ordered-effect op (``shardkit::trace_collective``); the all-gathers
the partitioner recomputes in backward are not recorded (it does not recompute effectful ops).

A weight tied across two ``fully_shard`` calls (the token embedding in the root, the output
head in a call of its own) belongs to the first call's group; the other gathers it too, in a
bucket of its own (one more all-gather and reduce-scatter) reduced with the owner's settings,
and autograd adds the two reduced gradients in its shard (eager mode keeps the owner's group
unsharded instead: more bytes here, the same gradient up to rounding). Both calls shard over
one mesh.

``reshard_after_forward=R`` (an int): forward gathers a group in two steps, first 1/R of it
from the ranks equal to this one modulo R (what the checkpoint saves), then the rest from R
consecutive ranks (what backward gathers again): gather.py.

``set_reshard_after_backward(False)``: backward keeps each bucket's all-gather output, and
the next forward uses it instead of all-gathering, until an optimizer step, ``load_state_dict``,
``.to()`` or ``reshard()`` (module.py, gather.py).

A parameter no rank used keeps ``.grad = None``, as eager mode (unused.py).

Parameters that all-gather themselves (FSDP2's ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather``, torchao's float8 weights): their hooks' inputs and the group's other
shards travel as bytes in one all-gather, the unsharded form is what ``fsdp_post_all_gather``
builds, and its gradient is reduce-scattered with the group's (gather.py).

Not in this mode (they raise): ``shard_placement_fn``, CPU offload; with parameters that
all-gather themselves, an int ``reshard_after_forward`` and tensor parallel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch._dynamo
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.compiled import overlap, region, unused
from shardkit.compiled.forwarding import gather_before_pre_hooks, gathering, param_property, registering_pre_hooks
from shardkit.compiled.group import CompiledGroup, groups_alive
from shardkit.compiled.module import CompiledFSDPModule, following_register_parameter
from shardkit.core import meshes, setup
from shardkit.core.policies import MixedPrecisionPolicy, OffloadPolicy, check_policies
from shardkit.core.setup import class_name, state_of
from shardkit.dtensor.sharded_param import ParamSlot, ShardedParam


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
    modules = setup.check_modules(module)
    mesh = meshes.default_mesh() if mesh is None else mesh
    meshes.check_mesh(mesh, spmd=dp_mesh_dims is not None, compiled=True)
    spmd = meshes.spmd_mesh(mesh, dp_mesh_dims) if dp_mesh_dims is not None else None
    dp_mesh = spmd.dp_mesh if spmd is not None else mesh  # 1-D, or 2-D (replicate, shard)
    overlap.install()
    _unsupported(shard_placement_fn, offload_policy)
    reshard, post_forward_mesh = meshes.check_reshard_after_forward(reshard_after_forward, dp_mesh, spmd=spmd is not None, split=True)
    mp_policy, options = check_policies(mp_policy, offload_policy)
    found = setup.collect(modules, ignored_params)
    for inner in found.nested:
        if not isinstance(inner, CompiledGroup):
            raise ValueError(f"shardkit: {class_name(inner.modules[0])} was sharded by shardkit.fully_shard (eager); use one mode for the whole model.")
    borrowed = _borrowed(found)
    # Every parameter gathers in param_dtype here: this mode has never applied param_dtype_override_fn.
    options = dataclasses.replace(options, mp_policy=dataclasses.replace(mp_policy, param_dtype_override_fn=None))
    sharded = setup.shard_params(found, options, dp_mesh, meshes.mesh_device(mesh), spmd=spmd)
    own = list(sharded.values())
    _check_self_gathered(own, reshard_after_forward if post_forward_mesh is not None else None)
    _check_dense_grads(own)
    owners = {len(own) + k: owner for k, (_, owner, _) in enumerate(borrowed)}
    group = CompiledGroup(modules, own + [p for p, _, _ in borrowed], dp_mesh, reshard, mp_policy, unused.Watch(), owners, post_forward_mesh)
    _check_owners(group, borrowed)
    for p, owner, _ in borrowed:
        owner.lend(owner.params.index(p))
    overlap.GROUPS.update(comm.pg_name for comm in (group.shard_comm, *(group.post_forward or ())))
    setup.register_sharded(group, sharded, found, unsharded=lambda owner: False)
    _install(group, {len(own) + k: slots for k, (_, _, slots) in enumerate(borrowed)})
    group.make_leaves()
    region.choose(_name_under(modules[0], group))
    _room_for_graphs()
    _side_effects_under_checkpoint()
    return module


_DEFAULT_LIMIT = getattr(getattr(torch._dynamo.config, "_config", {}).get("recompile_limit"), "default", 8)  # torch's (8 in 2.13 to 2.15)
_limit_set = _DEFAULT_LIMIT  # the last recompile_limit _room_for_graphs set


def _room_for_graphs() -> None:
    """Raise dynamo's ``recompile_limit`` (graphs per code object) to its default (8) more
    than the groups alive in compiled mode. A graph guards on the identity of the groups it
    reads, so where dynamo compiles a block's forward as a frame of its own (a graph break
    inside it under ``torch.compile``'s default), each block adds one graph to that forward's
    code object: past the eighth block, dynamo ran the rest eagerly (FSDP2 and eager mode,
    whose hooks dynamo does not trace, share one graph). A limit the user set (any other value
    than the default or the last one set here) is left as it is."""
    global _limit_set
    config = torch._dynamo.config
    if config.recompile_limit == _limit_set:
        config.recompile_limit = _limit_set = max(config.recompile_limit, _DEFAULT_LIMIT + groups_alive())


def _side_effects_under_checkpoint() -> None:
    """Let dynamo trace a group's forward inside the user's ``torch.utils.checkpoint`` (around a
    block in the parent's forward, as transformers' ``gradient_checkpointing_enable`` does): the
    forward sets and then clears which tensors its parameters read (``group.forward``), Python
    state outside the checkpoint, which dynamo refuses to change there ("HOP: Unsafe side
    effect") unless ``skip_fwd_side_effects_in_bwd_under_checkpoint``: skip replaying such
    changes when backward recomputes the forward. Compiled mode's leave the state as they found
    it, so there is nothing to replay; a user's own changes inside a checkpointed forward are then
    not replayed in backward either (eager checkpointing replays them)."""
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True


def _name_under(root: nn.Module, group: CompiledGroup) -> list[CompiledGroup]:
    """The names under ``group``'s call (``root``), the outermost so far: each group's FQN and
    each parameter's (a tied weight: its first); returns the groups inside it."""
    inner_groups, params = [], {}
    for fqn, m in root.named_modules():
        inner = state_of(m)
        if isinstance(inner, CompiledGroup) and inner.modules[0] is m:
            params.update((id(registered), p) for p, registered in zip(inner.params, inner.registered()))
            if inner is not group:
                inner.named(fqn)
                inner_groups.append(inner)
    for fqn, param in reversed(list(root.named_parameters(remove_duplicate=False))):
        if id(param) in params:
            params[id(param)].named(fqn)
    return inner_groups


def _unsupported(shard_placement_fn: Any, offload_policy: Any) -> None:
    why = ""
    if shard_placement_fn is not None:
        why = "shard_placement_fn"
    elif type(offload_policy) is not OffloadPolicy:
        why = "CPU offload"
    if why:
        raise NotImplementedError(f"shardkit.compiled.fully_shard does not take {why}; use shardkit.fully_shard (eager) for it.")


def _check_self_gathered(params: list[ShardedParam], post_forward: int | None) -> None:
    """Parameters that all-gather themselves (fsdp_pre_all_gather) take neither an int
    reshard_after_forward (as in eager mode and FSDP2) nor tensor parallel in their group here."""
    hooked = next((p for p in params if p.extension is not None), None)
    if hooked is None:
        return
    tp = next((p for p in params if p.tp_spec is not None), None)
    why = f"reshard_after_forward={post_forward} (an int)" if post_forward else f"tensor parallel (parameter '{tp.fqn}')" if tp is not None else ""
    if why:
        raise NotImplementedError(f"shardkit.compiled: {why} with parameter '{hooked.fqn}' with fsdp_pre_all_gather is not supported; "
                                  "use shardkit.fully_shard (eager) for it, or a bool reshard_after_forward.")


def _check_dense_grads(params: list[ShardedParam]) -> None:
    """An embedding with ``sparse=True`` gives its weight a sparse gradient, which the graph's
    reduce-scatter cannot take (eager mode raises when one arrives; FSDP2 fails there too)."""
    for p in params:
        for slot in p.slots:
            if isinstance(slot.module, (nn.Embedding, nn.EmbeddingBag)) and slot.module.sparse and p.requires_grad:
                raise NotImplementedError(f"shardkit.compiled: '{slot.name}' of {class_name(slot.module)} has sparse gradients (sparse=True), which "
                                          "fully_shard does not reduce; build it with sparse=False, or pass the parameter in ignored_params.")


def _borrowed(found: setup.Found) -> list[tuple[ShardedParam, CompiledGroup, list[ParamSlot]]]:
    """Weights tied to a parameter an earlier call sharded (the embedding and the output head
    in two calls): this group gathers them too, in its own all-gather, and its reduce-scatter
    gives their shards a gradient that autograd adds to the owner's."""
    for (p, owner), slots in found.borrowed.items():
        if not isinstance(owner, CompiledGroup):
            raise ValueError(f"shardkit: parameter {_names(slots)} is tied to one sharded by shardkit.fully_shard (eager); use one mode for the whole model.")
    return [(p, owner, slots) for (p, owner), slots in found.borrowed.items()]


def _check_owners(group: CompiledGroup, borrowed: list[tuple[ShardedParam, CompiledGroup, list[ParamSlot]]]) -> None:
    """A tied weight is gathered from its owner's shards: both calls must shard over one mesh."""
    for _, owner, slots in borrowed:
        if (owner.shard_comm, owner.replicate_comm) != (group.shard_comm, group.replicate_comm):
            raise ValueError(f"shardkit.compiled: parameter {_names(slots)} is tied to one of {class_name(owner.modules[0])}, sharded over another mesh; "
                             "shard both over one mesh, or both weights in one call.")


def _names(slots: list[ParamSlot]) -> str:
    return ", ".join(f"'{slot.name}' of {class_name(slot.module)}" for slot in slots)


def _install(group: CompiledGroup, borrowed: dict[int, list[ParamSlot]]) -> None:
    """Each module holding the group's parameters reads them through class properties (the
    gathered tensors during the group's forward); the group's own modules gather in forward.
    A borrowed parameter (``borrowed``: by index) only where this group registers it."""
    by_module: dict[nn.Module, dict[str, int]] = {}
    for i, p in enumerate(group.params):
        for slot in borrowed.get(i, p.slots):
            by_module.setdefault(slot.module, {})[slot.name] = i
    for m in group.modules:
        by_module.setdefault(m, {})
        m.__dict__["_shardkit_state"] = group
        m._register_load_state_dict_pre_hook(lambda *_: group.drop_kept())  # what a backward kept is stale
    for m, names in by_module.items():
        namespace: dict[str, Any] = {name: param_property(group, name, i) for name, i in names.items()}
        namespace["register_parameter"] = following_register_parameter(group, type(m), set(names))
        if m in group.modules:
            namespace["forward"] = gathering(group, type(m).forward)
            namespace["_shardkit_plain_forward"] = type(m).forward  # what a region runs (region.py)
            namespace["register_forward_pre_hook"] = registering_pre_hooks(group, type(m))
        mixin = CompiledFSDPModule if m in group.modules else None  # None: a submodule, only its parameters' properties
        m.__class__ = setup.subclass(type(m), namespace, mixin)
        if m in group.modules and m._forward_pre_hooks:
            gather_before_pre_hooks(group, m)
