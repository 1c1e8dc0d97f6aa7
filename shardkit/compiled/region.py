"""Compiled mode's repeated blocks, compiled once: a group's gather and its module's forward
as one ``torch.compiler.nested_compile_region``.

Dynamo traces the region the first time a structure is called, and every later block of the
same structure calls the same subgraph (``invoke_subgraph``): AOTAutograd partitions it and
inductor compiles it once, for the whole graph. The region holds the group's all-gather (with
the selective checkpoint that recomputes it in backward, so ``reshard_after_forward`` holds)
and its module's forward; its backward holds the reduce-scatter. A region of only the compute
would keep every block's unsharded parameters for backward: what crosses a region's boundary
and backward needs is saved, the partitioner cannot recompute it.

Two blocks share a region when ``_region_id`` gives them the same key (``reuse_hash_fn``):
their modules' classes, plain attributes, parameters and buffers (names, shapes, dtypes),
training flags, the group's mesh, buckets and settings, and the call's arguments, positional
and keyword (``_described``). Dynamo's own reuse test is not enough: it reused a block that
differed only in ``n_head``, a plain attribute, and computed a wrong loss. A call with an
argument that is neither a tensor nor a constant (``callable_with``) runs inline.

What a region costs: the all-gather of a block is issued inside its region, so the overlap
pass (overlap.py) cannot issue it during the previous block's compute, nor wait for a
reduce-scatter after the next block's backward. That is the trade, and the root's
``fully_shard`` makes it only where compile time is what hurts (``choose``): for the blocks of a
structure at least ``REGIONS_FROM`` blocks share (a module attribute users may set before that
call: 1, always; a large number, never).

The trace op (an ordered effect) is not in the region: inside one, AOTAutograd dropped the
region's backward (wrong gradients, no error). The region's collectives are recorded around
the region call instead: the all-gathers issued before it and done after it, the
reduce-scatters (and HSDP's all-reduces) issued and done when its backward has run.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from shardkit.compiled import unused
from shardkit.compiled.gather import KEPT, Settings, gather_inputs, gathered, reduction_ops, reused
from shardkit.compiled.group import CompiledGroup

REGIONS_FROM = 8  # blocks of one structure from which fully_shard compiles them as regions


def _block(module: nn.Module, *flat: Any, **kwargs: Any) -> Any:
    """The region: gather the group's parameters, run the module's own forward. ``flat``: the
    call's arguments as ``_flat`` lays them out; ``kwargs``: the module's keyword arguments."""
    group: CompiledGroup = module.__dict__["_shardkit_state"]
    settings, shards, kept, args = _unflat(group, flat)
    unused.forward_begins(group)
    group.forward.begin(lambda: gathered(group, settings, shards, kept, traced=False))
    try:
        output = type(module)._shardkit_plain_forward(module, *args, **kwargs)
    finally:
        group.forward.end()
    unused.forward_ends(group, module, _key(module, *flat, **kwargs))
    return output


def _flat(settings: Settings, shards: tuple, kept: tuple, args: tuple) -> tuple:
    """A region call's arguments after the module, in one flat tuple: the settings' fields, the
    shards, what ``gather_inputs`` keeps, the module's arguments. Dynamo fingerprints a call
    whose arguments are all tensors, constants (None too) and modules at once; nested tuples
    it flattens with an inlined pytree, a cost paid again for every block."""
    return (*settings, *shards, *kept, *args)


def _unflat(group: CompiledGroup, flat: tuple) -> tuple[Settings, tuple, tuple, tuple]:
    """``_flat``'s inverse: (settings, shards, kept, args); the group says how many of each."""
    s, n, k = len(Settings._fields), len(group.params), len(KEPT) * len(group.buckets)
    return Settings(*flat[:s]), flat[s : s + n], flat[s + n : s + n + k], flat[s + n + k :]


def _key(module: nn.Module, *flat: Any, **kwargs: Any) -> int:
    group = module.__dict__["_shardkit_state"]
    settings, _, kept, args = _unflat(group, flat)
    inputs = (_described(tuple(args)), _described(dict(kwargs)))
    held = tuple(k is not None for k in kept)  # the kept sums (or leaves) the region takes
    return _region_id(group, (tuple(settings), held, inputs, torch.is_grad_enabled()))


