"""Parameters that all-gather themselves: FSDP2's tensor-subclass protocol.

A parameter whose local shard (the sharded DTensor's ``_local_tensor``) defines both hooks
decides what its all-gather carries and how its unsharded form is built (torchao's float8
weights send 1-byte data; its NF4 weights send their quantized blocks and scalers):

    fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy) -> (inputs, metadata)
        or the older ``fsdp_pre_all_gather(mesh)``; called before every all-gather, on the
        shard as it is now. ``inputs``: tensors of any dtypes, each gathered from every rank.
    fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None) -> (tensor, inner_tensors)
        builds the unsharded tensor from the gathered ``outputs`` (rank-major) the first time.
        Later the same outputs are refilled in place and the hook is called with ``out=`` the
        unsharded parameter, to update it; it then returns None.

Between gathers the outputs' and inner tensors' storage is freed, like a plain parameter's
unsharded buffer. A subclass whose unsharded form does not alias the outputs may say so
(torch 2.15's optional hook, honoured on every torch):

    fsdp_should_release_all_gather_outputs_after_post_all_gather() -> bool
        True: the outputs are freed right after ``fsdp_post_all_gather``, not at reshard.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from shardkit.dtensor.placements import contiguous_stride
from shardkit.dtensor.storage import alloc_storage, free_storage


def of(local: torch.Tensor, where: str) -> "Extension | None":
    """The protocol state for a parameter whose local tensor is ``local``; None if it has no hooks."""
    pre, post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
    if pre != post:
        raise TypeError(
            f"{where} is a {type(local).__name__} that defines only one of fsdp_pre_all_gather / "
            "fsdp_post_all_gather; define both to control its all-gather, or neither."
        )
    release = getattr(local, "fsdp_should_release_all_gather_outputs_after_post_all_gather", None)
    if release is not None:
        if not pre:
            raise TypeError(
                f"{where} is a {type(local).__name__} with fsdp_should_release_all_gather_outputs_after_post_all_gather "
                "but without fsdp_pre_all_gather / fsdp_post_all_gather; it needs both."
            )
        release = release()
        if not isinstance(release, bool):
            raise TypeError(f"fsdp_should_release_all_gather_outputs_after_post_all_gather of {where} must return a bool, got {type(release).__name__}")
    return Extension(where, bool(release)) if pre else None


def shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh the parameter is sharded over (HSDP: its last dim), as the hooks expect."""
    if mesh.ndim == 1:
        return mesh
    if mesh.mesh_dim_names:
        return mesh[mesh.mesh_dim_names[-1]]
    return DeviceMesh.from_group(mesh.get_group(mesh.ndim - 1), mesh.device_type)


def pre_all_gather_arity(local: torch.Tensor) -> int:
    """How many arguments ``local.fsdp_pre_all_gather`` takes (1 or 5: ``pre_all_gather``)."""
    return len(inspect.signature(local.fsdp_pre_all_gather).parameters)


def pre_all_gather(local: torch.Tensor, mesh: DeviceMesh, shape: torch.Size, module: nn.Module, mp_policy, where: str, n_args: int | None = None) -> tuple[Any, Any]:
    """``local.fsdp_pre_all_gather`` with the arguments its signature takes (``n_args``, if
    known: dynamo cannot read a signature): (inputs, metadata)."""
    hook = local.fsdp_pre_all_gather
    n_args = pre_all_gather_arity(local) if n_args is None else n_args
    if n_args == 1:
        return hook(mesh)
    if n_args == 5:
        return hook(mesh, shape, contiguous_stride(shape), module, mp_policy)
    raise TypeError(f"fsdp_pre_all_gather of {where} takes {n_args} arguments; expected (mesh) or (mesh, outer_size, outer_stride, module, mp_policy).")


class Extension:
    def __init__(self, where: str, release: bool = False) -> None:
        self.where = where
        self.release = release  # free the outputs right after fsdp_post_all_gather
        self.metadata: Any = None  # from the last fsdp_pre_all_gather
        self.sizes: list[torch.Size] = []  # the inputs' shapes: each output is world of them
        self.outputs: list[torch.Tensor] = []  # flat (world * numel,), made at the first gather, reused
        # What the all-gather writes: ``.data`` aliases of the outputs, with their own version
        # counters, so that refilling them does not look like an in-place edit of the parameter
        # to autograd (the same trick as a plain parameter's ``unsharded_flat``).
        self.targets: list[torch.Tensor] = []
        self.inner: list[torch.Tensor] = []  # storage fsdp_post_all_gather made; freed with the outputs

    def inputs(self, local: torch.Tensor, mesh: DeviceMesh, shape: torch.Size, padded: torch.Size, module: nn.Module, mp_policy) -> list[torch.Tensor]:
        """Call ``fsdp_pre_all_gather`` on the current local shard (``shape``: the unsharded
        parameter's, ``padded``: the padded shard's); its inputs, flat."""
        inputs, self.metadata = pre_all_gather(local, mesh, shape, module, mp_policy, self.where)
        if local.shape != padded and any(t.shape != padded for t in inputs):
            raise ValueError(
                f"{self.where} is sharded unevenly (padded shard {tuple(padded)}, this rank's "
                f"{tuple(local.shape)}), so fsdp_pre_all_gather must return inputs of the padded "
                f"shard's shape; it returned {[tuple(t.shape) for t in inputs]}. Use a size that "
                "divides evenly by the mesh size."
            )
        if self.sizes and [t.shape for t in inputs] != self.sizes:
            raise ValueError(f"fsdp_pre_all_gather of {self.where} changed its inputs' shapes between all-gathers.")
        self.sizes = [t.shape for t in inputs]
        return [t.reshape(-1) for t in inputs]

    def alloc_outputs(self, inputs: list[torch.Tensor], world: int, device: torch.device) -> None:
        if not self.outputs:
            self.outputs = [torch.empty(world * t.numel(), dtype=t.dtype, device=device) for t in inputs]
            self.targets = [t.data for t in self.outputs]
        for t in self.outputs:
            alloc_storage(t)

    def build(self, local: torch.Tensor, param: nn.Parameter | None, shape: torch.Size, param_dtype: torch.dtype, tp_spec: DTensorSpec | None, requires_grad: bool) -> nn.Parameter:
        """The unsharded parameter from the gathered outputs: made the first time, then updated."""
        outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs, self.sizes))
        post = local.fsdp_post_all_gather
        if param is not None:
            for t in self.inner:
                alloc_storage(t)
            post(outputs, self.metadata, param_dtype, out=param)
            self._release()
            return param
        tensor, self.inner = post(outputs, self.metadata, param_dtype)
        self._release()
        full = torch.as_strided(tensor, shape, contiguous_stride(shape), 0)
        if tp_spec is not None:
            meta = TensorMeta(tp_spec.shape, tp_spec.stride, full.dtype)
            full = DTensor(full, DTensorSpec(tp_spec.mesh, tp_spec.placements, meta), requires_grad=False)
        return nn.Parameter(full, requires_grad=requires_grad)

    def _release(self) -> None:
        if self.release:
            for t in self.outputs:
                free_storage(t)

    def free(self) -> None:
        for t in [*self.outputs, *self.inner]:
            free_storage(t)
