"""Compiled mode's groups: one ``fully_shard`` call's parameters, their buckets, and the class
its modules take on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from shardkit.comm.collectives import backend_of
from shardkit.dtensor.sharded_param import ShardedParam
from shardkit.policies import MixedPrecisionPolicy


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
    owner: "CompiledGroup | None" = None  # weights tied to an earlier call's: reduced with its settings

    @property
    def reduced_numel(self) -> int:
        """One rank's part of the reduce-scatter: its rows, then one grad-presence count per parameter."""
        return sum(self.numels) + len(self.indices)


@dataclass(frozen=True)
class GraphComm:
    """One mesh dim a group's collectives run over: its process group's name (what the
    functional collectives take), its ranks, its name (for the trace), and whether it is gloo
    (whose reduce-scatter is slow: gather.py reduces with an all-to-all and a sum, as eager mode)."""

    pg_name: str
    world: int
    mesh_dim: str
    gloo: bool = False

    @staticmethod
    def of(mesh: DeviceMesh, dim: int) -> "GraphComm":
        name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else f"dim{dim}"
        pg = mesh.get_group(dim)
        return GraphComm(pg.group_name, mesh.size(dim), name, backend_of(pg)[0])


class CompiledGroup:
    """One ``fully_shard`` call in compiled mode: its parameters (a ``ShardedParam`` each, for
    the layout), where the modules register them, and the gathered tensors while its forward runs."""

    def __init__(self, modules: tuple[nn.Module, ...], params: list[ShardedParam], mesh: DeviceMesh, reshard_after_forward: bool | None,
                 mp_policy: MixedPrecisionPolicy, owners: dict[int, "CompiledGroup"] | None = None) -> None:
        """``owners``: the parameters (by index) that are weights tied to an earlier call's, and that call's group."""
        self.modules, self.params, self.mesh, self.mp_policy = modules, params, mesh, mp_policy  # mesh: 1-D, or 2-D (replicate, shard)
        self.owners = owners or {}
        self.name = ""  # the modules' FQN under the outermost fully_shard call so far ("" for it)
        self.shard = GraphComm.of(mesh, mesh.ndim - 1)  # all-gather and reduce-scatter
        self.replicate = GraphComm.of(mesh, 0) if mesh.ndim == 2 else None  # HSDP: the gradients' all-reduce
        self.reshard_after_forward = reshard_after_forward  # None: True unless this is the root
        self.parent: CompiledGroup | None = None  # the fully_shard call around this one
        self.divide_factor: float | None = None  # set_gradient_divide_factor; None: the ranks
        self.requires_gradient_sync = True  # set_requires_gradient_sync
        self.requires_all_reduce = True  # set_requires_all_reduce (HSDP)
        self.gathered: list[torch.Tensor] | None = None  # while the group's forward runs
        self.marks: list[torch.Tensor] = []  # with them: each parameter's mark (unused.py)
        self.lent: set[int] = set()  # parameters a later call gathers too (a weight tied across calls)
        self.uid = id(self)  # unused.register
        self.reads: set[int] = set()  # unused.py: what the forward being traced read,
        self.unread: set[int] = set()  # what some traced forward did not read (watched),
        self.hooked: dict[int, torch.Tensor] = {}  # bucket -> its presence leaf with the hook that checks them,
        self.last_grads: dict[int, Any] = {}  # the .grad each had after the last check (a weakref),
        self.check_queued = False  # and whether the check at the end of backward is queued
        self.region = False  # its forward runs as a nested compile region (region.py)
        self._unreduced: dict[int, torch.Tensor] = {}  # bucket -> the leaf whose .grad keeps its unsynced gradients
        self._partial: dict[int, torch.Tensor] = {}  # bucket -> the leaf whose .grad keeps its sums not all-reduced (HSDP)
        self._presence: dict[int, torch.Tensor] = {}  # bucket -> the leaf whose .grad gets the ranks that used each parameter
        self.make_buckets()

    @property
    def all_reduces(self) -> bool:
        """HSDP with more than one replica: the reduced gradients are all-reduced over them."""
        return self.replicate is not None and self.replicate.world > 1

    @property
    def divide_by(self) -> float:
        """What the summed gradients are divided by: the data-parallel ranks, or the user's factor."""
        return self.divide_factor if self.divide_factor is not None else float(self.mesh.size())

    def unreduced_leaf(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s leaf for backwards without sync: autograd sums their unsharded gradients
        (in reduce_dtype, with the grad-presence columns: ``(world, per_rank + n)``) into its
        ``.grad``. One element of memory, broadcast: the gradient is the only full-size tensor."""
        return self._leaf(self._unreduced, b, self.buckets[b].reduced_numel * self.shard.world)

    def partial_leaf(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s leaf for HSDP backwards without the all-reduce: autograd sums their
        reduce-scattered gradients (this rank's rows and the presence counts, undivided, in
        reduce_dtype) into its ``.grad``."""
        return self._leaf(self._partial, b, self.buckets[b].reduced_numel)

    def presence_leaf(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s leaf whose ``.grad`` gets, per parameter, how many ranks used it
        (divided as the gradients are: only whether it is zero counts; unused.py)."""
        return self._leaf(self._presence, b, len(self.buckets[b].indices))

    def _leaf(self, leaves: dict[int, torch.Tensor], b: int, numel: int) -> torch.Tensor:
        if b not in leaves:
            bucket, p = self.buckets[b], self.params[self.buckets[b].indices[0]]
            leaves[b] = torch.zeros((), dtype=bucket.reduce_dtype, device=p.device).expand(numel).detach().requires_grad_()
        return leaves[b]

    def take_unreduced(self, b: int) -> torch.Tensor | None:
        """What backwards without sync kept for bucket ``b`` (None if nothing), forgotten here:
        the next backward adds it to its gradient before the reduce-scatter."""
        return _take(self._unreduced.get(b))

    def take_partial(self, b: int) -> torch.Tensor | None:
        """What HSDP backwards without the all-reduce kept for bucket ``b`` (None if nothing),
        forgotten here: the next backward with it adds them before its all-reduce."""
        return _take(self._partial.get(b))

    def nest_in(self, parent: "CompiledGroup") -> None:
        """A later ``fully_shard`` call on a module around ours: it is our parent."""
        self.parent = parent

    def make_buckets(self) -> None:
        """The parameters by (dtype, param dtype, reduce dtype, owner): one collective each."""
        if any(leaf.grad is not None for leaf in (*self._unreduced.values(), *self._partial.values())):
            raise RuntimeError(f"shardkit.compiled: {self.name or 'the root'} holds gradients kept without sync or without the all-reduce; "
                               "run a backward with set_requires_gradient_sync(True) and set_requires_all_reduce(True) before moving the model.")
        self._unreduced, self._partial, self._presence = {}, {}, {}
        buckets: dict[tuple, GraphBucket] = {}
        for i, p in enumerate(self.params):
            key = (p.dtype, p.param_dtype, p.reduce_dtype, self.owners.get(i))
            bucket = buckets.setdefault(key, GraphBucket([], [], *key))
            bucket.indices.append(i)
            bucket.numels.append(p.shard_numel)
        self.buckets = list(buckets.values())
        for b in range(len(self.buckets)):
            self.presence_leaf(b)  # made here, outside any compiled region


def _take(leaf: torch.Tensor | None) -> torch.Tensor | None:
    if leaf is None or leaf.grad is None:
        return None
    kept = leaf.grad
    leaf.grad = None
    return kept