def _described(x: Any) -> Any:
    """What of a module's argument the region's code may depend on: a tensor's shape, strides,
    dtype and requires_grad, a constant's value (None, bools, numbers, strings), a tuple's,
    list's or dict's (string keys) items so described; None where it holds anything else."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), tuple(x.stride()), str(x.dtype), x.requires_grad)
    if x is None or isinstance(x, (bool, int, float, str)):
        return repr(x)
    if isinstance(x, (tuple, list)):
        items = tuple(_described(v) for v in x)
        return None if any(d is None for d in items) else (type(x).__name__, items)
    if isinstance(x, dict) and all(isinstance(k, str) for k in x):
        items = tuple((k, _described(x[k])) for k in sorted(x))
        return None if any(d is None for _, d in items) else ("dict", items)
    return None


def callable_with(args: tuple, kwargs: dict) -> bool:
    """Whether a region may take these arguments: ``_described`` describes them all. Any other
    object (a key-value cache, say) may be written to by the module, which a region, traced
    once and called again, would not do again: the module then runs inline."""
    return _described(tuple(args)) is not None and _described(dict(kwargs)) is not None


_REGION_IDS: dict[tuple, int] = {}


@torch.compiler.assume_constant_result
def _region_id(group: CompiledGroup, call: tuple) -> int:
    """One int per (structure, settings, inputs): dynamo runs this while tracing (not in the graph)."""
    key = (structure(group.modules[0]), group_layout(group), call)
    return _REGION_IDS.setdefault(key, len(_REGION_IDS))


_region = torch.compiler.nested_compile_region(_block, reuse_hash_fn=_key)


def structure(module: nn.Module) -> tuple:
    """What makes two modules the same code: per submodule its class, training flag and plain
    attributes, and every parameter's and buffer's name, shape and dtype."""
    parts: list[Any] = []
    for name, m in module.named_modules():
        cls = next(c for c in type(m).__mro__ if "_shardkit_generated" not in c.__dict__ and not issubclass(c, TorchFSDPModule))  # the user's class
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, (int, float, bool, str, tuple, type(None)))))
        parts.append((name, f"{cls.__module__}.{cls.__qualname__}", m.training, attrs))
    for kind, tensors in (("p", module.named_parameters()), ("b", module.named_buffers())):
        parts += [(kind, n, tuple(t.shape), str(t.dtype), t.requires_grad) for n, t in tensors]
    return tuple(parts)


def group_layout(group: CompiledGroup) -> tuple:
    """What of the group the region's code holds as constants."""
    buckets = tuple((tuple(b.indices), tuple(b.numels), str(b.param_dtype), str(b.reduce_dtype)) for b in group.buckets)
    params = tuple((p.padded_rows, tuple(p.layout.unsharded_padded_shape), p.shape[0]) for p in group.params)
    replicate = (group.replicate_comm.pg_name, group.replicate_comm.world) if group.replicate_comm is not None else None
    post_forward = tuple((c.pg_name, c.world) for c in group.post_forward) if group.two_step else None
    return (group.shard_comm.pg_name, group.shard_comm.world, replicate, post_forward, buckets, params, str(group.mp_policy))


def eligible(group: CompiledGroup) -> bool:
    """A group can run as a region: one module, not the root, no tensor-parallel parameters,
    none that all-gathers itself, no weight tied to another call's, no other fully_shard call
    inside it."""
    if len(group.modules) != 1 or group.parent is None or group.owners or any(p.tp_spec is not None or p.extension is not None for p in group.params):
        return False
    module = group.modules[0]
    return all(m.__dict__.get("_shardkit_state") in (None, group) for m in module.modules())


def choose(groups: list[CompiledGroup]) -> None:
    """Which of the groups under one fully_shard call run as regions: the eligible ones of a
    structure at least ``REGIONS_FROM`` of them share."""
    by_structure: dict[tuple, list[CompiledGroup]] = {}
    for group in groups:
        group.run_as_region(False)
        if eligible(group):
            by_structure.setdefault((structure(group.modules[0]), group_layout(group)), []).append(group)
    for same in by_structure.values():
        for group in same if len(same) >= REGIONS_FROM else ():
            group.run_as_region(True)
    if any(group.region for group in groups):
        _no_buffer_reuse()
        _schema_once_per_subgraph()


def _no_buffer_reuse() -> None:
    """Inductor (torch 2.13) reuses the buffer of a region's input for a new buffer while the
    region's output that aliases it (a saved input) is still to be read: wrong gradients, no
    error, even for an unsharded GPT with its blocks as regions. It also writes a kernel's
    output in place into an input's buffer (``inplace_buffers``) where a region still reads
    that input: wrong gradients again, for blocks that take a second tensor (the first layer's
    output, say), found with inductor on world 1 against eager mode. Without either the
    generated code frees each buffer after its last use and allocates new ones (the same peak;
    more calls to the allocator). Global inductor config, as overlap.install's."""
    from torch._inductor import config

    config.allow_buffer_reuse = False
    config.inplace_buffers = False


