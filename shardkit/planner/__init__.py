"""The planner: what a model will need per rank under shardkit, before any GPU is involved.

``shardkit.plan(model_fn, mesh_shape, ...)`` builds the model on fake tensors, applies the
usual recipe (each block, then the root; tensor parallel on a ``tp`` mesh dim), and
predicts per rank the sharded parameter, gradient and optimizer-state bytes, the peak memory
of a training step and what it is made of, and the collectives per step with their bytes
and time at a given bandwidth. With ``budget=`` it also picks ``reshard_after_forward`` per
group and the prefetch depth that fit, and ``shardkit.apply_plan(model, plan, mesh)``
shards a real model that way. ``python -m shardkit plan --help`` is the same from a shell.

How the peak is predicted: one forward and backward of the unsharded model on fake tensors
(``workload.py`` sets up the step, ``profile.py`` runs it) counts the bytes of every tensor
an operator creates (activations, temporaries, activation gradients) at every operator; the
runtime's schedule (``simulate.py``) then adds, at each operator, the buffers shardkit holds
there (all-gather buffers, unsharded parameters and gradients, reduce-scatter buffers,
sharded gradients).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from shardkit.planner import model as pm
from shardkit.planner import simulate as sim
from shardkit.planner.simulate import Memory
from shardkit.planner.workload import checkpoint_forward, profile_step

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-nomomentum")


@dataclass
class CommStats:
    calls: int = 0
    nbytes: int = 0  # unsharded-side buffer bytes (the trace's ``nbytes``)
    wire_bytes: int = 0  # bytes each rank sends: (w - 1) / w of the buffer, twice for an all-reduce


@dataclass
class Plan:
    """A prediction for one rank; every byte count is per rank, per training step."""

    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    groups: list[pm.GroupInfo]
    prefetch: int  # all-gathers issued ahead, forward and backward (the runtime's default is 1)
    memory: Memory
    comm: dict[str, CommStats]
    bandwidth_gbps: float
    total_params: int
    budget: int | None = None  # bytes per rank, when the plan was chosen to fit one
    notes: list[str] = field(default_factory=list)

    @property
    def comm_seconds(self) -> float:
        """Time on the wire per step at ``bandwidth_gbps`` (GB/s), if nothing overlapped."""
        return sum(s.wire_bytes for s in self.comm.values()) / (self.bandwidth_gbps * 1e9)

    def reshard_after_forward(self) -> dict[str, bool | int | None]:
        return {g.name: g.reshard_after_forward for g in self.groups}

    def to_json(self) -> dict:
        from shardkit.planner.report import to_json

        return to_json(self)

    def table(self):
        from shardkit.planner.report import table

        return table(self)


def plan(
    model_fn: Callable[[], nn.Module] | str,
    mesh_shape: int | tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    batch_size: int = 1,
    seq_len: int | None = None,
    inputs_fn: Callable[[int, int], tuple] | None = None,
    loss_fn: Callable[[Any, tuple], torch.Tensor] | None = None,
    blocks: list[str] | None = None,
    tp_plan: dict | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool | int = True,
    prefetch: int = 1,
    optimizer: str = "adamw",
    foreach: bool = False,
    activation_checkpointing: bool = False,
    bandwidth_gbps: float = 50.0,
    budget: int | None = None,
    **model_sizes,
) -> Plan:
    """Predict memory and communication per rank for ``model_fn`` sharded over ``mesh_shape``.

    ``model_fn``: a factory (``lambda: MyModel(cfg)``), ``"gpt"`` / ``"llama"`` with
    ``model_sizes`` as config fields, or ``"package.module:function"``. ``mesh_shape``:
    ``(dp,)``, ``(dp, tp)`` with ``mesh_dim_names=("dp", "tp")``, HSDP's ``(replicate,
    shard)``, or HSDP x TP's ``(replicate, shard, tp)``. ``batch_size`` is per data-parallel rank. ``inputs_fn(batch_size, seq_len)``
    returns the forward's positional inputs (built-ins: token ids and, for the GPT, targets);
    ``loss_fn(output, inputs)`` the loss; by default cross-entropy of the output against
    random targets for the default token ids, against the last of ``inputs_fn``'s inputs when
    that holds class indices, else the output's mean (the defaults: ``planner/workload.py``).
    ``foreach``: the optimizer's multi-tensor path (the CUDA default).
    ``activation_checkpointing``: each block's forward runs under ``torch.utils.checkpoint``
    (non-reentrant) and is recomputed in backward. ``budget``: bytes per rank to fit into, see
    ``fit_budget``.

    Example::

        p = shardkit.plan("llama", (64,), dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                          hidden=28672, vocab_size=128256, max_seq=4096, seq_len=4096,
                          param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        print(p.memory.peak / 2**30, "GiB per rank")
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"shardkit plan: optimizer {optimizer!r} is not modelled; use one of {OPTIMIZERS}")
    shape = (mesh_shape,) if isinstance(mesh_shape, int) else tuple(mesh_shape)
    names = mesh_dim_names or (("dp",) if len(shape) == 1 else ("dp", "tp"))
    if len(names) != len(shape):
        raise ValueError(f"shardkit plan: mesh_shape {shape} and mesh_dim_names {names} differ in length")
    tp = shape[names.index("tp")] if "tp" in names else 1
    shard_dim = names.index("shard") if "shard" in names else 0
    world = shape[shard_dim]
    family = model_fn if isinstance(model_fn, str) and ":" not in model_fn else None  # "module:function" is a factory
    if isinstance(model_fn, str):
        model_fn = pm.builtin(family, **model_sizes) if family else pm.load_factory(model_fn, **model_sizes)
    if family == "llama" and tp > 1 and tp_plan is None:
        from shardkit.models.llama import tp_plan as llama_tp_plan

        tp_plan = llama_tp_plan()
    if tp > 1 and not tp_plan:
        raise ValueError("shardkit plan: a 'tp' mesh dim needs tp_plan= (block-relative module name -> 'colwise'/'rowwise')")

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = model_fn()
        names_of_blocks = blocks if blocks is not None else pm.find_blocks(model)
        if tp > 1:
            pm.apply_tp(model, names_of_blocks, tp, tp_plan)
        total_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        groups = pm.group_params(model, names_of_blocks, world, param_dtype, reduce_dtype)
        raf = _normalize_raf(reshard_after_forward, world)
        for g in groups:
            g.choose_reshard(raf)
        if activation_checkpointing:
            for g in groups:
                if g.name:
                    checkpoint_forward(g.module)
        prof = profile_step(model, groups, family, batch_size, seq_len, inputs_fn, loss_fn, param_dtype)
    result = Plan(shape, names, groups, prefetch, sim.simulate(groups, prof, prefetch, optimizer, foreach),
                  {}, bandwidth_gbps, total_params)
    result._profile, result._optimizer, result._foreach = prof, optimizer, foreach
    result.comm = communication(groups, shape[0] if "replicate" in names else 1)
    if budget is not None:
        fit_budget(result, budget)
    return result


