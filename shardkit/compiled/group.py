"""Compiled mode's groups: one ``fully_shard`` call's parameters, their buckets, and the class
its modules take on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.dtensor.sharded_param import ShardedParam
from shardkit.policies import MixedPrecisionPolicy


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


