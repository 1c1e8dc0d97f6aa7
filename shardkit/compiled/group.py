"""Compiled mode's groups: one ``fully_shard`` call's parameters, their buckets, and the class
its modules take on."""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from shardkit.comm.collectives import backend_of, dim_name
from shardkit.compiled.forward_state import Forwarding
from shardkit.dtensor import extension
from shardkit.dtensor.sharded_param import ShardedParam, backs
from shardkit.core import reduction
from shardkit.core.options import GroupOptions
from shardkit.core.policies import MixedPrecisionPolicy


_BY_UID: "weakref.WeakValueDictionary[str, CompiledGroup]" = weakref.WeakValueDictionary()


def groups_alive() -> int:
    """How many compiled-mode groups exist in the process."""
    return len(_BY_UID)


def by_uid(uid: str) -> "CompiledGroup":
    """The group whose ``uid`` this is: what a call that dynamo puts in the graph as one op
    (``allow_in_graph``: ``gather._bucket_gathered``, ``unused._read``) takes instead of the
    group, an object it cannot hold."""
    return _BY_UID[uid]


@dataclass
class GraphBucket:
    """The parameters of a group whose gradients travel in one reduce-scatter of the graph, with
    the same grad-presence column as eager mode's (``reduced_numel``): the whole group where it
    has one dtype, one param dtype and one reduce dtype (then the bucket's all-gather is the
    same autograd function's forward), else one per reduce dtype, which only carries the
    gradients (``carrier``; the group gathers apart: ``CompiledGroup.make_buckets``)."""

    numels: list[int]  # padded shard elements per parameter
    dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    owner: "CompiledGroup | None" = None  # weights tied to an earlier call's: reduced with its settings
    # The group gathers apart: this bucket gathers nothing, its rows (zeros, no memory) carry the
    # gradients of what the group's one all-gather made (gather._gathered_apart)
    carrier: bool = False
    copies: tuple["Copy", ...] = ()  # per parameter, in order: its index and what the gather reads of its layout

    @property
    def indices(self) -> list[int]:
        """Its parameters, as indices into the group's params (outside the graph: traced code reads ``copies``)."""
        return [c.index for c in self.copies]

    @property
    def differentiable(self) -> bool:
        """Floating point or complex. An integer parameter (frozen: torch allows no other) gets
        no gradient: its bucket's leaves (``CompiledGroup._leaf``) take none either."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    @property
    def reduced_numel(self) -> int:
        """One rank's part of the reduce-scatter: its rows, then one grad-presence count per parameter."""
        return sum(self.numels) + len(self.copies)


@dataclass(frozen=True)
class GraphComm:
    """One mesh dim a group's collectives run over: its process group's name (what the
    functional collectives take), its ranks, its name (for the trace), and whether it is gloo
    (whose reduce-scatter is slow: gather.py reduces with an all-to-all and a sum, as eager mode)
    or averages (NCCL: ``ReduceOp.AVG``, core/reduction.py's ``reduce_ops``). Eager mode's
    ``Comm`` holds the process group and the streams its runtime issues on; a graph takes the
    group's name alone, in a frozen value that dynamo guards on as a constant. Both read the
    backend's facts and the dim's name from the same functions (``backend_of``, ``dim_name``)."""

    pg_name: str
    world: int
    mesh_dim: str
    gloo: bool = False
    averages: bool = False

    @staticmethod
    def of(mesh: DeviceMesh, dim: int) -> "GraphComm":
        name = dim_name(mesh, dim)
        pg = mesh.get_group(dim)
        gloo, averages, _ = backend_of(pg)
        return GraphComm(pg.group_name, mesh.size(dim), name, gloo, averages and mesh.size(dim) > 1)


@dataclass(frozen=True)
class PostForward:
    """``reshard_after_forward=R``: the two process groups of the forward's all-gather (gather.py).
    ``across``: the shard dim's ranks equal to this one modulo R (world / R of them); what they
    gather is what this rank keeps after forward, 1/R of the group. ``within``: R consecutive
    ranks (eager's post-forward ranks, "dp/R" in the trace), which gather the rest in forward and
    all of it again in backward."""

    across: GraphComm
    within: GraphComm

    def __iter__(self):
        return iter((self.across, self.within))

    @staticmethod
    def of(mesh: DeviceMesh, shard: GraphComm) -> "PostForward":
        across, within = GraphComm.of(mesh, mesh.ndim - 2), GraphComm.of(mesh, mesh.ndim - 1)
        return PostForward(replace(across, mesh_dim=f"{shard.mesh_dim}%{within.world}"), replace(within, mesh_dim=f"{shard.mesh_dim}/{within.world}"))


