"""Gradient norms over parameters on any mix of meshes: ``clip_grad_norm_`` and ``grad_norm``.

``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` stacks one norm per gradient, and
DTensor refuses to stack DTensors on different meshes ("All operands in aten.stack.default
must have the same mesh", pytorch#180346): it raises on an MoE block whose experts have a
mesh of their own, on shardkit's and FSDP2's parameters alike. Here each gradient's local
tensor is reduced on its own, so any mix works: plain tensors, ``Shard(0)`` over dp,
``(dp, tp)`` DTensors (``_StridedShard`` too), HSDP's ``(Replicate(), Shard(0))``, full SPMD
meshes and per-parameter meshes.

[Note: one all-reduce per set of sharding ranks]
The p-norm of a gradient is ``(sum over its shards of |local|_p^p)^(1/p)``. A gradient's
shards lie along the mesh dims its placements shard (``Shard``, ``_StridedShard``); along its
``Replicate()`` dims every rank holds the same values, which must be counted once, not once
per replica. So each rank adds up ``|local|_p^p`` of the gradients that share a process group
over their sharded dims, and one SUM all-reduce over that process group gives the group's
part of the total (MAX for the inf norm). Gradients on different meshes whose sharded dims
are the same ranks (the experts over (efsdp, ep) and the dense layers over dp, both every
rank) share one all-reduce. Plain tensors and all-Replicate DTensors add their local values
as they are, with no collective. The all-reduces are all issued, then all waited for, in the
order of ``parameters``, which is the same on every rank.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _device_has_foreach_support, _group_tensors_by_device_and_dtype, _has_foreach_support

from shardkit.comm import check, trace
from shardkit.core.meshes import mesh_device

TRACE_NAME = "grad_norm"  # the group field of the all-reduces in a shardkit.trace()


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters on any meshes: the norm of all the
    gradients as one vector (each sharded gradient counted once, whatever its mesh), and every
    local gradient scaled in place by ``min(1, max_norm / (total_norm + 1e-6))``.

    Returns the total norm, a plain tensor equal on every rank, on the device of the first
    gradient. ``error_if_nonfinite`` and ``foreach`` are torch's. One all-reduce per process
    group the gradients are sharded over (see the Note at the top of this file).

    Example::

        loss.backward()
        norm = shardkit.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
    """
    parameters = _as_list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = _total_norm(grads, float(norm_type), error_if_nonfinite, foreach)
    if grads:
        coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        _scale_(_locals(grads), coefficient, foreach)
    return total


