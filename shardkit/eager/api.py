"""Eager mode's fully_shard(): the shared set-up (core/setup.py), then its group, state and hooks."""

from __future__ import annotations

from typing import Any, Callable

import functools

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from shardkit.core import meshes, setup
from shardkit.core.options import GroupOptions
from shardkit.core.policies import MixedPrecisionPolicy, OffloadPolicy, check_policies
from shardkit.core.setup import ShardPlacementResult
from shardkit.dtensor.sharded_param import ShardedParam
from shardkit.eager import fsdp2_view, hooks
from shardkit.eager.module import EagerFSDPModule
from shardkit.eager.param_group import MeshPart, ParamGroup
from shardkit.eager.state import GroupState


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
    modules = setup.check_modules(module)
    mesh = meshes.default_mesh() if mesh is None else mesh
    meshes.check_mesh(mesh, spmd=dp_mesh_dims is not None)
    spmd = meshes.spmd_mesh(mesh, dp_mesh_dims) if dp_mesh_dims is not None else None
    dp_mesh = spmd.dp_mesh if spmd is not None else mesh
    reshard, post_forward_mesh = meshes.check_reshard_after_forward(reshard_after_forward, dp_mesh, spmd=spmd is not None)
    mp_policy, options = check_policies(mp_policy, offload_policy)
    found = setup.collect(modules, ignored_params)
    device = meshes.mesh_device(mesh)
    sharded = setup.shard_params(found, options, dp_mesh, device, shard_placement_fn, spmd)
    by_mesh: dict[Any, tuple[DeviceMesh, list[ShardedParam]]] = {None: (dp_mesh, [])}  # None: fully_shard's mesh
    for p in sharded.values():
        by_mesh.setdefault(setup.mesh_key(p.mesh, dp_mesh), (p.mesh, []))[1].append(p)

    def post_forward(m: DeviceMesh) -> DeviceMesh | None:  # reshard_after_forward=R, for each mesh
        return post_forward_mesh if m is dp_mesh else meshes.check_reshard_after_forward(reshard_after_forward, m)[1]

    options = GroupOptions(reshard)
    parts = [MeshPart(ps, m, post_forward(m)) for m, ps in by_mesh.values() if ps]
    group = ParamGroup(parts, options) if parts else None
    state = GroupState(modules, group, options, mp_policy, device)
    setup.register_sharded(state, sharded, found, unsharded=lambda owner: owner.group is not None and owner.group.is_unsharded)
    for _, owner in found.borrowed:
        state.tied.borrow_from(state, owner)
    hooks.install(state)
    for m in state.modules:
        m.__dict__["_shardkit_state"] = state
        m.__class__ = _fsdp_class(type(m))
        fsdp2_view.register(m, state)
    return module


@functools.cache  # made once per class
def _fsdp_class(cls: type) -> type:
    return setup.subclass(cls, {"__deepcopy__": _no_deepcopy}, EagerFSDPModule)


def _no_deepcopy(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("FSDP does not support deepcopy. Please use state dict for serialization.")
