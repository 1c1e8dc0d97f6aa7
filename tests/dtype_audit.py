"""The dtype audit: every collective that sums gradients runs in ``reduce_dtype`` or wider.

``loss = model(x).sum(); with Audit(*meshes) as audit: loss.backward()`` records each collective issued below torch's
dispatcher, whoever issues it (shardkit's c10d calls, DTensor's functional collectives of a
tensor-parallel redistribution, compiled mode's ops): its kind, dtype, elements, ranks and
mesh dim, and whether it sums. ``audit.assert_sums_in(reduce_dtype)`` fails on any summing
collective narrower than ``reduce_dtype``, naming it. Used by tests/fake/test_reduce_dtypes.py
and by the fuzzer (tests/fuzz/sequences.py) on the sequences it draws.

What sums: an all-reduce or reduce-scatter with a sum or average; in a backward, an all-to-all
(shardkit's gloo route for a reduce-scatter: an all-to-all, then a sum of what arrived, in the
dtype that travelled). All-gathers move data only. Not the gradients of parameters, and so not
audited: what a backward node of the model's own communication issues (DTensor's
``RedistributeBackward`` of a tensor-parallel layer, the backward of a model's own
``DTensor.from_local``, the autograd functional collectives of an expert-parallel layer): those carry activations' gradients, in the compute's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import TorchDispatchMode

_SUMS = {int(dist.ReduceOp.SUM), int(dist.ReduceOp.AVG), int(dist.ReduceOp.PREMUL_SUM)}
# Backward nodes whose collectives carry activations' gradients (see the module doc).
# (``_FromTorchTensorBackward``: a model's own ``DTensor.from_local`` of an activation.)
ACTIVATION_NODES = ("RedistributeBackward", "_FromTorchTensorBackward", "_AllGather", "_ReduceScatter", "_AllToAll", "AllGather", "ReduceScatter")


@dataclass(frozen=True)
class Seen:
    kind: str  # all_gather, reduce_scatter, all_reduce, all_to_all
    dtype: torch.dtype
    numel: int
    world: int
    mesh_dim: str  # the mesh dim whose process group it ran on ("?" if none of the meshes')
    sums: bool  # it adds up parameters' gradients
    node: str = ""  # the backward node running when it was issued ("" outside one)

    def __str__(self) -> str:
        node = f" in {self.node}" if self.node else ""
        return f"{self.kind} over {self.mesh_dim} ({self.world} ranks) {str(self.dtype).removeprefix('torch.')} numel={self.numel}{node}"


def narrower(dtype: torch.dtype, than: torch.dtype) -> bool:
    """``dtype`` holds fewer mantissa bits than ``than`` (bf16 < fp16 < fp32 < fp64)."""
    return dtype != than and torch.finfo(dtype).eps > torch.finfo(than).eps


class Audit(TorchDispatchMode):
    """Records the collectives issued while active (see the module doc)."""

    def __init__(self, *meshes: DeviceMesh, all_to_all_sums: bool = True) -> None:
        super().__init__()
        self.seen: list[Seen] = []
        self.all_to_all_sums = all_to_all_sums
        self._names: dict[str, str] = {}  # process group name -> mesh dim
        for mesh in meshes:
            for dim in range(mesh.ndim):
                pg = mesh.get_group(dim)
                self._names[pg.group_name] = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else f"dim{dim}"

    def _dim(self, pg: dist.ProcessGroup) -> str:
        return self._names.get(pg.group_name, "?")

    def _add(self, kind: str, tensor: torch.Tensor, pg: dist.ProcessGroup, sums: bool) -> None:
        if pg.size() > 1:
            node = torch._C._current_autograd_node()
            name = node.name() if node is not None else ""
            grads = sums and not name.startswith(ACTIVATION_NODES)
            self.seen.append(Seen(kind, tensor.dtype, tensor.numel(), pg.size(), self._dim(pg), grads, name))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        unbox = dist.ProcessGroup.unbox
        # c10d schemas: _allgather_base_(out, in, group, ...), _reduce_scatter_base_(out, in,
        # group, op, ...), allreduce_(tensors, group, op, ...), alltoall_base_(out, in, group, ...)
        if name == "c10d::_allgather_base_":
            self._add("all_gather", args[1], unbox(args[2]), False)
        elif name == "c10d::_reduce_scatter_base_":
            self._add("reduce_scatter", args[1], unbox(args[2]), int(args[3].op()) in _SUMS)
        elif name == "c10d::allreduce_":
            for t in args[0]:
                self._add("all_reduce", t, unbox(args[1]), int(args[2].op()) in _SUMS)
        elif name == "c10d::alltoall_base_":
            self._add("all_to_all", args[1], unbox(args[2]), self.all_to_all_sums)
        elif name.startswith("_c10d_functional::"):
            self._functional(name.removeprefix("_c10d_functional::"), args)
        return func(*args, **kwargs)

    def _functional(self, op: str, args: tuple) -> None:
        # (input, reduce_op, group_name), (input, reduce_op, group_size, group_name), (input, group_size, group_name)
        resolve = torch.distributed.distributed_c10d._resolve_process_group
        if op in ("all_reduce", "all_reduce_"):
            self._add("all_reduce", args[0], resolve(args[2]), args[1] in ("sum", "avg"))
        elif op == "reduce_scatter_tensor":
            self._add("reduce_scatter", args[0], resolve(args[3]), args[1] in ("sum", "avg"))
        elif op == "all_gather_into_tensor":
            self._add("all_gather", args[0], resolve(args[2]), False)
        elif op == "all_to_all_single":
            self._add("all_to_all", args[0], resolve(args[3]), self.all_to_all_sums)

    def sums(self) -> list[Seen]:
        return [s for s in self.seen if s.sums]

    def assert_sums_in(self, reduce_dtype: torch.dtype, what: str = "") -> None:
        """No collective that sums ran in a dtype narrower than ``reduce_dtype``."""
        below = [s for s in self.sums() if narrower(s.dtype, reduce_dtype)]
        assert not below, (
            f"{what}: gradients summed below reduce_dtype={reduce_dtype}:\n  " + "\n  ".join(map(str, below))
            + "\nall collectives:\n  " + "\n  ".join(map(str, self.seen))
        )
