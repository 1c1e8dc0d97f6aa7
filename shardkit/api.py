"""fully_shard(): validate, collect the parameters, shard them, install the hooks (compiled/: the first three)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from shardkit import fsdp2_view, hooks, meshes
from shardkit.dtensor.sharded_param import ParamSlot, ShardedParam
from shardkit.module import FSDPModule, accept_full_tensors
from shardkit.options import GroupOptions, ParamOptions
from shardkit.param_group import MeshPart, ParamGroup
from shardkit.policies import MixedPrecisionPolicy, OffloadPolicy, check_policies
from shardkit.state import GroupState, class_name, state_of


class AlreadyShardedError(ValueError, AssertionError):
    """fully_shard applied twice to one module (FSDP2 raises AssertionError here)."""


class PlacementError(ValueError, AssertionError):
    """shard_placement_fn returned something other than a Shard of one of the parameter's dims
    (FSDP2 raises AssertionError here)."""


@dataclass
class ShardPlacementResult:
    """What ``shard_placement_fn`` may return for a parameter that gets its own mesh (FSDP2's
    per-parameter mesh, e.g. MoE experts over an expert-FSDP mesh): the ``Shard`` (or None:
    ``Shard(0)``) and the mesh, as FSDP2's ``FSDPMeshInfo`` / ``HSDPMeshInfo`` or a
    DeviceMesh (1-D: FSDP, 2-D: HSDP). FSDP2's own ``ShardPlacementResult`` is accepted too."""

    placement: Shard | None
    mesh_info: Any


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | ShardPlacementResult | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: meshes.DataParallelMeshDims | None = None,
):
    """Shard ``module``'s parameters over ``mesh`` and gather them around its forward/backward.

    A drop-in for ``torch.distributed.fsdp.fully_shard``: call it on each block, then on the
    root. Every parameter of ``module`` not already managed by an inner call (and not in
    ``ignored_params``) becomes an ``nn.Parameter`` holding a ``Shard(0)`` DTensor over the
    1-D ``mesh`` (default: all ranks), or ``(Replicate(), Shard(0))`` over a 2-D mesh (HSDP:
    replicated over dim 0, sharded over dim 1); ``shard_placement_fn`` may pick ``Shard(d)``
    per parameter, and with a ``ShardPlacementResult`` a mesh of its own (MoE experts over an
    expert-FSDP mesh). They form ONE group, all-gathered in one collective (per mesh) before
    forward and backward and reduce-scattered in one collective (per mesh) after backward.
    With ``dp_mesh_dims``, ``mesh`` is a full SPMD mesh (e.g. ``("dp_replicate",
    "dp_shard", "tp")``) on which the parameters already are DTensors, replicated over the
    data-parallel dims it names; fully_shard shards them over those dims.
    ``reshard_after_forward`` frees the gathered parameters after forward (default: True
    except for the root); an int R keeps 1/R of them so that backward gathers among R
    ranks only. ``mp_policy`` sets the dtypes of the all-gather/compute and of the gradient
    reduction; ``CPUOffloadPolicy`` keeps the shards and gradients on the CPU. A list of
    modules makes one group of all of them.

    Example::

        from shardkit import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(x).sum().backward(); optim.step()

    Returns the module (its class now also an ``FSDPModule``), or the list of modules.
    """
    modules = _check_modules(module)
    mesh = meshes.default_mesh() if mesh is None else mesh
    meshes.check_mesh(mesh, spmd=dp_mesh_dims is not None)
    spmd = meshes.spmd_mesh(mesh, dp_mesh_dims) if dp_mesh_dims is not None else None
    dp_mesh = spmd.dp_mesh if spmd is not None else mesh
    reshard, post_forward_mesh = meshes.check_reshard_after_forward(reshard_after_forward, dp_mesh, spmd=spmd is not None)
    mp_policy, options = check_policies(mp_policy, offload_policy)
    found = collect(modules, ignored_params)
    device = meshes.mesh_device(mesh)
    sharded = shard_params(found, options, dp_mesh, device, shard_placement_fn, spmd)
    by_mesh: dict[Any, tuple[DeviceMesh, list[ShardedParam]]] = {None: (dp_mesh, [])}  # None: fully_shard's mesh
    for p in sharded.values():
        by_mesh.setdefault(_mesh_key(p.mesh, dp_mesh), (p.mesh, []))[1].append(p)

    def post_forward(m: DeviceMesh) -> DeviceMesh | None:  # reshard_after_forward=R, for each mesh
        return post_forward_mesh if m is dp_mesh else meshes.check_reshard_after_forward(reshard_after_forward, m)[1]

    options = GroupOptions(reshard)
    parts = [MeshPart(ps, m, post_forward(m)) for m, ps in by_mesh.values() if ps]
    group = ParamGroup(parts, options) if parts else None
    state = GroupState(modules, group, options, mp_policy, device)
    register_sharded(state, sharded, found)
    hooks.install(state)
    for m in state.modules:
        m.__dict__["_shardkit_state"] = state
        m.__class__ = _fsdp_class(type(m))
        fsdp2_view.register(m, state)
    return module


