"""The differential API fuzzer's core: models, call sequences, and one run of a sequence.

An example is a model ``Spec`` and a list of calls (``Command`` tuples, JSON-able, so that a
failing sequence can be written out and replayed). ``Run`` builds the same model three ways:
sharded by shardkit, sharded by torch's FSDP2, and unsharded (the reference, fed the global
batch), and executes each call on all of them. After every call it checks:

- numerics (real process groups): the loss, the parameters (the optimizer's, gathered) and,
  when the gradients are complete, the gradients, against the reference with a tolerance by
  dtype; and against FSDP2 exactly, while FSDP2 accepts the sequence and agrees with the
  reference itself;
- collectives (every process group): the ops issued during the call, seen below torch's
  dispatcher (``c10d`` ops), against FSDP2's: the all-gathers' count and sizes, the
  reductions' count and ``ReduceOp``s; and shardkit's alone against the dtype audit's rule
  (tests/dtype_audit.py): no collective that sums gradients runs below the reduce dtype;
- errors: a call shardkit rejects and FSDP2 accepts is a failure (a case FSDP2 handles).

The model of the calls' effects the checks need (which gradients are complete, the divide
factor per group) lives in ``Run``; a call whose precondition does not hold is skipped
(recorded as such), so that any list of calls is a valid sequence and shrinking is free to
drop calls.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dtype_audit import Audit

DIM, VOCAB, BATCH, SEQ = 8, 16, 4, 3
FORWARDS = ("forward", "penalized_forward")  # the calls that leave a loss for ``backward``
TARGETS = ("", "blocks.0", "blocks.1", "head")  # the root and two groups every model has; the head's where it has one (else the root)
UNSHARD_HOWS = ("sync", "async_wait", "async_wait_twice", "async_no_wait")
LR = 1e-2
# shardkit against FSDP2 where both agree with the reference: the same math up to the order of
# a few float sums (gloo's reduction, AdamW on local tensors vs DTensors): relative to the
# tensor's largest element; x100 with bf16 compute.
FSDP2_TOLERANCE = 1e-6


@dataclass(frozen=True)
class Spec:
    blocks: int = 2
    nested: bool = False  # each block has an inner fully_shard'ed Linear
    mixed: bool = False  # each block also holds a float64 parameter (a group of several dtypes)
    tied: str = "none"  # "none" | "same" (embedding and head in the root group) | "across" (head its own group)
    mp: bool = False  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    reshard: Any = True  # the blocks' reshard_after_forward: True, False, or an int
    mesh: str = "1d"  # "1d" | "hsdp" (replicate, shard) = (2, world/2) | "hsdp1" = (1, world) | "hsdp_tp" (2, world/4) x tp 2 (see shard)
    foreach: bool = False  # AdamW's multi-tensor path, which bumps no version counter
    unused: bool = False  # each block holds a Linear its forward never calls (.grad stays None)
    param_mesh: bool = False  # the blocks' lin.weight on a mesh of its own (ShardPlacementResult): HSDP (2, world / 2), (1, 2) at world 2
    swap_data: bool = False  # each block's forward gives its lin.weight new data (HF SwitchTransformers' router)
    compiled_mode: bool = False  # shardkit's side sharded by shardkit.compiled.fully_shard, run eagerly (no torch.compile)
    regions: bool = False  # compiled mode with region.REGIONS_FROM = 1: its blocks run region.run (eagerly the region is a plain call)
    optim: str = "adamw"  # "adamw" | "muon" | "muon-owners": Muon on the 2-D matrices but the embedding, AdamW on the rest (see Optimizers)
    paired: bool = False  # inp and out one group, fully_shard([inp, out]) (as [embedding, head]): called first and last (untied models)
    extension: bool = False  # the blocks' lin.weight a tensor subclass with FSDP2's all-gather hooks (tests/gloo/extension_tensors.Tagged; the reference's too)


class Boom(RuntimeError):
    """Raised inside a forward on purpose (``raise_in_forward``)."""


class Block(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        if spec.extension:
            from tests.gloo.extension_tensors import Tagged

            self.lin.weight = nn.Parameter(Tagged(self.lin.weight.data))
        self.inner = nn.Linear(DIM, DIM) if spec.nested else None
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(DIM, dtype=torch.float64)) if spec.mixed else None
        self.spare = nn.Linear(DIM, DIM) if spec.unused else None
        self.swap_data = spec.swap_data
        self.fail = False

    def forward(self, x, *, gain=1.0):
        # New data, same Parameter: what HF's router's `.to(torch.float32)` does to bf16 weights. Not
        # to a tensor-parallel weight under inference_mode: torch refuses `.data =` of an inference
        # DTensor on a DTensor made outside it ("Cannot set version_counter"), FSDP2 and shardkit alike
        if self.swap_data and not (torch.is_inference_mode_enabled() and isinstance(self.lin.weight, DTensor)):
            self.lin.weight.data = self.lin.weight.data.clone()  # (a .to of the same dtype would copy nothing)
        x = torch.tanh(self.lin(x)) * gain  # (gain: a keyword argument, as models pass them; 1.0, exact)
        if self.inner is not None:
            x = x + torch.tanh(self.inner(x))
        if self.scale is not None:
            x = x * self.scale.to(x.dtype)
        if self.fail:
            raise Boom("raised inside a block's forward on purpose")
        return x


class Net(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.tied = spec.tied != "none"
        if self.tied:
            self.emb = nn.Embedding(VOCAB, DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.head.weight = self.emb.weight
        else:
            self.inp = nn.Linear(DIM, DIM)
            self.out = nn.Linear(DIM, 1)
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.blocks))

    def forward(self, x):
        x = self.emb(x) if self.tied else self.inp(x)
        for block in self.blocks:
            x = block(x, gain=1.0)
        return self.head(x) if self.tied else self.out(x)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return output_loss(model, model(x), y)


def output_loss(model: nn.Module, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if model.tied:
        return F.cross_entropy(out.float().flatten(0, 1), y.flatten())
    return F.mse_loss(out.float().squeeze(-1), y.float())


def batch(seed: int, spec: Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (every rank makes the same one)."""
    g = torch.Generator().manual_seed(seed)
    if spec.tied != "none":
        return torch.randint(VOCAB, (BATCH, SEQ), generator=g), torch.randint(VOCAB, (BATCH, SEQ), generator=g)
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, generator=g)


class Optimizers:
    """One model's optimizers, stepped as one: AdamW on every parameter, or (``Spec.optim ==
    "muon"``) Muon on the 2-D matrices but the embedding (Muon's usual recipe) and AdamW on
    the rest. The reference gets ``torch.optim.Muon``; both sharded models, shardkit's and
    FSDP2's, get ``shardkit.optim.Muon`` (torch's on DTensors is slow and, as a DTensor
    Newton-Schulz, not the same math), so that their all-to-alls are compared equal; with
    ``"muon-owners"`` its ``every_rank_below`` is 0 (owners for every bucket, as on NCCL)."""

    def __init__(self, params: dict[str, nn.Parameter], spec: Spec, reference: bool) -> None:
        matrices = [p for n, p in params.items() if spec.optim != "adamw" and p.ndim == 2 and n != "emb.weight"]
        rest = [p for p in params.values() if not any(p is m for m in matrices)]
        self.all = [torch.optim.AdamW(rest, lr=LR, foreach=spec.foreach)]
        self.muon: torch.optim.Optimizer | None = None
        if matrices:
            from shardkit.optim import Muon

            self.muon = (torch.optim.Muon if reference else Muon)(matrices, lr=LR)
            if spec.optim == "muon-owners" and not reference:
                self.muon._owners.every_rank_below = 0.0
            self.all.append(self.muon)

    def step(self) -> None:
        for optim in self.all:
            optim.step()

    def zero_grad(self) -> None:
        for optim in self.all:
            optim.zero_grad()


