"""The runtime's schedule replayed over a profile: which buffers exist at each operator.

For every group the runtime holds, at known points of the step (the rules in ``state.py``'s ``RULES``, run by ``schedule.py``):

- its all-gather buffers, from the issue (the previous group's pre-forward when prefetching
  ``depth`` groups ahead, else its own) to the wait (its own pre-forward or pre-backward);
- its unsharded parameters, from the issue to the reshard (post-forward with
  ``reshard_after_forward=True``; the end of its backward with ``False``, the root's default);
  with ``reshard_after_forward=R`` the 1/R post-forward shard in between;
- each reduce-scatter (``comm/collectives.py``), issued at the group's post-backward and
  finished at worst when the group two reductions later has issued its own
  (``MAX_REDUCING``) or at the end of backward: until then, its input ``(world, shard +
  presence)`` and output chunk in ``reduce_dtype`` and the unsharded gradients it read (the
  collective keeps them alive); at the issue only, the gradients cast to ``reduce_dtype``
  (or zeros for a missing one) that the input is copied from;
- each parameter's unsharded gradient, from its first accumulation to that finish;
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
from shardkit.eager.schedule import MAX_REDUCING

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
    """The memory of one training step on ``rank``: the persistent state, and the peak over the
    profile's operators (``depth`` all-gathers prefetched) and the optimizer step."""
    params, grads, optim = persistent_state(groups, optimizer, rank)
    presence = sum(len(ps) * ps[0].reduce_dtype.itemsize for g in groups for ps in _trainable_buckets(g))
    mem = Memory(params, grads, optim, presence)
    schedule = _schedule(groups, prof, depth)
    timeline = _Timeline(max(prof.end, 1))
    for name in schedule.order:
        _hold_parameters(timeline, schedule, schedule.groups[name])
    _hold_reductions(timeline, schedule, prof, rank)
    _forward_backward_peak(mem, timeline, prof, schedule.order)
    _optimizer_step_peak(mem, groups, optimizer, foreach, rank)
    return mem


