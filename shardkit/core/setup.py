"""The set-up both modes share: find what a ``fully_shard`` call manages, shard it, register
the sharded parameters, and swap the module's class (eager/api.py and compiled/__init__.py
call these in the same order)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as _TorchFSDPModule
from torch.distributed.tensor import DTensor, Shard

from shardkit.core import meshes
from shardkit.core.options import ParamOptions
from shardkit.dtensor.sharded_param import ParamSlot, ShardedParam


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


def state_of(module: nn.Module) -> Any:
    """The state ``fully_shard`` left on ``module`` (either mode's), or None."""
    return module.__dict__.get("_shardkit_state")


def user_class(cls: type) -> type:
    """The user's class under the ones ``subclass`` made (``FSDPBlock`` -> ``Block``)."""
    return next(c for c in cls.__mro__ if not c.__dict__.get("_shardkit_generated") and not issubclass(c, _TorchFSDPModule))


def class_name(module: nn.Module) -> str:
    """The user's class name, without the ``FSDP`` subclass that fully_shard swaps in."""
    return user_class(type(module)).__name__


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
        param_mesh = mesh if param_mesh is None or mesh_key(param_mesh, mesh) is None else param_mesh
        own = options
        if policy.param_dtype_override_fn is not None:
            own = dataclasses.replace(options, param_dtype=policy.param_dtype_for(p, f"'{s[0].name}' of {class_name(s[0].module)}"))
        sharded[p] = ShardedParam(p, s, param_mesh, device, own, dim, spmd if param_mesh is mesh else None)
    return sharded


def register_sharded(state: Any, sharded: dict[nn.Parameter, ShardedParam], found: Found, unsharded: Callable[[Any], bool]) -> None:
    """Register the sharded parameters in every slot, the borrowed (tied) ones in this call's
    slots too (``unsharded(owner)``: whether the owner's group holds them gathered now), and
    link the nested calls to ``state``."""
    for original, p in sharded.items():  # later calls may meet the original again (tied weights)
        original._shardkit_shared = (p, state)
        original._shardkit_replaced = True  # see optim/local_step.py: an optimizer holding it warns
        p.put_on_modules(p.sharded_param)
    for (p, owner), more_slots in found.borrowed.items():  # weights tied across calls stay in the owner's
        p.add_slots(more_slots, unsharded=unsharded(owner))
    own = [(slot, p) for p in sharded.values() for slot in p.slots]
    accept_full_tensors(own + [(slot, p) for (p, _), more in found.borrowed.items() for slot in more])
    for inner in found.nested:
        inner.nest_in(state)


def check_modules(module: Any) -> tuple[nn.Module, ...]:
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


def _managed_modules(modules: tuple[nn.Module, ...]) -> tuple[list[nn.Module], list[Any]]:
    """Modules whose parameters this call manages: all below ``modules``, stopping at inner
    fully_shard modules (those are returned as the nested states)."""
    managed: list[nn.Module] = []
    nested: list[Any] = []
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


def mesh_key(mesh: DeviceMesh, default: DeviceMesh) -> tuple | None:
    """Parameters whose meshes have the same ranks in the same layout share collectives; None:
    those of ``default``, fully_shard's own mesh. (Only parameters with a mesh of their own get
    here: laying a mesh out as ranks costs a few hundred microseconds.)"""
    def layout(m: DeviceMesh) -> tuple:
        return (m.device_type, tuple(m.mesh.shape), tuple(m.mesh.flatten().tolist()))

    return None if mesh is default or layout(mesh) == layout(default) else layout(mesh)


def subclass(cls: type, namespace: dict[str, Any], mixin: type | None = None) -> type:
    """The class fully_shard swaps in (both modes): ``cls`` with ``namespace`` and ``mixin`` (``FSDP<cls>``)."""
    # The subclass claims its base's module: dynamo (torch/_dynamo/trace_rules.py, check_verbose)
    # traces the forward of a torch.nn built-in (nn.TransformerEncoderLayer, nn.Sequential, ...)
    # as a frame of its own only if the module has hooks and type(module).__module__ starts
    # with "torch.nn." -- without this, torch.compile after fully_shard compiles nothing of it.
    name, bases = (cls.__name__, (cls,)) if mixin is None else (f"FSDP{cls.__name__}", (mixin, cls))
    return type(name, bases, {**namespace, "__module__": cls.__module__, "_shardkit_generated": True})



def accept_full_tensors(slots: list[tuple[ParamSlot, ShardedParam]]) -> None:
    """``load_state_dict`` with plain (full) tensors for sharded parameters: each rank keeps its
    shard (FSDP2 makes the user distribute them first). A hook on each module that registers
    one of them, run before that module loads its own entries."""
    by_module: dict[nn.Module, list[tuple[str, ShardedParam]]] = {}
    for slot, p in slots:
        by_module.setdefault(slot.module, []).append((slot.name, p))

    def hook_for(entries):
        def hook(state_dict, prefix, *args):
            for name, p in entries:
                value = state_dict.get(prefix + name)
                full_shape = p.tp_spec.shape if p.tp_spec is not None else p.shape
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == full_shape:
                    state_dict[prefix + name] = p.shard_of_full(value)
        return hook

    for module, entries in by_module.items():
        module._register_load_state_dict_pre_hook(hook_for(entries))