def torch_muon_step(muon: torch.optim.Optimizer) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Before a sharded Muon's step: each of its parameters with what ``torch.optim.Muon``'s
    step makes of it, run here on the full parameter, gradient and momentum (gathered). The
    sharded step must give exactly that (fp32 and fp64 alike): the one-step check that the
    comparison with the reference cannot make tightly (see ``Run.tolerance``)."""
    held = [p for opt_group in muon.param_groups for p in opt_group["params"]]
    full = [_full(p).clone() for p in held]
    hyper = {k: v for k, v in muon.param_groups[0].items() if k != "params"}
    one = torch.optim.Muon(full, **hyper)
    for p, q in zip(held, full):
        q.grad = None if p.grad is None else _full(p.grad).clone()
        if "momentum_buffer" in muon.state.get(p, {}):
            one.state[q]["momentum_buffer"] = _full(muon.state[p]["momentum_buffer"]).clone()
    one.step()
    return list(zip(held, full))


# The two implementations' API ----------------------------------------------------------------
def impl_api(impl: str):
    if impl == "shardkit":
        import shardkit as api
    else:
        import torch.distributed.fsdp as api
    return api


def shard(model: Net, spec: Spec, impl: str, mesh, meshes: dict | None = None) -> None:
    api = impl_api(impl)
    fully_shard = api.fully_shard
    if impl == "shardkit" and spec.compiled_mode:
        from shardkit.compiled import fully_shard
    kwargs = {"mesh": mesh}
    if spec.mp:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    placement = {}
    if spec.param_mesh:  # FSDP2's per-parameter mesh, given as FSDP2 takes it (one object per mesh)
        from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo, ShardPlacementResult

        own = HSDPMeshInfo(meshes["hsdp" if dist.get_world_size() >= 4 else "hsdp1"], shard_mesh_dim=1, replicate_mesh_dim=0)
        weights = {id(block.lin.weight) for block in model.blocks}
        placement["shard_placement_fn"] = lambda p: ShardPlacementResult(None, own) if id(p) in weights else None
    for block in model.blocks:
        if spec.mesh == "hsdp_tp":  # torchtitan's order: tensor parallel first (lin column-wise, its output whole again)
            parallelize_module(block.lin, meshes["hsdp_tp:tp"], ColwiseParallel(output_layouts=Replicate()))
        if block.inner is not None:
            fully_shard(block.inner, **kwargs)
        fully_shard(block, reshard_after_forward=spec.reshard, **kwargs, **placement)
    if spec.tied == "across":
        fully_shard(model.head, **kwargs)
    if spec.paired and spec.tied == "none":
        fully_shard([model.inp, model.out], **kwargs)
    with regions_from(1 if spec.regions else None):
        fully_shard(model, **kwargs)  # the root's call chooses the blocks that run as regions


@contextlib.contextmanager
def regions_from(n: int | None):
    """compiled mode's REGIONS_FROM set to ``n`` for the calls inside (None: left as it is)."""
    from shardkit.compiled import region

    before = region.REGIONS_FROM
    region.REGIONS_FROM = before if n is None else n
    try:
        yield
    finally:
        region.REGIONS_FROM = before


def shardkit_clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    from shardkit import clip_grad_norm_

    return clip_grad_norm_(params, max_norm)


def groups_of(model: nn.Module) -> dict[str, nn.Module]:
    """Every fully_shard'ed module by FQN (either implementation's FSDPModule, or compiled mode's)."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from shardkit import FSDPModule
    from shardkit.compiled import CompiledFSDPModule

    found, states = {}, set()
    for n, m in model.named_modules():
        if isinstance(m, (FSDPModule, TorchFSDPModule, CompiledFSDPModule)):
            state = m._get_fsdp_state() if not isinstance(m, (FSDPModule, CompiledFSDPModule)) else m.__dict__["_shardkit_state"]
            if id(state) not in states:  # a group of several modules (Spec.paired): by its first one's FQN
                states.add(id(state))
                found[n] = m
    return found


def sharded_params(module: nn.Module) -> list[nn.Parameter]:
    """The parameters one shardkit fully_shard call sharded (eager or compiled mode)."""
    from shardkit.compiled import CompiledGroup

    state = module.__dict__["_shardkit_state"]
    if isinstance(state, CompiledGroup):  # (not the weights tied to an earlier call's, which it gathers too)
        return [p.sharded_param for i, p in enumerate(state.params) if i not in state.owners]
    return [p.sharded_param for p in state.group.params] if state.group else []


# Seeing the collectives ----------------------------------------------------------------------
class Collectives(TorchDispatchMode):
    """Records the c10d collectives issued below the dispatcher, whoever issues them."""

    def __init__(self, optimizer_step: bool = False) -> None:
        super().__init__()
        self.seen: list[tuple] = []
        # During an optimizer step no gradient is reduced: every all-to-all is the optimizer's
        # (shardkit.optim.Muon's, on both sides), compared by dtype and size.
        self.optimizer_step = optimizer_step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith("c10d::"):
            kind = name.removeprefix("c10d::").rstrip("_")
            # (schemas: _allgather_base_(out, in, group, ...), _reduce_scatter_base_(out, in,
            # group, op, ...), allreduce_(tensors, group, op, ...), alltoall_base_(out, in, group, ...))
            if kind == "_allgather_base" and _group_size(args[2]) > 1:  # FSDP2 skips 1-rank collectives
                self.seen.append(("all_gather", args[1].dtype, args[0].numel()))
            elif kind == "_reduce_scatter_base" and _group_size(args[2]) > 1:
                self.seen.append(("reduce_scatter", _op(args[3])))
            elif kind == "allreduce" and _group_size(args[1]) > 1:
                self.seen.append(("all_reduce", _op(args[2])))
            elif kind == "alltoall_base" and _group_size(args[2]) > 1 and self.optimizer_step:
                self.seen.append(("all_to_all", args[1].dtype, args[1].numel(), args[0].numel()))  # (sent, received)
            elif kind == "alltoall_base" and _group_size(args[2]) > 1:
                self.seen.append(("reduce_scatter", "sum"))  # shardkit's gloo route: all-to-all + a sum
        elif name == "_c10d_functional::all_gather_into_tensor":  # compiled mode's (input, group_size, group_name)
            self.seen.append(("all_gather", args[0].dtype, args[0].numel() * args[1]))
        elif name == "_c10d_functional::reduce_scatter_tensor":  # (input, op, group_size, group_name)
            self.seen.append(("reduce_scatter", args[1]))  # (compiled mode's ops are eager mode's: core/reduction.reduce_ops)
        elif name == "_c10d_functional::all_to_all_single":  # compiled mode's reduce-scatter on gloo, summed after
            self.seen.append(("reduce_scatter", "sum"))  # (as eager mode's route above)
        elif name == "_c10d_functional::all_reduce":  # compiled mode's HSDP (input, op, group_name)
            self.seen.append(("all_reduce", args[1]))
        return func(*args, **kwargs)


def _fsdp2_groups(model: nn.Module) -> list:
    """The parameter groups of torch's FSDP2 in ``model`` (modules without parameters have none)."""
    from torch.distributed.fsdp import FSDPModule

    groups = (m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule))
    return [g for g in groups if g is not None]