def _schema_once_per_subgraph() -> None:
    """AOTAutograd meets ``invoke_subgraph`` once per region call, and each time (torch 2.13,
    2.14) asks its schema, which traces the whole subgraph again (``materialize_as_graph``) to
    find whether it writes to an input: the region's body was traced once per block after all,
    and most of what regions save was spent there. The schema depends only on the subgraph
    (its graph, and the graphs inside it) and the operands' kinds and metadata, so it is kept
    per subgraph object and recomputed when either differs: the same answer, once. Global, as
    ``_no_buffer_reuse``."""
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    plain = InvokeSubgraphHOP.gen_schema
    if getattr(plain, "_shardkit_once", False):
        return
    schemas: "weakref.WeakKeyDictionary[torch.fx.GraphModule, dict]" = weakref.WeakKeyDictionary()

    @functools.wraps(plain)
    def gen_schema(self: Any, subgraph: Any, identifier: Any, *operands: Any) -> Any:
        key = _schema_key(subgraph, identifier, operands)
        if key is None:
            return plain(self, subgraph, identifier, *operands)
        known = schemas.setdefault(subgraph, {})
        if key not in known:
            known[key] = plain(self, subgraph, identifier, *operands)
        return known[key]

    gen_schema._shardkit_once = True  # type: ignore[attr-defined]
    InvokeSubgraphHOP.gen_schema = gen_schema


def _schema_key(subgraph: Any, identifier: Any, operands: tuple) -> tuple | None:
    """What ``invoke_subgraph``'s schema depends on, hashable; None where it cannot be told
    (not a GraphModule, symbolic sizes, a tensor without storage): then it is computed."""
    if not isinstance(subgraph, torch.fx.GraphModule):
        return None
    try:
        graphs = tuple(tuple((n.op, str(n.target), str(n.args), str(n.kwargs)) for n in m.graph.nodes)
                       for m in subgraph.modules() if isinstance(m, torch.fx.GraphModule))
        storages: dict[int, int] = {}  # which operands share storage: aliasing can matter
        metadata = []
        for i, o in enumerate(operands):
            if isinstance(o, torch.Tensor):
                storage = storages.setdefault(o.untyped_storage()._cdata, i)
                metadata.append((type(o), o.dtype, o.device, tuple(o.shape), o.stride(), o.storage_offset(), o.requires_grad, storage))
            else:
                metadata.append((type(o), o))
        key = (identifier, graphs, tuple(metadata))
        hash(key)
    except (TypeError, RuntimeError, NotImplementedError):
        return None
    return key


@torch.compiler.assume_constant_result
def allowed_here() -> bool:
    """Whether the frame dynamo traces may hold regions: only one that cannot break the graph
    (``fullgraph=True``, or ``torch._dynamo.error_on_graph_break``). A graph break inside a
    region is an error (``UncapturedHigherOrderOpError``), not a break, so under
    ``torch.compile``'s default a block that breaks the graph (an ``.item()`` branch) failed the
    compile; there the blocks run inline and break as they would unsharded. True outside a
    trace (compiled mode run without torch.compile). Runs while dynamo traces (``tls.current_tx``:
    dynamo's own record of the frame it traces).

    Nor a frame compiled with dynamic shapes (a batch of another sequence length makes dynamo
    compile again with a symbolic length): the region's key (``_key``) describes its inputs'
    sizes to ``_region_id``, a constant to dynamo, which cannot take a symbolic one, and the
    compile would fail ("reuse_hash_fn must be fully traceable"). Inside the
    trace a symbolic size passes for an int (``isinstance(d, torch.SymInt)`` is False there),
    so the frame's shape environment is asked whether it holds any symbol."""
    from torch._dynamo import symbolic_convert

    tx = getattr(symbolic_convert.tls, "current_tx", None)
    if tx is None:
        return True
    shape_env = getattr(tx.output, "shape_env", None)
    symbols = getattr(shape_env, "backed_var_to_val", None)  # torch 2.13; var_to_val before
    dynamic = bool(symbols if symbols is not None else getattr(shape_env, "var_to_val", None))
    return not dynamic and bool(getattr(tx, "one_graph", False) or getattr(tx, "error_on_graph_break", False))