class CompiledGroup:
    """One ``fully_shard`` call in compiled mode: its parameters (a ``ShardedParam`` each, for
    the layout), where the modules register them, and the gathered tensors while its forward runs."""

    def __init__(self, modules: tuple[nn.Module, ...], params: list[ShardedParam], mesh: DeviceMesh, reshard_after_forward: bool | None,
                 mp_policy: MixedPrecisionPolicy, watch: Any, owners: dict[int, "CompiledGroup"] | None = None, post_forward_mesh: DeviceMesh | None = None) -> None:
        """``watch``: an ``unused.Watch``. ``owners``: the parameters (by index) that are weights tied to an earlier call's, and
        that call's group. ``post_forward_mesh``: ``reshard_after_forward=R``'s
        (``meshes.post_forward_split``)."""
        self.modules, self.params, self.mesh, self.mp_policy = modules, params, mesh, mp_policy  # mesh: 1-D, or 2-D (replicate, shard)
        self.dp_ranks = mesh.size()  # (read here once: the traced forward reads no mesh)
        self.owners = owners or {}
        self.owner_index = {i: owner.params.index(params[i]) for i, owner in self.owners.items()}  # (the parameter in its owner's)
        self.name = ""  # the modules' FQN under the outermost fully_shard call so far ("" for it)
        self.shard_comm = GraphComm.of(mesh, mesh.ndim - 1)  # all-gather and reduce-scatter
        self.replicate_comm = GraphComm.of(mesh, 0) if mesh.ndim == 2 else None  # HSDP: the gradients' all-reduce
        self.options = GroupOptions(reshard_after_forward)  # the knobs (core/options.py), as eager mode's; written by their setters
        # parameters that all-gather themselves: what their fsdp_pre_all_gather takes (the shard dim's 1-D mesh)
        self.extension_mesh = extension.shard_mesh(mesh) if any(p.extension is not None for p in params) else None
        self.hook_arity = {i: extension.pre_all_gather_arity(p.sharded_param._local_tensor) for i, p in enumerate(params) if p.extension is not None}
        # reshard_after_forward=R: the forward's all-gather in two steps, (ranks equal modulo R, R consecutive ranks)
        self.post_forward: PostForward | None = PostForward.of(post_forward_mesh, self.shard_comm) if post_forward_mesh is not None else None
        # whether it is in effect: set_reshard_after_forward replaces it, and the meshes stay for a
        # backward that recomputes a forward which gathered in two steps
        self.two_step = self.post_forward is not None
        self.parent: CompiledGroup | None = None  # the fully_shard call around this one
        self.is_root = True  # no parent; what the graph reads (a bool: reaching the parent group from the child's
        # group gives dynamo a second path to it, and one more guard that both are the same object)
        self.forward = Forwarding()  # its forward's state and, while gathered, the tensors the modules read (forward_state.py)
        # A group of several modules (fully_shard([a, b])) directly inside another call: gathered at the first of its
        # modules' forwards, held while its parent's forward runs, as eager mode keeps it from the first of them to the
        # last: one all-gather per forward, not one per module
        self.spanning: list[CompiledGroup] = []  # such groups directly inside this one
        self.lent: set[int] = set()  # parameters a later call gathers too (a weight tied across calls)
        # what the graph's calls name the group by (by_uid); a string: an int that differs between two
        # models' groups would turn symbolic when dynamo compiles the second (automatic dynamic)
        self.uid = f"group-{id(self)}"
        _BY_UID[self.uid] = self
        self.watch = watch  # unused.py: which parameters a forward did not read, and their gradients held back
        self.region = False  # its forward runs as a nested compile region (region.py)
        self._unreduced: dict[int, torch.Tensor] = {}  # bucket -> the leaf whose .grad keeps its unsynced gradients
        self._partial: dict[int, torch.Tensor] = {}  # bucket -> the leaf whose .grad keeps its sums not all-reduced (HSDP)
        self._presence: dict[int, torch.Tensor] = {}  # bucket -> the leaf whose .grad gets the ranks that used each parameter
        self._kept: dict[int, torch.Tensor] = {}  # bucket -> the leaf whose .grad keeps its all-gather output after backward
        self.leaves: list[torch.Tensor | None] = []  # per parameter, the graph's input (make_leaves, once the modules register them; leaf)
        self.make_buckets()

    @property
    def hsdp(self) -> bool:
        """A replicate dim, of any size: ``set_requires_all_reduce(False)`` keeps the sums (as
        FSDP2 keeps them, even for one replica), whether or not an all-reduce runs."""
        return self.replicate_comm is not None

    @property
    def all_reduces(self) -> bool:
        """HSDP with more than one replica: the reduced gradients are all-reduced over them."""
        return self.replicate_comm is not None and self.replicate_comm.world > 1

    @property
    def divide_by(self) -> float:
        """What the summed gradients are divided by (core/reduction.py's rule, as eager mode's)."""
        return float(reduction.divide_by(self.options, self.dp_ranks))

    def named(self, fqn: str) -> None:
        """Its modules' FQN under the outermost fully_shard call so far."""
        self.name = fqn

    def lend(self, i: int) -> None:
        """A later call gathers parameter ``i`` too (a weight tied across calls)."""
        self.lent.add(i)

    def run_as_region(self, region: bool) -> None:
        """Whether its forward runs as a nested compile region (region.py chooses)."""
        self.region = region

    def drop_two_step(self) -> None:
        """``set_reshard_after_forward(bool)`` replaces an int: forward gathers in one step (the
        meshes stay, for a backward that recomputes a forward which gathered in two)."""
        self.two_step = False

    def unreduced_leaf(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s leaf for backwards without sync: autograd sums their unsharded gradients
        (in reduce_dtype, with the grad-presence columns: ``(world, per_rank + n)``) into its
        ``.grad``. One element of memory, broadcast: the gradient is the only full-size tensor."""
        return self._leaf(self._unreduced, b, self.buckets[b].reduced_numel * self.shard_comm.world)

    def partial_leaf(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s leaf for HSDP backwards without the all-reduce: autograd sums their
        reduce-scattered gradients (this rank's rows and the presence counts, undivided, in
        reduce_dtype) into its ``.grad``."""
        return self._leaf(self._partial, b, self.buckets[b].reduced_numel)

    def presence_leaf(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s leaf whose ``.grad`` gets, per parameter, how many ranks used it
        (divided as the gradients are: only whether it is zero counts; unused.py)."""
        return self._leaf(self._presence, b, len(self.buckets[b].copies))

    def registered(self) -> list[torch.Tensor]:
        """The sharded parameters as the modules hold them now (``.to()`` may have swapped them)."""
        return [p.slots[0].module._parameters[p.slots[0].name] for p in self.params]

    def registered_at(self, i: int) -> torch.Tensor:
        """Parameter ``i`` as the modules hold it now."""
        slot = self.params[i].slots[0]
        return slot.module._parameters[slot.name]

    def inputs(self) -> tuple[torch.Tensor, ...]:
        """The graph's inputs (traced): each parameter's leaf, detached where the parameter
        does not require grad (dynamo guards on that flag: freezing a parameter, or unfreezing
        it, compiles one more graph, and its gradient follows it, as in eager mode). The flag is
        read from ``sharded_param``, which ``follow_registered`` keeps what the modules hold:
        reading it through the modules (``registered``) gave dynamo a second path to each module
        and to the parameters' properties, each one more guard that two paths reach one object
        (and each guard costs time to build)."""
        leaves = self.leaves if not self.owners else [self.leaf(i) for i in range(len(self.params))]
        return tuple(leaf if p.sharded_param.requires_grad else leaf.detach() for leaf, p in zip(leaves, self.params))

    def leaf(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s leaf: a weight tied to an earlier call's takes that call's, so that
        autograd sums the two calls' gradients into one, and its hooks run once."""
        owner = self.owners.get(i)
        return self.leaves[i] if owner is None else owner.leaves[self.owner_index[i]]

    def make_leaves(self) -> None:
        """Per parameter, its padded shard (``ShardedParam.padded_shard``: the all-gather's
        input, whose real rows the DTensor's local tensor views) as a plain leaf tensor that
        requires grad: what the graph takes instead of the DTensor. A DTensor input costs
        AOTAutograd a subclass unwrap at every call and dynamo more to trace (docs/design.md,
        "What the graph takes and gives: leaves and hooks"; the measurement:
        benchmarks/README.md); the padded shard needs no padding rows made in the graph, and
        every rank's graph takes the same shapes. The leaf shares the shard's storage (the
        optimizer's in-place steps reach it); its gradient's real rows move to the parameter's
        ``.grad`` (``_to_param``). A parameter that all-gathers itself (dtensor/extension.py)
        gives its local tensor, which its hooks read. Made again wherever the registered
        parameters change (module.py: ``.to()``, ``setattr``, ``load_state_dict``)."""
        self.leaves = []
        for i, param in enumerate(self.registered()):
            if i in self.owners:
                self.leaves.append(None)  # a weight tied to an earlier call's: its owner's leaf
                continue
            if not isinstance(param, DTensor):
                raise ValueError(f"shardkit.compiled: parameter '{self.params[i].fqn}' is a {type(param).__name__}, no longer the DTensor "
                                 "fully_shard made; assign a DTensor sharded as it was (load_state_dict turns full tensors into one).")
            p = self.params[i]
            plain = p.extension is None and backs(p.padded_shard, param._local_tensor)
            leaf = (p.padded_shard if plain else param._local_tensor).detach()
            if leaf.is_floating_point() or leaf.is_complex():
                leaf.requires_grad_()
                leaf.register_post_accumulate_grad_hook(functools.partial(_to_param, self, i))
            self.leaves.append(leaf)

    def kept_leaf(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s leaf for backwards that do not reshard (``set_reshard_after_backward(False)``):
        its ``.grad`` gets the bucket's all-gather output ``(world * per_rank,)`` in param_dtype,
        which the next forward uses instead of all-gathering (``kept``)."""
        return self._leaf(self._kept, b, sum(self.buckets[b].numels) * self.shard_comm.world, self.buckets[b].param_dtype)

    def kept(self, b: int, take: bool) -> torch.Tensor | None:
        """Bucket ``b``'s all-gather output that a backward kept (None if none, or if an optimizer
        step, ``load_state_dict`` or ``reshard()`` dropped it since); ``take``: forgotten here (a
        forward with grad: its backward keeps it again, or frees it)."""
        leaf = self._kept.get(b)
        return _take(leaf) if take else (leaf.grad if leaf is not None else None)

    def holds_any(self, ids: set[int]) -> bool:
        """Whether an optimizer stepping on the parameters ``ids`` steps on ours (core/steps.py)."""
        return any(id(param) in ids for param in self.registered())

    def shards_changed(self) -> None:
        """An optimizer stepped on our shards: what a backward kept is stale."""
        self.drop_kept()

    def drop_kept(self) -> None:
        """The shards changed, or ``reshard()``: the next forward all-gathers again."""
        for leaf in self._kept.values():
            leaf.grad = None

    def _leaf(self, leaves: dict[int, torch.Tensor], b: int, numel: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if b not in leaves:
            bucket, p = self.buckets[b], self.params[self.buckets[b].copies[0].index]
            dtype = (bucket.reduce_dtype if bucket.differentiable else torch.float32) if dtype is None else dtype
            leaves[b] = torch.zeros((), dtype=dtype, device=p.device).expand(numel).detach().requires_grad_(bucket.differentiable)
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
        self.parent, self.is_root = parent, False
        if len(self.modules) > 1:
            parent.spanning.append(self)

    def check_movable(self) -> None:
        """Raises if backwards without sync (or without the all-reduce) kept gradients: a new
        layout would drop them."""
        if any(leaf.grad is not None for leaf in (*self._unreduced.values(), *self._partial.values())):
            raise RuntimeError(f"shardkit.compiled: {self.name or 'the root'} holds gradients kept without sync or without the all-reduce; "
                               "run a backward with set_requires_gradient_sync(True) and set_requires_all_reduce(True) before moving the model.")

    def make_buckets(self) -> None:
        """The buckets, by eager mode's rule (``comm/buckets.py``): one reduce-scatter per reduce
        dtype and one all-gather for the group. Where every parameter has one dtype, one param
        dtype and one reduce dtype (most groups), one bucket of them all-gathers and
        reduce-scatters in one autograd function. Otherwise (mixed dtypes, parameters that
        all-gather themselves) the group gathers apart (``gathers_apart``): its buckets, one per
        reduce dtype in the order of their first parameters, only carry the gradients, and ONE
        all-gather of the group (bytes where the param dtypes differ) makes the parameters
        (``gather._gathered_apart``). Weights tied to an earlier call's are a bucket of their
        own, reduced with that call's settings."""
        self.check_movable()
        self._unreduced, self._partial, self._presence, self._kept = {}, {}, {}, {}  # (what was kept is gathered again)
        own = [p for i, p in enumerate(self.params) if i not in self.owners]
        self.gathers_apart = self.extension_mesh is not None or len({(p.dtype, p.param_dtype, p.reduce_dtype) for p in own}) > 1
        buckets: dict[tuple, GraphBucket] = {}
        for i, p in enumerate(self.params):
            owner = self.owners.get(i)
            if self.gathers_apart and owner is None:  # a carrier: its rows in reduce_dtype
                key = (p.reduce_dtype, p.reduce_dtype, p.reduce_dtype, None, True)
            else:
                key = (p.dtype, p.param_dtype, p.reduce_dtype, owner, self.gathers_apart)
            bucket = buckets.setdefault(key, GraphBucket([], *key))
            bucket.numels.append(p.shard_numel)
            bucket.copies += (Copy.of(i, p),)
        self.buckets = list(buckets.values())
        for b in range(len(self.buckets)):
            self.presence_leaf(b)  # made here, outside any compiled region
            if not self.options.reshard_after_backward:
                self.kept_leaf(b)

    def apart_pieces(self) -> tuple[torch.dtype, int]:
        """What one rank sends in the all-gather of a group that gathers apart, none of whose
        parameters all-gathers itself: (its dtype, elements): the padded shards in param dtype,
        as bytes where those differ (eager mode's ``GatherBucket``)."""
        dtypes = {p.param_dtype for p in self.params}
        if len(dtypes) == 1:
            return dtypes.pop(), sum(p.shard_numel for p in self.params)
        return torch.uint8, sum(p.shard_numel * p.param_dtype.itemsize for p in self.params)


class Copy(NamedTuple):
    """What the gather of a graph needs of one parameter's layout, in plain values: dynamo reads
    a bucket's as one constant (gather._copies) instead of guarding each field it reads."""

    index: int  # into the group's params
    padded_rows: int  # its shard's rows with padding: the all-gather's input
    shape: tuple[int, ...]  # the all-gather output's column for it as a tensor (layout.unsharded_padded_shape)
    keep: int  # its rows (dim 0) of that, or -1 where there is no padding row to cut
    tp: bool  # tensor parallel: the parameter is a DTensor again (gather._unsharded)

    @staticmethod
    def of(i: int, p: ShardedParam) -> "Copy":
        full, rows = p.layout.unsharded_padded_shape, p.layout.shape[0]
        return Copy(i, p.layout.padded_rows, tuple(full), rows if full[0] != rows else -1, p.tp_spec is not None)


def _to_param(group: CompiledGroup, i: int, leaf: torch.Tensor) -> None:
    """Leaf ``i``'s gradient, reduced by the graph, into its parameter's ``.grad`` (as a
    DTensor; added where one is there), then the parameter's post-accumulate-grad hooks, as
    eager mode and FSDP2 give them (``ShardedParam.set_sharded_grad``)."""
    grad, leaf.grad = leaf.grad, None
    p, param = group.params[i], group.registered_at(i)
    if param is not p.sharded_param or not _shares_storage(leaf, param._local_tensor):
        raise RuntimeError(f"shardkit.compiled: parameter '{p.fqn}' holds a tensor its group did not see (replaced other than by "
                           "setattr, load_state_dict or .to()): this gradient is for the tensor it held. Replace parameters by one of those.")
    if not param.requires_grad or grad is None:
        return
    if grad.shape[0] != p.local_rows:  # a padded leaf (make_leaves): the real rows
        grad = p._valid(grad)
    if not group.watch.holds_back(i, grad):  # (watched: whether any rank used it is known at the end of backward)
        p.set_sharded_grad(grad)


def _shares_storage(leaf: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether ``leaf`` still holds ``local``'s data (``backs``; not told for a tensor subclass:
    a float8 weight's storage is its inner tensors')."""
    return type(leaf) is not torch.Tensor or type(local) is not torch.Tensor or backs(leaf, local)


def _take(leaf: torch.Tensor | None) -> torch.Tensor | None:
    if leaf is None or leaf.grad is None:
        return None
    kept = leaf.grad
    leaf.grad = None
    return kept