def _fsdp2_unsharded(model: nn.Module) -> bool:
    """Whether a group of torch's FSDP2 holds (or is gathering) its unsharded parameters now."""
    groups = _fsdp2_groups(model)
    return any((g.is_unsharded or g._all_gather_result is not None) for g in groups)  # (or its all-gather pending)


def _fsdp2_gathers_in(model: nn.Module) -> set[torch.dtype]:
    """The dtypes of the buffers torch's FSDP2 all-gathers into, once its lazy init made them."""
    return {t.dtype for g in _fsdp2_groups(model) for p in g.fsdp_params for t in getattr(p, "all_gather_outputs", [])}


def _group_size(script_group) -> int:
    return dist.ProcessGroup.unbox(script_group).size()


def _op(script_op) -> str:
    # PREMUL_SUM (FSDP2's reduce-scatter with a divide factor other than the world) multiplies
    # before an NCCL sum; shardkit sums and divides after: the same reduction, "sum" for both.
    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PREMUL_SUM: "sum"}
    value = int(script_op.op())
    return next((name for op, name in names.items() if int(op) == value), str(value))


def comparable(seen: list[tuple]) -> tuple:
    """What must agree between shardkit and FSDP2: all-gathers by (dtype, numel), reductions
    by op (their sizes differ: shardkit adds a grad-presence column per parameter), and the
    optimizer's all-to-alls by (dtype, numel sent, numel received)."""
    return tuple(Counter(s for s in seen if s[0] == kind) for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all"))


# One run of a sequence ----------------------------------------------------------------------
@dataclass
class Side:
    """One implementation's model, optimizer and state of the step."""

    impl: str
    model: nn.Module
    params: dict[str, nn.Parameter] = field(default_factory=dict)  # what the optimizer holds, by FQN
    optim: Optimizers | None = None
    loss: torch.Tensor | None = None
    eval_loss: torch.Tensor | None = None  # the last evaluate's, a plain tensor
    alive: bool = True  # False once it rejected a call (FSDP2) or disagreed with the reference
    why_out: str = ""
    seen: list = field(default_factory=list)  # collectives of the last call
    muon_expected: list = field(default_factory=list)  # after a step: torch_muon_step's (parameter, full value)
    clip_norm: torch.Tensor | None = None  # what the last clip_grad_norm_ returned
    witness_only: bool = False  # FSDP2 with the tied weight in one group: vouches for bf16 math only (Run)
    hook_calls: Counter = field(default_factory=Counter)  # post-accumulate-grad hook calls per parameter, since the last check
    pre_hook_reads: list = field(default_factory=list)  # (block, the lin.weight its forward pre-hook read), since the last check


class Failure(AssertionError):
    pass


class Run:
    """Runs one sequence on shardkit, FSDP2 and (``numerics``) the unsharded reference."""

    def __init__(self, spec: Spec, meshes: dict, numerics: bool, compare_collectives: bool, impls=("shardkit", "torch")) -> None:
        self.spec, self.numerics, self.compare_collectives = spec, numerics, compare_collectives
        self.mesh, self.meshes = meshes[spec.mesh], meshes
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        # the data-parallel ranks (the tp ranks of one share its rows of the batch)
        tp = meshes["hsdp_tp:tp"].size() if spec.mesh == "hsdp_tp" else 1
        self.dp_world, self.dp_rank = self.world // tp, self.rank // tp
        torch.manual_seed(0)
        base = Net(spec)
        self.reference = copy.deepcopy(base)
        self.sides: list[Side] = []
        for impl in impls:
            model = copy.deepcopy(base)
            side = Side(impl, model)
            layout = spec
            if impl == "torch" and spec.tied == "across" and spec.mp and numerics:
                # FSDP2 cannot hold a weight in two groups, so nothing would vouch for a value that
                # bf16 math puts off the fp32 reference (_compare). With the weight in one group (the
                # root's) it computes the same bf16 math: shardkit's gradients were bit for bit equal
                # both ways where it was off by 0.19 of the largest element (make fuzz seed 82837).
                # Its values are that witness only: not compared with shardkit's, nor its collectives.
                layout, side.witness_only = replace(spec, tied="same"), True
            try:
                shard(model, layout, impl, self.mesh, meshes)
            except Exception as e:  # FSDP2 rejects this model: shardkit alone
                if impl == "shardkit":
                    raise
                side.alive, side.why_out = False, f"fully_shard: {type(e).__name__}: {e}"
            if impl == "torch" and spec.tied == "across" and not side.witness_only:  # shardkit only: FSDP2 manages the weight in both groups
                side.alive, side.why_out = False, "weights tied across groups"
            if impl == "torch" and spec.swap_data and numerics:
                # FSDP2 keeps the data a forward gave the parameter and never refills it from a
                # later all-gather: every step after the first computes with the first step's
                # weights. Its collectives and errors (the fake tier) are still compared.
                side.alive, side.why_out = False, "a forward swaps its parameter's data"
            self.sides.append(side)
        modules = groups_of(self.sides[0].model)
        self.groups = list(modules)
        # The group that reduces each parameter (a weight tied across groups: the one that sharded it first)
        by_id = {id(p): g for g, m in modules.items() for p in sharded_params(m)}
        self.owner = {name: by_id[id(p)] for name, p in self.sides[0].model.named_parameters()}
        self.sync = {g: True for g in self.groups}  # set_requires_gradient_sync
        self.all_reduce = {g: True for g in self.groups}  # set_requires_all_reduce
        self.unreduced = {g: False for g in self.groups}  # gradients kept unreduced since a backward
        self.factor = {g: None for g in self.groups}  # set_gradient_divide_factor
        self.ref_loss: torch.Tensor | None = None
        self.ref_eval_loss: torch.Tensor | None = None  # the last evaluate's
        self.dtype = torch.float32
        # A forward left without its backward, then another forward or an optimizer step:
        # shardkit re-gathers what an optimizer step may have changed, FSDP2 reuses it. Both
        # are right when the step had no gradients; from then on all-gathers are not compared.
        self.gathers_comparable = True
        self.unwaited: set[str] = set()  # groups unsharded with async_op=True, not waited for yet
        self.user_unsharded: set[str] = set()  # groups unshard() was called on, not resharded since
        self.kept_after_backward: set[str] = set()  # set_reshard_after_backward(False)
        self.lockstep = False
        # set_reduce_scatter_unused_params(True) with parameters no rank uses: FSDP2 gives them
        # zero gradients, which its optimizer then steps; shardkit leaves them None, as the
        # unsharded model does (the numerics tier drops FSDP2 there: "set (zeros) where the
        # reference's is None"). Muon's all-to-alls then carry other matrices: not compared.
        self.fsdp2_zero_grads = False
        self.muon_steps = 0  # optimizer steps Muon took on the reference (see tolerance)
        self.loaded_scale = 1.0  # the product of the load_reference scales so far
        self.log: list[str] = []
        self._new_optimizers()

    # Bookkeeping --------------------------------------------------------------------------
    def _new_optimizers(self) -> None:
        self.ref_params = dict(self.reference.named_parameters())
        self.ref_optim = Optimizers(self.ref_params, self.spec, reference=True)
        for side in self.live_sides():
            side.params = dict(side.model.named_parameters())
            side.optim = Optimizers(side.params, self.spec, reference=False)
            for name, p in side.params.items():  # (an optimizer stepping in backward would hook here)
                if not getattr(p, "_fuzz_hooked", False):
                    p.register_post_accumulate_grad_hook(lambda p, name=name, calls=side.hook_calls: calls.update([name]))
                    p._fuzz_hooked = True

    def live_sides(self) -> list[Side]:
        return [s for s in self.sides if s.alive]

    @property
    def shardkit(self) -> Side:
        return self.sides[0]

    def grads_complete(self) -> bool:
        return not any(self.unreduced.values())

    def idle(self) -> bool:
        return self.ref_loss is None and self.grads_complete()

    def grad_scale(self, name: str) -> float:
        """Sharded .grad = reference .grad * this (set_gradient_divide_factor)."""
        factor = self.factor[self.owner[name]]
        return 1.0 if factor is None else self.dp_world / factor

    # Executing ----------------------------------------------------------------------------
    def execute(self, cmd: tuple) -> None:
        """Run one call on every side and check; raises ``Failure`` with the reason."""
        name, *args = cmd
        target = {"set": 1, "unshard": 0, "reshard": 0}.get(name)
        if target is not None and args[target] == "head" and "head" not in self.groups:
            args[target] = ""  # a model without the head's group: its root
            cmd = (name, *args)
        if self.ref_loss is not None and name in (*FORWARDS, "step", "zero_grad", "train"):
            self.gathers_comparable = False
        if self.unwaited and name not in (*FORWARDS, "evaluate", "train", "unshard", "set"):
            # FSDP2 keeps an unwaited all-gather across a reshard (reshard(), state dicts) for
            # the next unshard to use; shardkit waits for it and frees it (a later unshard
            # gathers fresh data, as the state dict may have changed it).
            self.gathers_comparable = False
        if name in ("step", "train") and self.user_unsharded:
            # FSDP2 keeps what an explicit unshard() gathered across an optimizer step and uses it
            # in the next forward; shardkit gathers again (the step may have changed the shards).
            self.gathers_comparable = False
        if name == "unshard" and self.spec.compiled_mode:
            # compiled mode's unshard() does nothing (its graph gathers at forward); FSDP2's
            # all-gathers now, and its next forward of that group does not
            self.gathers_comparable = False
        if name == "unshard":
            self.user_unsharded.add(args[0])
        elif name == "reshard":
            self.user_unsharded.discard(args[0])
        if name in ("step", "train") and self.kept_after_backward:
            # FSDP2 computes the next forward with the parameters it kept after backward, from
            # before this step (the fuzzer drops it: it disagrees with the reference); shardkit
            # gathers them again.
            self.gathers_comparable = False
        if name == "set" and args[0] in ("modules_to_forward_prefetch", "modules_to_backward_prefetch") and _prefetches_back(*args):
            # A prefetch of a group that already ran in this pass: FSDP2 keeps that all-gather
            # for the group's next unshard (in the other pass), shardkit frees it at the pass's end.
            self.gathers_comparable = False
        if name == "set" and args[0] == "reshard_after_backward" and self.spec.compiled_mode and self.ref_loss is not None:
            # Compiled mode reads the setting at forward (its backward is compiled with it): set
            # between a forward and its backward it holds from the next forward, where FSDP2 applies
            # it at this backward. The same numbers; the next forward's all-gathers differ (make
            # fuzz seed 82833, fake tier).
            self.gathers_comparable = False
        if name == "evaluate" and self.spec.compiled_mode:
            # After a forward without autograd FSDP2's root keeps its unsharded parameters, and
            # its next forward gathers nothing for the root; compiled mode gathers at every
            # forward (make fuzz seed 43347, fake tier: compiled mode, regions, extension).
            self.gathers_comparable = False
        if name == "set" and args[0] == "reduce_scatter_unused_params" and args[2] and self.spec.unused:
            self.fsdp2_zero_grads = True
        if name == "set" and args[0] == "lockstep" and args[2]:
            self.lockstep = True  # its agreements are collectives of their own: nothing to compare
        if name in (*FORWARDS, "evaluate", "train", "raise_in_forward"):
            self.unwaited.clear()
        elif name == "unshard":
            (self.unwaited.add if args[1] == "async_no_wait" else self.unwaited.discard)(args[0])
        if name == "train":  # forward, backward, (clip_grad_norm_,) the optimizer step, checked after each
            seed, *clip = args
            for part in (("forward", seed), ("backward",), *(("clip", c) for c in clip), ("step",)):
                self.execute(part)
            return
        method = getattr(self, f"do_{name}")
        if not method(*args, dry=True):
            self.log.append(f"{cmd}: skipped (precondition)")
            return
        if name == "penalized_forward" and len(self.sides) > 1 and self.sides[1].alive:
            # FSDP2 (2.13) frees the parameters at the end of the create_graph=True backward,
            # and the backward through it fails ("setStorage: ... storage of size 0"); shardkit
            # goes on against the reference alone.
            self.sides[1].alive, self.sides[1].why_out = False, f"{cmd}: FSDP2 cannot backpropagate through a create_graph=True backward"
        outcomes: dict[str, BaseException | None] = {}
        audits: dict[str, Any] = {}
        for side in self.live_sides():
            if side.witness_only and _on_the_heads_group_alone(name, args):
                outcomes[side.impl] = None  # its head is in the root's group: a call that changes no number, skipped
                continue
            recorder = Collectives(optimizer_step=name == "step") if self.compare_collectives else contextlib.nullcontext()
            # shardkit's side alone: the dtype audit holds whatever FSDP2 does (checked below)
            audit = Audit(*self.meshes.values(), all_to_all_sums=name != "step") if side.impl == "shardkit" else contextlib.nullcontext()
            audits[side.impl] = audit
            try:
                with recorder, audit:
                    method(*args, side=side)
                outcomes[side.impl] = None
            except Boom:
                outcomes[side.impl] = None
            except Exception as e:  # noqa: BLE001 - judged below
                outcomes[side.impl] = e
            side.seen = getattr(recorder, "seen", [])
        if self.numerics:
            method(*args, side=None)  # the reference, and the bookkeeping
        else:
            method(*args, side=None, reference=False)
        self._judge_errors(cmd, outcomes)
        self._check_reduce_dtype(cmd, audits.get("shardkit"))
        self.log.append(f"{cmd}: ok")
        self.check(cmd)

    def _judge_errors(self, cmd: tuple, outcomes: dict) -> None:
        mine = outcomes.get("shardkit")
        theirs = outcomes.get("torch", "absent")
        if mine is not None and theirs is None:
            raise Failure(f"{cmd}: shardkit raised where FSDP2 did not: {type(mine).__name__}: {mine}")
        if mine is not None:
            raise Failure(f"{cmd}: shardkit raised {type(mine).__name__}: {mine} (FSDP2: {theirs!r}); no call of this vocabulary should")
        if isinstance(theirs, BaseException):
            torch_side = self.sides[1]
            torch_side.alive, torch_side.why_out = False, f"{cmd}: {type(theirs).__name__}: {theirs}"

    # Checking -----------------------------------------------------------------------------
    def check(self, cmd: tuple) -> None:
        if self.compare_collectives:
            self._check_collectives(cmd)
        self._check_grad_hooks(cmd)
        self._check_pre_hooks(cmd)
        if not self.numerics:
            return
        if cmd[0] == "step":
            self._check_muon_step(cmd)
        tol = self.tolerance()
        if cmd[0] == "evaluate":
            for side in self.live_sides():
                loss = side.eval_loss.clone()
                dist.all_reduce(loss)
                self._compare(side, f"{cmd[2]} loss", loss / self.world, self.ref_eval_loss, tol)
        if cmd[0] in FORWARDS and self.ref_loss is not None:
            for side in self.live_sides():
                if side.loss is None:
                    continue
                loss = side.loss.detach().float().clone()
                dist.all_reduce(loss)
                self._compare(side, "loss", loss / self.world, self.ref_loss.detach().float(), tol)
        for name, ref in self.ref_params.items():
            alike = {side.impl: _full(side.params[name]) for side in self.live_sides()}
            for side in self.live_sides():
                self._compare(side, f"parameter {name}", alike[side.impl], ref.detach(), tol, alike)
        if self.grads_complete():
            for name, ref in self.ref_params.items():
                want = None if ref.grad is None else ref.grad * self.grad_scale(name)
                alike = {side.impl: None if side.params[name].grad is None else _full(side.params[name].grad) for side in self.live_sides()}
                for side in self.live_sides():
                    got = alike[side.impl]
                    if want is None and got is None:
                        continue
                    if want is None:  # no rank used it: None, as in one process
                        self._fail_or_drop(side, f"gradient {name}: set ({'zeros' if not got.any() else 'nonzero'}) where the reference's is None")
                        continue
                    if got is None:  # zeros and None are the same gradient this way round
                        if bool(want.any()):
                            self._fail_or_drop(side, f"gradient {name}: None vs reference set")
                        continue
                    self._compare(side, f"gradient {name}", got, want, tol, alike)
        self._compare_with_fsdp2(cmd)

    def _check_muon_step(self, cmd: tuple) -> None:
        """shardkit.optim.Muon's step, on either side's parameters, is torch.optim.Muon's on
        the gathered tensors, bit for bit (a failure on FSDP2's side too is shardkit's)."""
        for side in self.live_sides():
            for p, want in side.muon_expected:
                got = _full(p)
                if not torch.equal(got, want):
                    d = (got.double() - want.double()).abs().max().item()
                    raise Failure(f"{cmd}: shardkit.optim.Muon on {side.impl}'s parameter of shape {list(p.shape)}: "
                                  f"{d:.3g} from torch.optim.Muon's step on the gathered tensors")
            side.muon_expected = []

    def tolerance(self) -> dict:
        """How far from the reference a value may be: ``atol + rtol * |reference|``, elementwise,
        or with ``of_largest`` of the tensor's largest element (bf16 math against an fp32
        reference: its error scales with the tensor, not each element)."""
        if self.spec.mp:
            # bf16 compute against the fp32 reference, relative to the largest element; with
            # ``mixed`` the float64 parameter is computed in bf16 too (FSDP2 refuses that model),
            # a second rounding on the same path: 0.15 (make fuzz seed 2915 measured 0.113 of the
            # largest after Muon and load_reference(2.0), the same in eager and compiled mode).
            return dict(rtol=1.5e-1 if self.spec.mixed else 1e-1, atol=2e-2, of_largest=True)  # FSDP2 is compared tightly
        if self.muon_steps:
            # Muon's Newton-Schulz runs in bf16 on both sides: a gradient's last bit (the sharded
            # sum's order) can flip a bf16 rounding, and Newton-Schulz amplifies it (a batch of 4
            # gives rank-deficient gradients, whose near-zero singular values its five iterations
            # raise towards 1). The weights then differ, the next gradients more: the error grows
            # with the steps, at most 8e-4 of the largest element a step in 160 sequences of 14
            # steps (none in the first two); we allow 3e-3 a step.
            return dict(rtol=3e-3 * self.muon_steps, atol=1e-5, of_largest=True)
        return dict(rtol=1e-4, atol=1e-5, of_largest=False)

    def _compare(self, side: Side, what: str, got: torch.Tensor, want: torch.Tensor, tol: dict, alike: dict | None = None) -> None:
        """``got`` against the reference's ``want``; ``alike``: every live side's value of the
        same tensor. Under bf16 compute (``mp``) a value off the fp32 reference by more than the
        tolerance is still right when shardkit and FSDP2 both computed it, alike: bf16 math
        itself is that far off there (make fuzz seed 4338: blocks.2.lin.bias 0.158 of the
        largest element after two steps on 3 nested blocks with a tied weight, shardkit and
        FSDP2 bit for bit equal; the next call compares again)."""
        if got.shape != want.shape:
            self._fail_or_drop(side, f"{what}: shape {tuple(got.shape)} vs reference {tuple(want.shape)}")
            return
        diff = (got.double() - want.double()).abs()
        scale = want.double().abs().max() if tol["of_largest"] else want.double().abs()
        if not bool((diff > tol["atol"] + tol["rtol"] * scale).any()):
            return
        if self.spec.mp and alike is not None and _computed_alike(alike):
            self.log.append(f"{what}: {diff.max().item():.3g} off the fp32 reference, on shardkit and FSDP2 alike (bf16 math)")
        else:
            self._fail_or_drop(side, f"{what}: max |diff| {diff.max().item():.3g} from the unsharded reference (tolerance {tol}; largest {want.double().abs().max().item():.3g}, got largest {got.double().abs().max().item():.3g})")

    def _fail_or_drop(self, side: Side, why: str) -> None:
        if side.impl == "shardkit":
            raise Failure(why)
        side.alive, side.why_out = False, f"disagrees with the reference: {why}"

    def _check_grad_hooks(self, cmd: tuple) -> None:
        """Each parameter's post-accumulate-grad hooks ran as often as FSDP2's (once per
        reduction that gave it a gradient), whatever the values (both tiers)."""
        calls = [Counter(side.hook_calls) for side in self.sides]
        for side in self.sides:
            side.hook_calls.clear()
        if len(self.sides) < 2 or not all(side.alive for side in self.sides[:2]) or self.sides[1].witness_only or self.fsdp2_zero_grads:
            return
        if calls[0] != calls[1]:
            raise Failure(f"{cmd}: post-accumulate-grad hook calls {dict(calls[0])}, FSDP2's {dict(calls[1])}")

    def _check_pre_hooks(self, cmd: tuple) -> None:
        """What each forward pre-hook of ``do_pre_hook`` read: the whole weight, not its shard
        (both tiers), and in the numerics tier the reference's values (in the side's dtype)."""
        for side in self.sides:
            reads = list(side.pre_hook_reads)
            side.pre_hook_reads.clear()  # (the hooks hold this list)
            for target, weight in reads if side.alive else ():
                want = self.reference.get_submodule(target).lin.weight.detach()
                if self.spec.mesh == "hsdp_tp" and isinstance(weight, DTensor) and weight.device_mesh.mesh_dim_names == ("tp",):
                    weight = weight.full_tensor()  # tensor parallel's own DTensor: whole over the data-parallel dims
                if isinstance(weight, DTensor) or weight.shape != want.shape:
                    read = "a sharded DTensor" if isinstance(weight, DTensor) else f"a tensor of shape {tuple(weight.shape)}"
                    self._fail_or_drop(side, f"{cmd}: the forward pre-hook of {target} read {read}, not the whole weight {tuple(want.shape)}")
                elif self.numerics:
                    self._compare(side, f"{cmd}: {target}.lin.weight in its forward pre-hook", weight, want.to(weight.dtype), self.tolerance())

    def _compare_with_fsdp2(self, cmd: tuple) -> None:
        if len(self.live_sides()) < 2 or self.sides[1].witness_only:
            return
        mine, theirs = self.sides[0], self.sides[1]
        pairs = [(f"parameter {name}", mine.params[name], theirs.params[name]) for name in self.ref_params]
        if self.grads_complete():
            pairs += [(f"gradient {name}", mine.params[name].grad, theirs.params[name].grad) for name in self.ref_params]
        for what, a, b in pairs:
            if a is None or b is None:
                continue  # None and zeros: checked against the reference
            a, b = _full(a), _full(b)
            if not torch.equal(a, b):
                d = (a.double() - b.double()).abs().max().item()
                if d > _fsdp2_bound(b, self.spec.mp):
                    raise Failure(f"{cmd}: {what} differs from FSDP2's by {d:.3g} (both agree with the reference within its tolerance)")

    def _check_reduce_dtype(self, cmd: tuple, audit) -> None:
        """The dtype audit (tests/dtype_audit.py) on shardkit's collectives of this call: none that
        sums gradients runs below the reduce dtype (the policy's fp32, else the model's dtype)."""
        if isinstance(audit, Audit):
            reduce_dtype = torch.float32 if self.spec.mp else self.dtype
            try:
                audit.assert_sums_in(reduce_dtype, what=f"{cmd}")
            except AssertionError as e:
                raise Failure(str(e)) from None

    def _check_collectives(self, cmd: tuple) -> None:
        if len(self.live_sides()) < 2 or self.lockstep or self.sides[1].witness_only:
            return
        mine, theirs = comparable(self.sides[0].seen), comparable(self.sides[1].seen)
        labels = ("all-gathers (dtype, numel)", "reductions (op)", "all-reduces (op)", "the optimizer's all-to-alls (dtype, sent, received)")
        if self.fsdp2_zero_grads:
            mine, theirs = mine[:3], theirs[:3]
        # Compiled mode run eagerly keeps a group's gathered parameters from forward to backward
        # (autograd saves them), where FSDP2 gathers a resharded group again: not compared.
        # With reshard_after_forward=R it gathers each group in two steps in forward: not compared either.
        two_steps = self.spec.compiled_mode and not isinstance(self.spec.reshard, bool)
        first = 0 if self.gathers_comparable and not (self.spec.compiled_mode and cmd[0] == "backward") and not two_steps else 1
        for label, a, b in list(zip(labels, mine, theirs))[first:]:
            if a != b:
                raise Failure(f"{cmd}: {label} differ from FSDP2's: shardkit {dict(a)} vs FSDP2 {dict(b)}")

    # The calls: each ``do_X(*args, side=..., dry=False)``; ``dry``: is its precondition met;
    # ``side=None``: the reference's part and the bookkeeping. -----------------------------
    def do_forward(self, seed: int, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry:
            return True
        x, y = self._batch(seed, local=side is not None)
        if side is not None:
            side.loss = None
            side.loss = loss_of(side.model, x, y)
        elif reference:
            self.ref_loss = loss_of(self.reference, x, y)
        else:
            self.ref_loss = torch.zeros(())
        return True

    def do_penalized_forward(self, seed: int, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        """A forward whose loss adds a gradient penalty (WGAN-GP's): the squared gradient of the
        output with respect to the input, taken with ``create_graph=True`` (a first backward),
        which the next ``backward`` runs through. Each rank's penalty sums over its rows; the
        reference's, over all rows, is divided by the ranks, as the sharded gradients are
        averaged. (FSDP2's second backward fails: it freed the parameters the first one's graph
        reads.)"""
        if dry:
            return self.spec.tied == "none"  # a float input to differentiate by
        if side is None and not reference:
            self.ref_loss = torch.zeros(())
            return True
        x, y = self._batch(seed, local=side is not None)
        x, model = x.clone().requires_grad_(True), side.model if side is not None else self.reference
        out = model(x)
        grad_x, = torch.autograd.grad(out.float().sum(), x, create_graph=True)
        loss = output_loss(model, out, y) + grad_x.float().pow(2).sum() / (1 if side is not None else self.dp_world)
        if side is not None:
            side.loss = loss
        else:
            self.ref_loss = loss
        return True

    def do_evaluate(self, seed: int, mode: str, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        """A forward under ``torch.no_grad`` or ``torch.inference_mode`` (a validation pass):
        its loss against the reference's, and every later call as before."""
        if dry:
            return self.ref_loss is None  # not between a forward and its backward
        x, y = self._batch(seed, local=side is not None)
        with {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]():
            loss = loss_of(side.model if side is not None else self.reference, x, y) if side is not None or reference else torch.zeros(())
        loss = torch.tensor(loss.item())  # (an inference tensor cannot be all-reduced outside inference mode)
        if side is not None:
            side.eval_loss = loss
        else:
            self.ref_eval_loss = loss
        return True

    def _batch(self, seed: int, local: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of ``seed``, or (``local``) this rank's part of it."""
        x, y = batch(seed, self.spec)
        if x.is_floating_point():
            x = x.to(self.dtype)
        if not local:
            return x, y
        per = BATCH // self.dp_world if BATCH >= self.dp_world else 1
        lo = (self.dp_rank * per) % BATCH
        return x[lo : lo + per], y[lo : lo + per]

    def do_backward(self, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry:
            return self.ref_loss is not None
        if side is not None:
            loss, side.loss = side.loss, None
            if loss is not None:
                loss.backward()
            return True
        if reference:
            self.ref_loss.backward()
        self.ref_loss = None
        for g in self.groups:
            self.unreduced[g] = not (self.sync[g] and (self.all_reduce[g] or not self.hsdp(g)))
        return True

    def hsdp(self, group: str) -> bool:
        """Whether some of the group's parameters are on a 2-D mesh (set_requires_all_reduce
        applies): all, or with ``param_mesh`` the blocks' lin.weight."""
        return self.spec.mesh != "1d" or self.spec.param_mesh and group.startswith("blocks.") and group.count(".") == 1

    def do_pipeline_microbatches(self, seed: int, n: int, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        """What torch.distributed.pipelining does to a stage module over one step: before each
        microbatch's backward, gradient sync, resharding after backward and "last backward"
        off; then all on, every group's ``post_backward()`` and the root's final callback,
        reached through torch's ``fully_shard.state`` (shardkit: its FSDP2 view)."""
        if dry:
            return self.idle() and not self.lockstep and not self.unwaited
        if side is None:
            for i in range(n):
                self.do_forward(seed + i, reference=reference)
                self.do_backward(reference=reference)
            self.sync = dict.fromkeys(self.groups, True)
            self.all_reduce = dict.fromkeys(self.groups, True)
            self.unreduced = dict.fromkeys(self.groups, False)
            self.kept_after_backward.clear()
            return True
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        root = side.model
        for i in range(n):
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(False)
            root.set_requires_gradient_sync(False)
            self.do_forward(seed + i, side)
            self.do_backward(side)
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(True)
        state = torch_fully_shard.state(root)
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        return True

    def do_step(self, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry:
            return self.grads_complete()
        if side is not None:
            if side.impl == "torch" and _fsdp2_unsharded(side.model):
                # make fuzz seed 513 (reshard_after_backward(False) on a block, steps): FSDP2's next
                # forward skips the all-gather and runs on the weights from before the step (fp32:
                # its loss 0.0045 off the reference; bf16 hid it); shardkit gathers again.
                side.alive, side.why_out = False, "an optimizer step while unsharded: FSDP2's next forward uses the weights from before it"
                return True
            side.muon_expected = torch_muon_step(side.optim.muon) if self.numerics and side.optim.muon else []
            side.optim.step()
            side.optim.zero_grad()
            return True
        if reference:
            with torch.no_grad():
                for name, p in self.ref_params.items():
                    if p.grad is not None:
                        p.grad.mul_(self.grad_scale(name))
            self.ref_optim.step()
            self.ref_optim.zero_grad()
        self.muon_steps += self.spec.optim != "adamw"
        return True

    def do_clip(self, max_norm: float, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        """``shardkit.clip_grad_norm_`` on either side's parameters (FSDP2's too: torch's own
        clip raises on a mix of meshes); the reference clips by torch's formula on its
        gradients as the sharded side holds them (x ``grad_scale``), so that the norms and the
        clipped gradients compare."""
        if dry:
            return self.idle()
        if side is not None:
            side.clip_norm = shardkit_clip(list(side.params.values()), max_norm)
            return True
        if not reference:
            return True
        grads = [(p, self.grad_scale(name)) for name, p in self.ref_params.items() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad * scale for p, scale in grads]) if grads else torch.tensor(0.0)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            for p, _ in grads:
                p.grad.mul_(coef.to(p.grad.dtype))
        for side in self.live_sides():
            self._compare(side, "clip_grad_norm_'s total norm", side.clip_norm.detach().double(), norm.detach().double(), self.tolerance())
        return True

    def do_zero_grad(self, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry:
            return self.grads_complete()
        if side is not None:
            side.optim.zero_grad()
        elif reference:
            self.ref_optim.zero_grad()
        return True

    def do_unshard(self, target: str, how: str, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry or side is None:
            return True
        module = side.model.get_submodule(target)
        if how == "sync":
            assert module.unshard() is None
            return True
        handle = module.unshard(async_op=True)
        if how in ("async_wait", "async_wait_twice"):
            handle.wait()
        if how == "async_wait_twice":
            handle.wait()
        return True

    def do_pre_hook(self, target: str, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        """A forward pre-hook on block ``target`` (once per block) that reads its ``lin.weight``,
        as the hook-based ``spectral_norm`` and ``weight_norm`` read theirs: FSDP2 unshards
        before a module's own pre-hooks, so each forward's hook sees the whole weight."""
        if dry:
            return target.startswith("blocks.")
        if side is None:
            return True
        block = side.model.get_submodule(target)
        if not getattr(block, "_fuzz_pre_hooked", False):
            block.register_forward_pre_hook(lambda m, args, reads=side.pre_hook_reads: reads.append((target, _read(m.lin.weight))))
            block._fuzz_pre_hooked = True
        return True

    def do_reshard(self, target: str, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry or side is None:
            return True
        side.model.get_submodule(target).reshard()
        return True

    def do_set(self, knob: str, target: str, value: Any, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry:
            if knob == "gradient_divide_factor":  # grads already reduced with the old factor
                return self.idle() and all(p.grad is None for p in self.ref_params.values())
            if knob in ("requires_gradient_sync", "requires_all_reduce"):
                return self.ref_loss is None  # the bookkeeping decides at backward
            if knob == "lockstep":
                return self.ref_loss is None  # between steps
            return True
        if side is None:
            recursive = KNOBS[knob][1]
            groups = [g for g in self.groups if g == target or recursive and (target == "" or g.startswith(target + "."))]
            if knob == "reshard_after_backward":
                (self.kept_after_backward.difference_update if value else self.kept_after_backward.update)(groups)
            if knob == "requires_gradient_sync":  # (and requires_all_reduce, as FSDP2)
                self.sync.update({g: value for g in groups})
                self.all_reduce.update({g: value for g in groups})
            elif knob == "requires_all_reduce":
                self.all_reduce.update({g: value for g in groups})
            elif knob == "gradient_divide_factor":
                self.factor[target] = value
            return True
        module = side.model.get_submodule(target)
        if knob == "modules_to_forward_prefetch":
            value = [side.model.get_submodule(n) for n in value]
        if knob == "modules_to_backward_prefetch":
            value = [side.model.get_submodule(n) for n in value]
        if knob in ("is_last_backward", "lockstep"):  # the root's
            module = side.model
        if knob == "lockstep" and side.impl == "torch":
            return True  # shardkit only; here every rank runs every module, so FSDP2 needs nothing
        if knob == "all_reduce_hook":
            module.set_all_reduce_hook(_leave_as_is)
        elif knob == "custom_comms":
            from tests.gloo.extension_tensors import UserComm

            module.set_custom_all_gather(UserComm("all_gather"))
            module.set_custom_reduce_scatter(UserComm("reduce_scatter"))
        else:
            getattr(module, f"set_{knob}")(value)
        return True

    def do_state_dict_roundtrip(self, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry:
            return self.idle()
        if side is not None:
            sd = {k: v.detach().clone() for k, v in side.model.state_dict().items()}
            side.model.load_state_dict(sd)
        return True

    def do_state_dict_from_thread(self, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        """``state_dict()`` from another thread (torchft's quorum thread), the training thread
        waiting: the same keys, placements and local shards as the training thread's own after it."""
        if dry:
            return self.idle()
        if side is not None:
            got: list = []
            reader = threading.Thread(target=lambda: got.append({k: v.detach().clone() for k, v in side.model.state_dict().items()}))
            reader.start()
            reader.join()
            own = side.model.state_dict()
            assert got and set(got[0]) == set(own), (side.impl, sorted(set(got[0]) ^ set(own)) if got else "the thread raised")
            for k, v in own.items():
                theirs = got[0][k]
                assert type(theirs) is type(v) and getattr(theirs, "placements", None) == getattr(v, "placements", None), (side.impl, k, type(theirs))
                local = (lambda t: t.to_local() if hasattr(t, "to_local") else t)
                assert torch.equal(local(theirs), local(v)), (side.impl, k, "the thread read other values")
        return True

    def do_load_reference(self, scale: float, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        """The reference's parameters times ``scale``, loaded as DTensors into the sharded ones.
        Under bf16 compute (``mp``) never beyond the initial weights: larger, the tanh blocks
        saturate and bf16 itself is off the fp32 reference by more than the tolerance. The
        unsharded model cast to bf16 in one process, against the fp32 one, from the same weights
        (make fuzz seeds 310 and 312): at 4x, 62.39 of 183 on inp.weight (eager and compiled
        shardkit both 62.3); at 2x (3 nested blocks, mixed dtypes), 0.393 of 2.42 on
        blocks.0.lin.bias (both modes 0.393). Sharding cannot be judged there."""
        if dry:
            return self.idle() and not (self.spec.mp and self.loaded_scale * scale > 1.0)
        if side is not None:
            if side.impl == "torch" and _fsdp2_unsharded(side.model):
                # make fuzz seed 418 (unshard(async_op=True), load, train): FSDP2's next forward
                # runs on the unsharded weights from before the load (fp32: its loss 0.00427 off
                # the reference; bf16 hid it in the tolerance); shardkit reshards on load.
                side.alive, side.why_out = False, "load_state_dict while unsharded: FSDP2 keeps the weights from before the load"
                return True
            sd = {}
            for name, value in self.reference.state_dict().items():
                p = side.params[name] if name in side.params else side.params[_tied_name(name, side.params)]
                sd[name] = distribute_tensor(value.detach() * scale, p.device_mesh, p.placements)
            side.model.load_state_dict(sd)
            return True
        with torch.no_grad():
            for p in self.reference.parameters():
                p.mul_(scale)
        self.loaded_scale *= scale
        return True

    def do_raise_in_forward(self, seed: int, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry:
            return self.idle()
        if side is None:
            return True
        block = side.model.blocks[-1]
        block.fail = True
        try:
            self.do_forward(seed, side=side)
        except Boom:
            pass
        finally:
            block.fail = False
            side.loss = None
        side.model.reset_iter_state()
        return True

    def do_to_float64(self, side: Side | None = None, dry: bool = False, reference: bool = True) -> bool:
        if dry:
            return self.idle() and self.dtype is torch.float32  # (with mp too: the policy stays, as in FSDP2)
        if side is not None:
            side.model.to(torch.float64)
            if side.impl == "torch" and _fsdp2_gathers_in(side.model) - {torch.float64} and not self.spec.mp:
                # make fuzz seed 12 (pipeline_microbatches, to_float64, train on HSDP): FSDP2 keeps the
                # all-gather buffers of its lazy init, so it computes and reduces in float32 (AVG)
                # on a float64 model, or fails on a dtype mismatch; shardkit gathers in float64.
                side.alive, side.why_out = False, "to(float64) after its first forward: FSDP2 still gathers and reduces in float32"
            return True
        if reference:
            self.reference.to(torch.float64)
        self.dtype = torch.float64
        self._new_optimizers()  # after every side moved
        return True


def _prefetches_back(knob: str, target: str, names: list[str]) -> bool:
    """Whether a prefetch list names a group that runs before ``target`` in that pass (blocks
    run in index order forward, the reverse backward; the root first forward, last backward;
    the head, where it has a group of its own, after the blocks forward, first backward)."""
    def index(name: str) -> int:
        return -1 if name == "" else 10**6 if name == "head" else int(name.split(".")[1])
    if knob == "modules_to_forward_prefetch":
        return any(index(n) <= index(target) for n in names)
    return target != "" and any(index(n) >= index(target) for n in names)


def _read(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` as a pre-hook reads it. Under inference_mode a tensor-parallel weight
    is cloned without ``detach()``: torch refuses to detach, inside inference_mode, a DTensor made
    outside it ("Cannot set version_counter for inference tensor"; FSDP2's weights after a
    training step and shardkit's unsharded ones alike); there nothing records autograd anyway."""
    if torch.is_inference_mode_enabled() and isinstance(weight, DTensor):
        return weight.clone()
    return weight.detach().clone()


def _leave_as_is(reduced: torch.Tensor) -> None:
    """An all-reduce hook that changes nothing (it moves the reduction to the hook's route)."""


def _tied_name(name: str, params: dict) -> str:
    """``head.weight`` of a tied model is ``emb.weight`` in ``named_parameters``."""
    return "emb.weight" if name == "head.weight" else name


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


# name -> (value strategy key, recursive)
KNOBS = {
    "reshard_after_forward": ("bool", True),
    "reshard_after_backward": ("bool", True),
    "requires_gradient_sync": ("bool", True),
    "requires_all_reduce": ("bool", True),
    "is_last_backward": ("bool", False),
    "gradient_divide_factor": ("factor", False),
    "force_sum_reduction_for_comms": ("bool", False),
    "reduce_scatter_max_input_buffers": ("buffers", True),
    "modules_to_forward_prefetch": ("prefetch", False),
    "modules_to_backward_prefetch": ("prefetch", False),
    "reduce_scatter_unused_params": ("bool", True),
    "all_reduce_hook": ("on", False),  # a hook that changes nothing
    "custom_comms": ("on", False),  # set_custom_all_gather / set_custom_reduce_scatter (plain torch.distributed)
    "lockstep": ("bool", False),  # shardkit only (FSDP2 has no set_lockstep: nothing is called there)
}


def _on_the_heads_group_alone(name: str, args: list) -> bool:
    """A call on the head's own group (a weight tied across groups) that changes no number: the
    bf16 witness, whose head is in the root's group, skips it (Run). The knobs that change the
    gradients (sync, all-reduce, divide factor) make it drop out instead."""
    if name in ("unshard", "reshard"):
        return args[0] == "head"
    if name != "set" or args[0] in ("requires_gradient_sync", "requires_all_reduce", "gradient_divide_factor"):
        return False
    knob, target, value = args
    return target == "head" or KNOBS[knob][0] == "prefetch" and "head" in value


def _computed_alike(values: dict) -> bool:
    """Whether shardkit's and FSDP2's values (both sides live) agree within what the two
    compare to under bf16 compute (``_compare_with_fsdp2``)."""
    a, b = values.get("shardkit"), values.get("torch")
    if a is None or b is None or a.shape != b.shape:
        return False
    return torch.equal(a, b) or (a.double() - b.double()).abs().max().item() <= _fsdp2_bound(b, mp=True)


def _fsdp2_bound(theirs: torch.Tensor, mp: bool) -> float:
    """How far shardkit's value may be from FSDP2's ``theirs`` (both on the same batches): a
    last bit of the sums' order, relative to the largest element; 100 times that under bf16."""
    return FSDP2_TOLERANCE * (100 if mp else 1) * max(1.0, theirs.double().abs().max().item())


def to_json(spec: Spec, commands: list[tuple], world: int, tier: str = "gloo") -> str:
    return json.dumps({"tier": tier, "world": world, "spec": asdict(spec), "commands": [list(c) for c in commands]})


def from_json(text: str) -> tuple[int, Spec, list[tuple]]:
    data = json.loads(text)
    return data["world"], Spec(**data["spec"]), [tuple(c) for c in data["commands"]]