class _Timeline:
    """Bytes of each kind held at each operator, kept as difference arrays over op indices."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.lines = {kind: torch.zeros(n + 1, dtype=torch.int64) for kind in KINDS}

    def hold(self, kind: str, start: int, end: int, nbytes: int) -> None:
        """``nbytes`` of ``kind`` held from op ``start`` up to, not including, op ``end``."""
        start, end = max(0, min(start, self.n)), max(0, min(end, self.n))
        if nbytes and end > start:
            self.lines[kind][start] += nbytes
            self.lines[kind][end] -= nbytes

    def levels(self) -> dict[str, torch.Tensor]:
        """Bytes of each kind held at each op."""
        return {kind: line.cumsum(0)[: self.n] for kind, line in self.lines.items()}


@dataclass
class _Schedule:
    """Where each profiled group runs and where its all-gathers are issued, by group name."""

    groups: dict[str, GroupInfo]
    forward: dict[str, tuple[int, int]]  # (start, end) op indices, in forward order
    backward: dict[str, tuple[int, int]]  # same keys; a group with no backward of its own spans the whole of it
    issue_forward: dict[str, int]
    issue_backward: dict[str, int]  # only the groups that reshard, and so all-gather again

    @property
    def order(self) -> list[str]:
        return list(self.forward)


def _schedule(groups: list[GroupInfo], prof: Profile, depth: int) -> _Schedule:
    """The groups' spans in ``prof``, and their all-gathers' issue points with ``depth`` prefetched."""
    by_name = {g.name: g for g in groups}
    forward = {g: prof.forward[g] for g in prof.forward_order() if g in by_name}
    backward = {g: (prof.backward[g][0] if g in prof.backward else prof.backward_start, _end(prof, g)) for g in forward}
    order = list(forward)
    issue_forward = _issue_points(order, {g: forward[g][0] for g in order}, depth, lambda g: True)
    post_order = sorted(order, key=lambda g: forward[g][1])
    back_order = [g for g in reversed(post_order) if g in prof.backward]
    issue_backward = _issue_points(back_order, {g: backward[g][0] for g in back_order}, depth, lambda g: _reshards(by_name[g]))
    return _Schedule(by_name, forward, backward, issue_forward, issue_backward)


def _hold_parameters(timeline: _Timeline, schedule: _Schedule, g: GroupInfo) -> None:
    """A group's all-gather buffers and unsharded parameters: in forward, and again in backward
    when it reshards after forward (with the post-forward shard in between)."""
    raf = _raf(g)
    (forward_start, forward_end), (backward_start, backward_end) = schedule.forward[g.name], schedule.backward[g.name]
    issued = schedule.issue_forward[g.name]
    timeline.hold("unsharded parameters", issued, forward_end if raf is not False else backward_end, g.unsharded_bytes())
    timeline.hold("all-gather buffers", issued, forward_start, _all_gather_buffers(g, g.params[0].world))
    if g.name not in schedule.issue_backward:
        return
    issued = schedule.issue_backward[g.name]
    timeline.hold("unsharded parameters", issued, backward_end, g.unsharded_bytes())
    ranks = raf if raf is not True else g.params[0].world
    timeline.hold("all-gather buffers", issued, backward_start, _all_gather_buffers(g, ranks))
    if raf is not True:  # the post-forward shard, kept until the backward all-gather is waited for
        shard = sum(p.post_forward_numel(raf) * p.param_dtype.itemsize for p in g.params)
        timeline.hold("unsharded parameters", forward_end, backward_start, shard)


def _hold_reductions(timeline: _Timeline, schedule: _Schedule, prof: Profile, rank: int) -> None:
    """Each group's reduce-scatters (see the module docstring). The runtime issues them right
    after the group's last backward op, so the issue is counted at that op: what it then
    holds, plus what the issue allocates."""
    reductions = sorted(schedule.order, key=lambda g: schedule.backward[g][1])  # in the order they are issued
    for i, name in enumerate(reductions):
        issued = schedule.backward[name][1] - 1
        finished = schedule.backward[reductions[i + MAX_REDUCING]][1] if i + MAX_REDUCING < len(reductions) else timeline.n
        for p in schedule.groups[name].params:
            if p.fqn in prof.grad_arrival:  # the unsharded gradient
                timeline.hold("gradient buffers", prof.grad_arrival[p.fqn], finished, math.prod(p.shape) * p.param_dtype.itemsize)
        for ps in _trainable_buckets(schedule.groups[name]):
            itemsize = ps[0].reduce_dtype.itemsize
            chunk = (sum(p.shard_numel for p in ps) + len(ps)) * itemsize
            timeline.hold("gradient buffers", issued, finished, (ps[0].world + 1) * chunk)  # input and output
            # The casts are freed before the output chunk is allocated: the larger of the two counts.
            timeline.hold("gradient buffers", issued, issued + 1, max(_cast_copies(ps, prof) - chunk, 0))
            timeline.hold("sharded gradients", finished, timeline.n + 1, _sharded_grad_bytes(ps, rank))


def _cast_copies(ps: list[ParamInfo], prof: Profile) -> int:
    """The reduce-scatter input's sources that are not the gradients themselves: each gradient
    cast to ``reduce_dtype``, and zeros in its place where none arrived."""
    return sum(math.prod(p.shape) * p.reduce_dtype.itemsize for p in ps
               if p.param_dtype != p.reduce_dtype or p.fqn not in prof.grad_arrival)


def _forward_backward_peak(mem: Memory, timeline: _Timeline, prof: Profile, order: list[str]) -> None:
    """Set ``mem``'s peak over the profile's ops: its size, where it is, what it is made of."""
    n = timeline.n
    levels = timeline.levels()
    compute = torch.tensor(prof.curve[:n] + [0] * (n - len(prof.curve[:n])), dtype=torch.int64)
    # The grad-presence columns are made at the first backward and kept; we count them throughout.
    kept = {"parameters": mem.params, "optimizer state": mem.optimizer, "grad-presence columns": mem.bookkeeping}
    total = sum(kept.values()) + compute + sum(levels.values())
    k = int(total.argmax())
    mem.peak, mem.peak_at = int(total[k]), _where(prof, order, k)
    mem.at_peak = {**kept, **{kind: int(level[k]) for kind, level in levels.items()}, "activations and temporaries": int(compute[k])}
    mem.max_of = {**{kind: int(level.max()) for kind, level in levels.items()}, "activations and temporaries": int(compute.max())}


def _optimizer_step_peak(mem: Memory, groups: list[GroupInfo], optimizer: str, foreach: bool, rank: int) -> None:
    """The optimizer step holds the persistent state and its temporaries: the peak when that is higher."""
    step = mem.persistent + optimizer_step_temporaries(groups, optimizer, foreach, rank)
    if step > mem.peak:
        mem.peak, mem.peak_at = step, "optimizer step"
        mem.at_peak = {"parameters": mem.params, "optimizer state": mem.optimizer, "grad-presence columns": mem.bookkeeping,
                       "sharded gradients": mem.grads, "optimizer temporaries": step - mem.persistent}


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