@torch.no_grad()
def grad_norm(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The total norm ``clip_grad_norm_`` computes, without clipping: for logging.

    Example::

        print(f"grad norm {shardkit.grad_norm(model.parameters()).item():.3f}")
    """
    grads = [p.grad for p in _as_list(parameters) if p.grad is not None]
    return _total_norm(grads, float(norm_type), error_if_nonfinite, foreach)


@dataclass
class _Reduction:
    """Gradients whose parts of the norm are summed over the same process group (on a mesh
    without dim names, one group per sharded dim, in turn), and their local tensors."""

    groups: tuple[dist.ProcessGroup, ...]
    device: torch.device  # where the all-reduce's buffer lives: the first mesh's device
    tensors: list[torch.Tensor] = field(default_factory=list)
    meshes: list[str] = field(default_factory=list)  # their mesh dims, for the trace: ["dp", "efsdp*ep"]

    def add(self, local: torch.Tensor, dims: str) -> None:
        self.tensors.append(local)
        if dims not in self.meshes:
            self.meshes.append(dims)

    @property
    def dims(self) -> str:
        return "+".join(self.meshes)  # "dp+efsdp*ep": two meshes over the same ranks


def _total_norm(grads: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool, foreach: bool | None) -> torch.Tensor:
    if not grads:
        return torch.tensor(0.0)  # as torch
    if not norm_type > 0:
        raise ValueError(f"shardkit.clip_grad_norm_ / grad_norm: norm_type must be positive or inf, got {norm_type}")
    result_dtype = functools.reduce(torch.promote_types, [g.dtype.to_real() for g in grads])  # torch's: its norms stacked
    dtype = torch.promote_types(result_dtype, torch.float32)  # the parts add up in fp32 at least
    device = _locals(grads[:1])[0].device
    unreduced, reductions = _by_reduction(grads)
    parts = [_part(unreduced, norm_type, foreach, dtype, device)]
    in_flight = [_all_reduce(_part(r.tensors, norm_type, foreach, dtype, r.device), r, norm_type) for r in reductions]
    parts += [wait().to(device) for wait in in_flight]
    parts = torch.stack(parts)  # (1 + len(reductions),)
    total = (parts.max() if math.isinf(norm_type) else parts.sum() ** (1.0 / norm_type)).to(result_dtype)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`"
        )
    return total


def _by_reduction(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[_Reduction]]:
    """The local tensors counted as they are (plain tensors, all-Replicate DTensors), and the
    others by the process groups of their sharded dims, in order of first appearance."""
    unreduced, reductions = [], {}
    for g in grads:
        if not isinstance(g, DTensor):
            unreduced.append(g)
            continue
        mesh = g.device_mesh
        if mesh.get_coordinate() is None:  # this rank is not in the mesh: it holds nothing of it
            continue
        dims = _sharded_dims(g)
        if not dims:
            unreduced.append(g.to_local())
            continue
        groups = _process_groups(mesh, dims)
        key = tuple(pg.group_name for pg in groups)
        names = mesh.mesh_dim_names or [f"dim{d}" for d in range(mesh.ndim)]
        reduction = reductions.setdefault(key, _Reduction(groups, mesh_device(mesh)))
        reduction.add(g.to_local(), "*".join(names[d] for d in dims))
    return unreduced, list(reductions.values())


def _sharded_dims(grad: DTensor) -> tuple[int, ...]:
    """The mesh dims ``grad`` is split over: all but its ``Replicate()`` ones."""
    if any(p.is_partial() for p in grad.placements):
        raise ValueError(
            f"shardkit.clip_grad_norm_: a gradient has placements {grad.placements}: a Partial gradient is not "
            "reduced yet, so its norm is not the sum of its ranks' norms. Redistribute it to Shard or Replicate first."
        )
    return tuple(d for d, p in enumerate(grad.placements) if not p.is_replicate())


def _process_groups(mesh: DeviceMesh, dims: tuple[int, ...]) -> tuple[dist.ProcessGroup, ...]:
    """The process group over ``dims`` of ``mesh``: one dim's own, or the group of the dims
    flattened into one (made once per mesh by DeviceMesh, on every rank alike, as every rank
    clips the same parameters); without dim names nothing can be flattened: each dim's group."""
    if len(dims) == 1:
        return (mesh.get_group(dims[0]),)
    names = mesh.mesh_dim_names
    if names is None:
        return tuple(mesh.get_group(d) for d in dims)
    return (mesh[tuple(names[d] for d in dims)]._flatten().get_group(),)


def _part(tensors: list[torch.Tensor], norm_type: float, foreach: bool | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's part of the norm of ``tensors``: the sum of their norms to the p (the max
    of their norms for the inf norm), a 0-d tensor of ``dtype`` on ``device``."""
    if math.isinf(norm_type):
        tensors = [t for t in tensors if t.numel()]  # torch has no inf norm of an empty shard; it adds nothing
    if not tensors:
        return torch.zeros((), dtype=dtype, device=device)
    norms = torch.stack([n.to(device, dtype) for n in _norms(tensors, norm_type, foreach)])  # (len(tensors),)
    return norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()


def _all_reduce(part: torch.Tensor, reduction: _Reduction, norm_type: float) -> Callable[[], torch.Tensor]:
    """Issue the all-reduce of ``part`` (SUM, MAX for the inf norm) and return its wait."""
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    buffer = part.reshape(1)  # (1,)
    *first, last = reduction.groups
    for pg in first:  # a mesh without names, dim by dim: each sums what the one before summed
        _issue(buffer, pg, op, reduction.dims).wait()
    work = _issue(buffer, last, op, reduction.dims)

    def wait() -> torch.Tensor:
        work.wait()
        return buffer[0]

    return wait


def _issue(buffer: torch.Tensor, pg: dist.ProcessGroup, op, dims: str) -> _Work:
    kind = "max" if op == dist.ReduceOp.MAX else "sum"
    traced = trace.record("all_reduce", TRACE_NAME, dtype=buffer.dtype, numel=1, world=pg.size(), mesh_dim=dims, op=kind) if trace.is_recording() else None
    check.before(pg, "all_reduce", TRACE_NAME, buffer.dtype, 1, pg.size())  # SHARDKIT_CHECK=1: the same on every rank
    return _Work(dist.all_reduce(buffer, op=op, group=pg, async_op=True), traced)


@dataclass
class _Work:
    """An all-reduce in flight, and its trace record (None when no trace is recording)."""

    work: dist.Work
    traced: trace.Record | None

    def wait(self) -> None:
        trace.waiting(self.traced)
        self.work.wait()
        trace.done(self.traced)


def _norms(tensors: list[torch.Tensor], norm_type: float, foreach: bool | None) -> list[torch.Tensor]:
    """One norm per tensor, as torch computes them: ``_foreach_norm`` per device and dtype."""
    norms = []
    for (device, _), ([same], _) in _group_tensors_by_device_and_dtype([tensors]).items():
        if _use_foreach(same, device, foreach):
            norms.extend(torch._foreach_norm(same, norm_type))
        else:
            norms.extend(torch.linalg.vector_norm(t, norm_type) for t in same)
    return norms


def _scale_(tensors: list[torch.Tensor], coefficient: torch.Tensor, foreach: bool | None) -> None:
    for (device, _), ([same], _) in _group_tensors_by_device_and_dtype([tensors]).items():
        on_device = coefficient.to(device)
        if _use_foreach(same, device, foreach):
            torch._foreach_mul_(same, on_device)
        else:
            for t in same:
                t.mul_(on_device)


def _use_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """torch's rule: the foreach kernels where they support the tensors, unless
    ``foreach=False``; ``foreach=True`` where they do not is an error."""
    if (foreach is None and _has_foreach_support(tensors, device)) or (foreach and _device_has_foreach_support(device)):
        return True
    if foreach:
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return False


def _as_list(parameters: torch.Tensor | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    is_generator = isinstance(parameters, types.GeneratorType)
    parameters = list(parameters)
    if is_generator and not parameters:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=4)
    return parameters


def _locals(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's local tensor (under no_grad, the DTensor's own storage)."""
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]
