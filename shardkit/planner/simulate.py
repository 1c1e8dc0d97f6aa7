"""The runtime's schedule replayed over a profile: which buffers exist at each operator.

For every group the runtime holds, at known points of the step (``hooks.py``):

- its all-gather buffers, from the issue (the previous group's pre-forward when prefetching
  ``depth`` groups ahead, else its own) to the wait (its own pre-forward or pre-backward);
- its unsharded parameters, from the issue to the reshard (post-forward with
  ``reshard_after_forward=True``; the end of its backward with ``False``, the root's default);
  with ``reshard_after_forward=R`` the 1/R post-forward shard in between;
- each parameter's unsharded gradient, from its first accumulation to the group's
  post-backward;
- the reduce-scatter input, from the post-backward to its finish: at worst when the group
  two reductions later is issued (``MAX_REDUCING``) or at the end of backward;
- the sharded gradients, from that finish on.

Adding them to the profile's compute bytes at every operator gives the peak. The optimizer
step adds its own temporaries to the persistent state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from shardkit.planner.model import GroupInfo, ParamInfo
from shardkit.planner.profile import Profile
from shardkit.schedule import MAX_REDUCING

KINDS = ("unsharded parameters", "gradient buffers", "all-gather buffers", "sharded gradients")


@dataclass
class Memory:
    """Bytes on one rank (rank 0, which holds the most rows when shards are uneven)."""

    params: int  # sharded parameters (padded shards)
    grads: int  # sharded gradients
    optimizer: int  # optimizer state
    bookkeeping: int = 0  # the reduce-scatters' grad-presence columns: one element per parameter, kept
    peak: int = 0
    peak_at: str = ""  # "forward blocks.3", "backward <root>", "optimizer step"
    at_peak: dict[str, int] = field(default_factory=dict)  # what the peak is made of
    max_of: dict[str, int] = field(default_factory=dict)  # each kind's own maximum over the step

    @property
    def persistent(self) -> int:
        """What lives from step to step: parameters, gradients, optimizer state (and bookkeeping)."""
        return self.params + self.grads + self.optimizer + self.bookkeeping


def persistent_state(groups: list[GroupInfo], optimizer: str, rank: int = 0) -> tuple[int, int, int]:
    """(sharded parameter, sharded gradient, optimizer state) bytes on ``rank``."""
    params = sum(p.shard_numel * p.dtype.itemsize for g in groups for p in g.params)
    grads = sum(_sharded_grad_bytes(ps, rank) for g in groups for ps in _trainable_buckets(g))
    optim = sum(optimizer_state_bytes(p, optimizer, rank) for g in groups for p in g.params if p.requires_grad)
    return params, grads, optim


def optimizer_state_bytes(p: ParamInfo, optimizer: str, rank: int) -> int:
    """Adam/AdamW: exp_avg and exp_avg_sq like the local shard, plus a float32 step; SGD with
    momentum: one buffer; plain SGD: nothing."""
    local = p.local_numel(rank) * p.dtype.itemsize
    return {"adam": 2 * local + 4, "adamw": 2 * local + 4, "sgd": local, "sgd-nomomentum": 0}[optimizer]


def optimizer_step_temporaries(groups: list[GroupInfo], optimizer: str, foreach: bool, rank: int = 0) -> int:
    """Adam's ``exp_avg_sq.sqrt() / ...`` makes two temporaries like one shard at a time
    (for-loop, the CPU default) or one like every shard at once (foreach, the CUDA default)."""
    if optimizer not in ("adam", "adamw"):
        return 0
    sizes = [p.local_numel(rank) * p.dtype.itemsize for g in groups for p in g.params if p.requires_grad]
    return sum(sizes) if foreach else 2 * max(sizes, default=0)


def simulate(groups: list[GroupInfo], prof: Profile, depth: int, optimizer: str, foreach: bool, rank: int = 0) -> Memory:
    params, grads, optim = persistent_state(groups, optimizer, rank)
    presence = sum(len(ps) * ps[0].reduce_dtype.itemsize for g in groups for ps in _trainable_buckets(g))
    mem = Memory(params, grads, optim, presence)
    n = max(prof.end, 1)
    lines = {kind: torch.zeros(n + 1, dtype=torch.int64) for kind in KINDS}  # difference arrays over op indices

    def hold(kind: str, start: int, end: int, nbytes: int) -> None:
        start, end = max(0, min(start, n)), max(0, min(end, n))
        if nbytes and end > start:
            lines[kind][start] += nbytes
            lines[kind][end] -= nbytes

    by_name = {g.name: g for g in groups}
    fwd = {g: prof.forward[g] for g in prof.forward_order() if g in by_name}
    bwd = {g: (prof.backward.get(g, (prof.backward_start, n))[0], _end(prof, g)) for g in fwd}
    order = list(fwd)
    issue = _issue_points(order, {g: fwd[g][0] for g in order}, depth, lambda g: True)
    post_order = sorted(order, key=lambda g: fwd[g][1])
    regather = lambda g: _reshards(by_name[g]) and g in prof.backward  # noqa: E731
    back_order = [g for g in reversed(post_order) if g in prof.backward]
    issue_back = _issue_points(back_order, {g: bwd[g][0] for g in back_order}, depth, regather)

    for name in order:
        g, raf = by_name[name], _raf(by_name[name])
        (f_start, f_end), (b_start, b_end) = fwd[name], bwd[name]
        release = f_end if raf is not False else b_end
        hold("unsharded parameters", issue[name], release, g.unsharded_bytes())
        hold("all-gather buffers", issue[name], f_start, _all_gather_buffers(g, g.params[0].world))
        if name in issue_back:
            hold("unsharded parameters", issue_back[name], b_end, g.unsharded_bytes())
            ranks = raf if raf is not True else g.params[0].world
            hold("all-gather buffers", issue_back[name], b_start, _all_gather_buffers(g, ranks))
            if raf is not True:  # the post-forward shard, kept until the backward all-gather is waited for
                hold("unsharded parameters", f_end, b_start, sum(p.post_forward_numel(raf) * p.param_dtype.itemsize for p in g.params))
        for p in g.params:
            if p.fqn in prof.grad_arrival:
                hold("gradient buffers", prof.grad_arrival[p.fqn], b_end, math.prod(p.shape) * p.param_dtype.itemsize)

    reductions = sorted(order, key=lambda g: bwd[g][1])  # in the order they are issued
    for i, name in enumerate(reductions):
        issued = bwd[name][1]
        finished = bwd[reductions[i + MAX_REDUCING]][1] if i + MAX_REDUCING < len(reductions) else n
        for ps in _trainable_buckets(by_name[name]):
            send = ps[0].world * (sum(p.shard_numel for p in ps) + len(ps)) * ps[0].reduce_dtype.itemsize
            hold("gradient buffers", issued, finished, send)
            hold("sharded gradients", finished, n + 1, _sharded_grad_bytes(ps, rank))

    levels = {kind: line.cumsum(0)[:n] for kind, line in lines.items()}  # bytes held at each op
    compute = torch.tensor(prof.curve[:n] + [0] * (n - len(prof.curve[:n])), dtype=torch.int64)
    total = params + optim + presence + compute + sum(levels.values())  # presence: made at the first backward, kept
    k = int(total.argmax())
    mem.peak, mem.peak_at = int(total[k]), _where(prof, order, k)
    mem.at_peak = {"parameters": params, "optimizer state": optim, "grad-presence columns": presence, **{kind: int(lv[k]) for kind, lv in levels.items()},
                   "activations and temporaries": int(compute[k])}
    mem.max_of = {**{kind: int(lv.max()) for kind, lv in levels.items()}, "activations and temporaries": int(compute.max())}
    step = mem.persistent + optimizer_step_temporaries(groups, optimizer, foreach, rank)
    if step > mem.peak:
        mem.peak, mem.peak_at = step, "optimizer step"
        mem.at_peak = {"parameters": params, "optimizer state": optim, "grad-presence columns": presence, "sharded gradients": grads,
                       "optimizer temporaries": step - mem.persistent}
    return mem


def _issue_points(order: list[str], starts: dict[str, int], depth: int, needs) -> dict[str, int]:
    """When each group's all-gather is issued: at its own start, or up to ``depth`` groups
    earlier in ``order`` (prefetch)."""
    issue: dict[str, int] = {}
    for i, name in enumerate(order):
        for target in order[i : i + 1 + depth]:
            if target not in issue and needs(target):
                issue[target] = starts[name]
    return issue


def _raf(g: GroupInfo) -> bool | int:
    """``None`` (the default): True for a block, False for the root, which keeps its
    parameters from forward to backward."""
    return bool(g.name) if g.reshard_after_forward is None else g.reshard_after_forward


def _reshards(g: GroupInfo) -> bool:
    return _raf(g) is not False


def _end(prof: Profile, name: str) -> int:
    start, end = prof.backward.get(name, (0, -1))
    return end if end >= 0 else prof.end  # the root's inputs need no grad: it ends with the backward


def _all_gather_buffers(g: GroupInfo, ranks: int) -> int:
    """The all-gather's input (a concatenation, or a cast) and output (unless one parameter is
    gathered straight into its unsharded buffer), per dtype."""
    total = 0
    for dtype, ps in g.buckets("param_dtype").items():
        per_rank = sum(p.shard_numel if ranks == p.world else p.post_forward_numel(ranks) for p in ps)
        converts = any(p.dtype != dtype for p in ps)
        if len(ps) > 1 or converts:
            total += per_rank * dtype.itemsize
        if len(ps) > 1:
            total += ranks * per_rank * dtype.itemsize
    return total


def _trainable_buckets(g: GroupInfo) -> list[list[ParamInfo]]:
    return [[p for p in ps if p.requires_grad] for ps in g.buckets("reduce_dtype").values() if any(p.requires_grad for p in ps)]


def _sharded_grad_bytes(ps: list[ParamInfo], rank: int) -> int:
    """One reduce-scatter's result: the padded chunk in ``reduce_dtype``, of which each
    gradient is a view; or, when that is not the parameters' dtype, one cast per parameter."""
    if all(p.reduce_dtype == p.dtype for p in ps):
        return sum(p.shard_numel for p in ps) * ps[0].reduce_dtype.itemsize
    return sum(p.local_numel(rank) * p.dtype.itemsize for p in ps)


def _where(prof: Profile, order: list[str], k: int) -> str:
    """The innermost group running at op ``k``."""
    spans = prof.backward if k >= prof.backward_start else prof.forward
    what = "backward" if k >= prof.backward_start else "forward"
    inside = [g for g in order if g in spans and spans[g][0] <= k < (spans[g][1] if spans[g][1] >= 0 else prof.end)]
    name = min(inside, key=lambda g: spans[g][1] - spans[g][0], default="")
    return f"{what} {name or '<root>'}"