def run(group: CompiledGroup, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The module's forward as a region call, with its collectives traced around it."""
    settings = Settings.of(group)
    shards, kept = gather_inputs(group, settings)
    if torch.is_grad_enabled():
        shards, kept = _watched(group, settings, shards, kept)
    skip = reused(group, kept)  # buckets that all-gather nothing
    _trace_gathers(group, settings, shards[0], skip, done=False)
    flat = _flat(settings, shards, kept, args)
    output = _region(module, *flat, **kwargs)
    unused.region_ran(group, _key(module, *flat, **kwargs))
    _trace_gathers(group, settings, shards[0], skip, done=True)
    return output


def _trace_gathers(group: CompiledGroup, settings: Settings, x: torch.Tensor, skipped: list[bool], done: bool) -> None:
    """The region's all-gathers (two steps each with ``reshard_after_forward=R``: gather.py)."""
    if group.shard_comm.world == 1:
        return
    steps = [(group.shard_comm, 1)] if not settings.post_forward else [(group.post_forward.across, 1), (group.post_forward.within, group.post_forward.across.world)]
    # per bucket, or the group's one where it gathers apart (no parameter of a region's group all-gathers itself)
    sends = [group.apart_pieces()] if group.gathers_apart else [(b.param_dtype, sum(b.numels)) for b, skip in zip(group.buckets, skipped) if not skip]
    for dtype, per_rank in sends:
        for comm, inputs_per_rank in steps:
            torch.ops.shardkit.trace_collective(x, "all_gather", group.name, comm.world, comm.mesh_dim, done, per_rank * inputs_per_rank, dtype)


def _watched(group: CompiledGroup, settings: Settings, shards: tuple, kept: tuple) -> tuple[tuple, tuple]:
    """The region's inputs, ready for its backward. Where it reduces nothing into the shards
    (``set_requires_gradient_sync(False)``, HSDP's ``set_requires_all_reduce(False)``: the sums
    are kept), they enter detached, so that their ``.grad`` stays None as in eager mode whatever
    a region's backward gives an input without a gradient (None on torch 2.13 with aot_eager).
    Where it reduce-scatters, ONE input that then gets a gradient (the first shard that requires
    one; HSDP without the all-reduce: the first bucket's leaf for the kept sums) passes through
    ``_Reductions``, which records the reductions. One, not every shard: dynamo's tracing of an
    autograd function grows with its inputs times its outputs."""
    if not settings.sync:
        return tuple(s.detach() for s in shards), kept  # nothing reduced, nothing to record
    if group.hsdp and not settings.all_reduce:  # the reduce-scattered sums go to the partial leaves
        i = len(group.buckets)  # gather_inputs's kept: unreduced, then partial, per bucket
        detached = tuple(s.detach() for s in shards)  # (frozen or not, all alike: the region reduces every parameter's rows)
        return detached, (*kept[:i], _Reductions.apply(group, settings, _reduced_numels(group, detached), kept[i]), *kept[i + 1 :])
    i = next((i for i, s in enumerate(shards) if s.requires_grad), None)
    if i is None:
        return shards, kept
    return (*shards[:i], _Reductions.apply(group, settings, _reduced_numels(group, shards), shards[i]), *shards[i + 1 :]), kept


def _reduced_numels(group: CompiledGroup, shards: tuple) -> list[int]:
    """Per bucket, one rank's part of its reduce-scatter: the whole bucket's, or, where frozen
    parameters sit beside trainable ones, the trainable ones' (gather.Cut)."""
    numels = []
    for bucket in group.buckets:
        trains = [shards[c.index].requires_grad for c in bucket.copies]
        kept = [n for n, t in zip(bucket.numels, trains) if t] if any(trains) else bucket.numels
        numels.append(sum(kept) + len(kept))
    return numels


class _Reductions(torch.autograd.Function):
    """The identity on one input of a region (``_watched``). Its backward runs when the
    region's backward has reduced the gradients: it records those reductions."""

    @staticmethod
    def forward(ctx: Any, group: CompiledGroup, settings: Settings, numels: list[int], watched: torch.Tensor) -> torch.Tensor:
        ctx.group, ctx.settings, ctx.numels = group, settings, numels
        return watched.view_as(watched)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        group, settings = ctx.group, ctx.settings
        for bucket, per_rank in zip(group.buckets, ctx.numels):
            numel = per_rank * group.shard_comm.world
            replicate = group.replicate_comm if settings.all_reduce else None
            ops = reduction_ops(group, settings, bucket.reduce_dtype)
            for kind, comm, n, avg in (("reduce_scatter", group.shard_comm, numel, ops.shard_averages), ("all_reduce", replicate, per_rank, ops.replicate_averages)):
                if comm is not None and comm.world > 1:
                    for done in (False, True):
                        torch.ops.shardkit.trace_collective(grad, kind, group.name, comm.world, comm.mesh_dim, done, n, bucket.reduce_dtype, "avg" if avg else "sum")
        return None, None, None, grad