def communication(groups: list[pm.GroupInfo], replicas: int = 1) -> dict[str, CommStats]:
    """Collectives per step per rank, as the trace counts them (``Trace.summary``)."""
    stats = {k: CommStats() for k in ("all_gather", "reduce_scatter", "all_reduce")}

    def add(kind: str, numel: int, dtype: torch.dtype, ranks: int) -> None:
        s = stats[kind]
        s.calls += 1
        s.nbytes += numel * dtype.itemsize
        s.wire_bytes += (2 if kind == "all_reduce" else 1) * numel * dtype.itemsize * (ranks - 1) // ranks

    for g in groups:
        raf = g.reshard_after_forward if g.reshard_after_forward is not None else bool(g.name)
        for dtype, ps in g.buckets("param_dtype").items():
            world = ps[0].world
            add("all_gather", world * sum(p.shard_numel for p in ps), dtype, world)
            if raf is True:
                add("all_gather", world * sum(p.shard_numel for p in ps), dtype, world)
            elif raf is not False:
                add("all_gather", raf * sum(p.post_forward_numel(raf) for p in ps), dtype, raf)
        for dtype, ps in g.buckets("reduce_dtype").items():
            trainable = [p for p in ps if p.requires_grad]
            if trainable:
                chunk = sum(p.shard_numel for p in trainable) + len(trainable)
                add("reduce_scatter", trainable[0].world * chunk, dtype, trainable[0].world)
                if replicas > 1:
                    add("all_reduce", chunk, dtype, replicas)
    return stats