@dataclass
class Found:
    """What one fully_shard call manages (either mode's): all below its modules, down to inner calls'."""

    modules: list[nn.Module]  # whose parameters and buffers it takes
    nested: list[Any]  # the inner calls' states
    slots: dict[nn.Parameter, list[ParamSlot]]  # each parameter it shards, with every place it is registered
    borrowed: dict[tuple, list[ParamSlot]]  # weights tied to an earlier call's: by (its ShardedParam, its state)


def collect(modules: tuple[nn.Module, ...], ignored_params: Any) -> Found:
    """The modules, inner calls and parameters a fully_shard call of ``modules`` manages (both modes)."""
    ignored = _check_ignored(ignored_params, modules)
    managed, nested = _managed_modules(modules)
    return Found(managed, nested, *_param_slots(managed, ignored))


def shard_params(found: Found, options: ParamOptions, mesh: DeviceMesh, device: torch.device, placement_fn=None, spmd=None) -> dict[nn.Parameter, ShardedParam]:
    """Move the managed buffers to ``device`` and shard each parameter found over ``mesh`` (or the
    mesh ``placement_fn`` gives it), in ``options`` or the dtype ``param_dtype_override_fn`` keeps."""
    _move_buffers(found.modules, device)
    policy, sharded = options.mp_policy, {}
    for p, s in found.slots.items():
        dim, param_mesh = _placement(p, s, placement_fn)
        param_mesh = mesh if param_mesh is None or _mesh_key(param_mesh, mesh) is None else param_mesh
        own = options
        if policy.param_dtype_override_fn is not None:
            own = dataclasses.replace(options, param_dtype=policy.param_dtype_for(p, f"'{s[0].name}' of {class_name(s[0].module)}"))
        sharded[p] = ShardedParam(p, s, param_mesh, device, own, dim, spmd if param_mesh is mesh else None)
    return sharded


def register_sharded(state: Any, sharded: dict[nn.Parameter, ShardedParam], found: Found) -> None:
    """Register the sharded parameters (and the borrowed, tied ones); link the nested calls to ``state``."""
    for original, p in sharded.items():  # later calls may meet the original again (tied weights)
        original._shardkit_shared = (p, state)
        original._shardkit_replaced = True  # see optim/local_step.py: an optimizer holding it warns
        p.put_on_modules(p.sharded_param)
    for (p, owner), more_slots in found.borrowed.items():  # weights tied across groups stay in the owner's
        p.add_slots(more_slots, unsharded=owner.group is not None and owner.group.is_unsharded)
        state.tied.borrow_from(state, owner)
    own = [(slot, p) for p in sharded.values() for slot in p.slots]
    accept_full_tensors(own + [(slot, p) for (p, _), more in found.borrowed.items() for slot in more])
    for inner in found.nested:
        inner.nest_in(state)


def _check_modules(module: Any) -> tuple[nn.Module, ...]:
    modules = tuple(module) if isinstance(module, list) else (module,)
    if not modules or not all(isinstance(m, nn.Module) for m in modules):
        raise TypeError(f"fully_shard expects an nn.Module or a non-empty list of them, got {module!r}")
    for m in modules:
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: {type(m).__name__}. "
                "Call it on each module inside, or pass them as a list to make one group."
            )
        if state_of(m) is not None:
            raise AlreadyShardedError(
                f"fully_shard was already applied to this {class_name(m)}; apply it once per module "
                "(bottom-up: blocks first, then the root)."
            )
    return modules


def _check_ignored(ignored_params: Any, modules: tuple[nn.Module, ...]) -> set[nn.Parameter]:
    if ignored_params is None:
        return set()
    ignored = set(ignored_params)
    owned = {p for m in modules for p in m.parameters()}
    stray = [p for p in ignored if p not in owned]
    if stray:
        shapes = ", ".join(str(tuple(p.shape)) for p in stray)
        raise ValueError(
            f"ignored_params holds {len(stray)} tensor(s) that are not parameters of the module(s) "
            f"passed to fully_shard (shapes {shapes}); pass parameters of this module only."
        )
    return ignored


