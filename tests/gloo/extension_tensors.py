"""FSDP2's extension points, as a user fills them in: a small tensor subclass with the
all-gather hooks (``Tagged``), and a user's collective (``UserComm``). Shared by the gloo and
the fake-process-group tests.

``Tagged`` wraps a float32 tensor. Its all-gather sends two inputs of different dtypes: the
data, and a one-element int64 "tag" (this step's count), so the byte layout of one collective
carrying several dtypes is checked on every gather: ``fsdp_post_all_gather`` asserts that each
rank's tag arrived intact. It counts its calls per hook, and records whether the ``out=`` path
was given the parameter built the first time.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._pytree import tree_map_only

CALLS: Counter = Counter()


class Tagged(torch.Tensor):
    tag = 7  # what every rank sends; tests may change it between steps

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device, strides=data.stride())

    def __init__(self, data: torch.Tensor):
        self._data = data

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Tagged(inner["_data"])

    def __repr__(self):
        return f"Tagged({self._data})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(Tagged, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        keep = func in (torch.ops.aten.new_zeros.default, torch.ops.aten.split.Tensor, torch.ops.aten.narrow.default,
                        torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.detach.default,
                        torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.aten.empty_like.default,
                        torch.ops.aten.alias.default)
        return tree_map_only(torch.Tensor, cls, out) if keep else out

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        CALLS["pre"] += 1
        CALLS["mesh_size"] = mesh.size()
        dtype = mp_policy.param_dtype if mp_policy is not None and mp_policy.param_dtype is not None else self.dtype
        return (self._data.to(dtype), torch.full((1,), Tagged.tag, dtype=torch.int64)), (tuple(outer_size), Tagged.tag)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        data, tags = outputs
        shape, tag = metadata
        assert tags.tolist() == [tag] * tags.numel(), f"tags arrived as {tags.tolist()}, sent {tag}"
        if out is not None:
            CALLS["post_out"] += 1
            assert out.untyped_storage().data_ptr() == data.untyped_storage().data_ptr(), "out= is not the gathered buffer"
            return None
        CALLS["post"] += 1
        return data, (data,)


class OldSignature(Tagged):
    """The older ``fsdp_pre_all_gather(mesh)``, which FSDP2 still accepts."""

    def fsdp_pre_all_gather(self, mesh):
        CALLS["pre_old"] += 1
        return (self._data, torch.full((1,), Tagged.tag, dtype=torch.int64)), (None, Tagged.tag)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return OldSignature(inner["_data"])


class Released(Tagged):
    """Builds its unsharded tensor as a copy of the gathered data and says so with torch 2.15's
    optional hook: the all-gather outputs may be freed right after ``fsdp_post_all_gather``."""

    def fsdp_should_release_all_gather_outputs_after_post_all_gather(self) -> bool:
        return True

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        data, tags = outputs
        assert tags.tolist() == [metadata[1]] * tags.numel(), f"tags arrived as {tags.tolist()}"
        if out is not None:
            CALLS["post_out"] += 1
            out.data.copy_(data)  # out is the parameter built the first time: refill it
            return None
        CALLS["post"] += 1
        copy = data.clone()
        return copy, (copy,)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Released(inner["_data"])


class UserComm:
    """FSDP2's AllGather / ReduceScatter shape (``set_custom_all_gather`` /
    ``set_custom_reduce_scatter``) over torch.distributed, counting its calls and allocations."""

    def __init__(self, kind: str) -> None:
        self.kind, self.calls, self.allocated = kind, 0, []

    def allocate(self, size, *, dtype, device):
        self.allocated.append(tuple(size))
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        self.calls += 1
        if self.kind == "all_gather":
            return torch.distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        return torch.distributed.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