def fit_budget(p: Plan, budget: int, node_size: int = 8) -> Plan:
    """Choose the fastest settings predicted to fit ``budget`` bytes per rank, in place.

    Starting from every block resharding after forward and prefetching one group: first the
    prefetch depth (2 if it fits; 0 if even 1 does not), then, from the last block backward
    (the first ones backward needs), ``reshard_after_forward=False`` (no backward
    all-gather) where it fits, else ``=node_size`` (the backward all-gather stays within a
    node). What does not fit keeps ``True``. ``p.notes`` says what was chosen and why."""
    p.budget = budget
    world = p.groups[0].params[0].world

    def peak() -> int:
        return sim.simulate(p.groups, p._profile, p.prefetch, p._optimizer, p._foreach).peak

    for g in p.groups:
        g.choose_reshard(True)
    for depth in (2, 1, 0):
        p.prefetch = depth
        if peak() <= budget:
            break
    else:
        p.memory = sim.simulate(p.groups, p._profile, 0, p._optimizer, p._foreach)
        p.notes.append(f"does not fit: the smallest predicted peak is {p.memory.peak / pm.GiB:.2f} GiB "
                       f"(every block resharded, no prefetch) against a budget of {budget / pm.GiB:.2f} GiB")
        return p
    options = [False] + ([node_size] if 1 < node_size < world and world % node_size == 0 else [])
    for g in sorted((g for g in p.groups if g.name), key=lambda g: -p._profile.forward.get(g.name, (0, 0))[0]):
        for choice in options:
            g.choose_reshard(choice)
            if peak() <= budget:
                break
        else:
            g.choose_reshard(True)
    p.memory = sim.simulate(p.groups, p._profile, p.prefetch, p._optimizer, p._foreach)
    p.comm = communication(p.groups, p.mesh_shape[0] if "replicate" in p.mesh_dim_names else 1)
    kept = sum(1 for g in p.groups if g.reshard_after_forward is False)
    partial = sum(1 for g in p.groups if g.reshard_after_forward not in (True, False, None))
    p.notes.append(f"fits: prefetch depth {p.prefetch}, {kept} block(s) kept unsharded after forward, "
                   f"{partial} resharded to {node_size} ranks; predicted peak {p.memory.peak / pm.GiB:.2f} GiB "
                   f"of {budget / pm.GiB:.2f} GiB")
    return p


def apply_plan(model: nn.Module, p: Plan, mesh=None, **fully_shard_kwargs) -> nn.Module:
    """Shard ``model`` as ``p`` says: each group with its ``reshard_after_forward``, then the
    root, and explicit prefetch lists for the plan's depth. ``fully_shard_kwargs`` (e.g.
    ``mp_policy``) go to every call; the plan's dtypes are not applied for you."""
    from shardkit.eager.api import fully_shard

    modules = {name: model.get_submodule(name) for name in (g.name for g in p.groups if g.name)}
    for g in p.groups:
        if g.name:
            fully_shard(modules[g.name], mesh=mesh, reshard_after_forward=g.reshard_after_forward, **fully_shard_kwargs)
    root_raf = next((g.reshard_after_forward for g in p.groups if not g.name), None)
    fully_shard(model, mesh=mesh, reshard_after_forward=root_raf, **fully_shard_kwargs)
    if p.prefetch != 1:  # the runtime's implicit prefetch is one group ahead
        order = [modules[name] for name in p._profile.forward_order() if name in modules]
        for i, m in enumerate(order):
            m.set_modules_to_forward_prefetch(order[i + 1 : i + 1 + p.prefetch])
            m.set_modules_to_backward_prefetch(order[max(0, i - p.prefetch) : i][::-1])
    return model


def _normalize_raf(value: bool | int, world: int) -> bool | int:
    if isinstance(value, bool):
        return value
    if world % value:
        raise ValueError(f"shardkit plan: reshard_after_forward={value} must divide the shard world {world}")
    return True if value == world else False if value == 1 else value