def _managed_modules(modules: tuple[nn.Module, ...]) -> tuple[list[nn.Module], list[GroupState]]:
    """Modules whose parameters this call manages: all below ``modules``, stopping at inner
    fully_shard modules (those are returned as the nested states)."""
    managed: list[nn.Module] = []
    nested: list[GroupState] = []
    seen: set[nn.Module] = set()

    def visit(m: nn.Module) -> None:
        if m in seen:
            return
        seen.add(m)
        if m not in modules and (inner := state_of(m)) is not None:
            if inner not in nested:
                nested.append(inner)
            return
        managed.append(m)
        for child in m.children():
            visit(child)

    for m in modules:
        visit(m)
    return managed, nested


def _param_slots(managed: list[nn.Module], ignored: set[nn.Parameter]) -> tuple[dict, dict]:
    """Each managed parameter with every place it is registered (tied weights have several),
    and apart, the slots of parameters an earlier call already sharded (weights tied across
    groups), by (sharded parameter, owning state)."""
    slots: dict[nn.Parameter, list[ParamSlot]] = {}
    borrowed: dict[tuple, list[ParamSlot]] = {}
    for m in managed:
        for name, p in m._parameters.items():
            if p is None or p in ignored:
                continue
            if (shared := getattr(p, "_shardkit_shared", None)) is not None:
                borrowed.setdefault(shared, []).append(ParamSlot(m, name))
                continue
            if getattr(p, "_shardkit_owned", False):
                raise ValueError(
                    f"parameter '{name}' of {class_name(m)} is already sharded by an earlier fully_shard "
                    "call that contains this module. Call fully_shard bottom-up: on submodules first, "
                    "then on their parents."
                )
            slots.setdefault(p, []).append(ParamSlot(m, name))
    return slots, borrowed


def _move_buffers(managed: list[nn.Module], device: torch.device) -> None:
    for m in managed:
        for name, b in m._buffers.items():
            if b is not None and b.device != device and b.device.type != "meta":
                m._buffers[name] = b.to(device)


def _placement(p: nn.Parameter, slots: list[ParamSlot], placement_fn) -> tuple[int, DeviceMesh | None]:
    """The dim ``shard_placement_fn`` picks for ``p`` (0 by default), and its own mesh (None:
    the one fully_shard was given)."""
    where = f"'{slots[0].name}' of {class_name(slots[0].module)}"
    result = placement_fn(p) if placement_fn is not None else None
    placement, mesh = result, None
    if hasattr(result, "mesh_info") and hasattr(result, "placement"):  # ShardPlacementResult, ours or FSDP2's
        placement, mesh = result.placement, meshes.param_mesh(result.mesh_info, where)
    if placement is None:
        return 0, mesh
    if not isinstance(placement, Shard):
        raise PlacementError(f"shard_placement_fn returned {placement!r} for {where}; return a Shard(dim), a ShardPlacementResult or None.")
    dim = placement.dim + p.dim() if placement.dim < 0 else placement.dim
    if not 0 <= dim < p.dim():
        raise PlacementError(f"shard_placement_fn returned {placement} for {where}, which has only {p.dim()} dims.")
    return dim, mesh


def _mesh_key(mesh: DeviceMesh, default: DeviceMesh) -> tuple | None:
    """Parameters whose meshes have the same ranks in the same layout share collectives; None:
    those of ``default``, fully_shard's own mesh. (Only parameters with a mesh of their own get
    here: laying a mesh out as ranks costs a few hundred microseconds.)"""
    def layout(m: DeviceMesh) -> tuple:
        return (m.device_type, tuple(m.mesh.shape), tuple(m.mesh.flatten().tolist()))

    return None if mesh is default or layout(mesh) == layout(default) else layout(mesh)


@functools.cache  # made once per class
def _fsdp_class(cls: type) -> type:
    return subclass(cls, {"__deepcopy__": _no_deepcopy}, FSDPModule)


def subclass(cls: type, namespace: dict[str, Any], mixin: type | None = None) -> type:
    """The class fully_shard swaps in (both modes): ``cls`` with ``namespace`` and ``mixin`` (``FSDP<cls>``)."""
    # The subclass claims its base's module: dynamo (torch/_dynamo/trace_rules.py, check_verbose)
    # traces the forward of a torch.nn built-in (nn.TransformerEncoderLayer, nn.Sequential, ...)
    # as a frame of its own only if the module has hooks and type(module).__module__ starts
    # with "torch.nn." -- without this, torch.compile after fully_shard compiles nothing of it.
    name, bases = (cls.__name__, (cls,)) if mixin is None else (f"FSDP{cls.__name__}", (mixin, cls))
    return type(name, bases, {**namespace, "__module__": cls.__module__, "_shardkit_generated": True})


def _no_deepcopy(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")
