"""Compiled mode's overlap: where the compiled graphs issue each group's collectives and wait
for them.

Traced as written, a group's all-gather is waited for right where it is issued, and inductor's
scheduler keeps a collective next to its wait (its peak-memory pass sinks it there). shardkit
gives that scheduler one more pass, run last (``reorder_for_compute_comm_overlap_passes``),
which orders the graph as eager shardkit's schedule, in forward and in backward alike:

- each group's all-gather, with the copy-in that feeds it, is issued right after the previous
  group's all-gather is waited for: it runs during the previous group's compute;
- each all-gather is waited for just before the first op that reads it;
- ``reshard_after_forward=R`` gathers a group in two steps in forward (gather.py): the second
  step is the one above, and the first (1/R of the bytes) is issued when the previous group's
  first step arrived, one group earlier, and waited for just before the second;
- each reduce-scatter is waited for (with what reads it: the division, the cast) just before
  the next reduce-scatter is issued, the last one at the end of the graph: one reduce-scatter
  in flight during the next group's backward compute.

So at most two groups are unsharded at once (the one computing, the one arriving), as in eager
mode, and one reduce-scatter is in flight (eager mode allows two: ``eager/schedule.py``'s
``MAX_REDUCING``). Only collectives on a compiled-mode group's process
group move, and the trace op of each (``shardkit::trace_collective``) moves with it. The order is
one sort: each op gets a place (its index, or the place its rule gives it), every op's place
is made no later than the places of the ops that read it, and the ops are sorted by (place,
index); an op's inputs always sort before it, so the sort is a valid order whatever the rules.
From torch 2.14 on, inductor's ``simple_overlap`` runs after this pass: it may swap a
collective with the wait or kernel just before it where its memory model allows (docs/design.md,
"The overlap pass on the 2-block GPT").
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

GATHER, SCATTER, WAIT = "all_gather", "reduce_scatter", "wait"
GROUPS: set[str] = set()  # the process groups of compiled-mode groups (fully_shard adds them)
REORDERED = [0]  # graphs whose order the inductor pass changed


@dataclass
class Op:
    """One op of a graph, for ``overlapped``: what it is and the earlier ops it reads."""

    kind: str = ""  # GATHER or SCATTER (a compiled-mode group's collective), WAIT, or "" (any other)
    deps: list[int] = field(default_factory=list)  # indices of the ops it reads
    trace_of: int | None = None  # a trace op: the collective (issued) or the wait (done) it records


def overlapped(ops: list[Op]) -> list[int]:
    """The indices of ``ops`` in the overlapped order (see the top of this file)."""
    n = len(ops)
    users: list[list[int]] = [[] for _ in range(n)]
    for i, op in enumerate(ops):
        for d in op.deps:
            users[d].append(i)
    wait_of = {d: i for i, op in enumerate(ops) if op.kind == WAIT for d in op.deps if ops[d].kind in (GATHER, SCATTER)}
    gathers = [i for i in wait_of if ops[i].kind == GATHER]
    scatters = [i for i in wait_of if ops[i].kind == SCATTER]
    fed = {g: f for g in gathers if (f := _gather_fed_by(wait_of[g], ops, users)) is not None}  # reshard_after_forward=R's first step -> its second
    place = [float(i) for i in range(n)]
    for g in gathers:  # waited for just before the first op that reads it
        place[wait_of[g]] = min(users[wait_of[g]], default=n) - 0.5
    last = [g for g in gathers if g not in fed]  # what the modules read
    for previous, g in zip(last, last[1:]):  # issued right after the previous group's wait
        place[g] = min(place[g], place[wait_of[previous]] + 0.25)
    for first, g in fed.items():  # a first step is waited for before the step it feeds...
        place[wait_of[first]] = min(place[wait_of[first]], place[g])
    for previous, g in zip(fed, list(fed)[1:]):  # ...and issued when the previous group's first step arrived
        place[g] = min(place[g], place[wait_of[previous]] + 0.1)
    for rs, following in zip(scatters, scatters[1:] + [None]):  # waited for before the next one
        late = n if following is None else following - 0.5
        for j in _downstream(wait_of[rs], users):
            place[j] = max(place[j], late)
    for i, op in enumerate(ops):  # a trace op sits by what it records
        if op.trace_of is not None:
            place[i] = place[op.trace_of] + (0.1 if ops[op.trace_of].kind == WAIT else -0.1)
    for i in reversed(range(n)):  # nothing after an op that reads it
        for d in ops[i].deps:
            place[d] = min(place[d], place[i])
    return sorted(range(n), key=lambda i: (place[i], i))


def _gather_fed_by(wait: int, ops: list[Op], users: list[list[int]], limit: int = 16) -> int | None:
    """The all-gather that reads what the all-gather waited for by ``wait`` gathered, through
    ops that are no collective (a view, a copy), looking at most ``limit`` ops ahead; or None."""
    seen, todo = {wait}, [wait]
    while todo and len(seen) <= limit:
        for u in users[todo.pop(0)]:
            if ops[u].kind == GATHER:
                return u
            if not ops[u].kind and u not in seen:
                seen.add(u)
                todo.append(u)
    return None


def _downstream(start: int, users: list[list[int]]) -> set[int]:
    seen, todo = {start}, [start]
    while todo:
        for u in users[todo.pop()]:
            if u not in seen:
                seen.add(u)
                todo.append(u)
    return seen


# Inductor ------------------------------------------------------------------------------------
class InductorPass:
    """``overlapped`` on inductor's scheduler nodes. Its ``uuid`` (the source of this file) keys
    inductor's caches, so a changed pass compiles anew."""

    def __call__(self, snodes: list[Any]) -> list[Any]:
        ops = _scheduler_ops(snodes)
        if not any(op.kind for op in ops):
            return snodes
        order = overlapped(ops)
        REORDERED[0] += order != list(range(len(order)))
        return [snodes[i] for i in order]

    def uuid(self) -> str:
        return _source_hash()

    def __reduce__(self) -> tuple:  # pickled into inductor's cache key
        return (InductorPass, (), {"uuid": self.uuid()})

    def __setstate__(self, state: dict) -> None:
        pass


@functools.cache
def _source_hash() -> str:
    return hashlib.sha256(open(__file__, "rb").read()).hexdigest()


def _scheduler_ops(snodes: list[Any]) -> list[Op]:
    from torch._inductor.utils import is_collective, is_wait

    name_to_buf = snodes[0].scheduler.name_to_buf
    index = {name: i for i, s in enumerate(snodes) for name in s.get_operation_names()}
    ops = []
    for i, s in enumerate(snodes):
        deps = set()
        for dep in s.unmet_dependencies:
            j = index.get(name_to_buf[dep.name].defining_op_name()) if dep.name in name_to_buf else None
            if j is None or j == i:
                continue
            if getattr(dep, "is_fake", False) and is_collective(s.node):
                continue  # inductor's order of the collectives: this pass gives its own, the same on every rank
            deps.add(j)
        ops.append(Op(deps=sorted(deps)))
        for kind, op in ((GATHER, torch.ops._c10d_functional.all_gather_into_tensor.default), (SCATTER, torch.ops._c10d_functional.reduce_scatter_tensor.default),
                         (SCATTER, torch.ops._c10d_functional.all_to_all_single.default)):  # (gather.py's reduce-scatter on gloo)
            if is_collective(s.node, op=op) and _group_name(s.node) in GROUPS:
                ops[i].kind = kind
        if is_wait(s.node):
            ops[i].kind = WAIT
    _pair_trace_ops(snodes, ops)
    return ops


def _group_name(node: Any) -> str | None:
    args = [*getattr(node, "constant_args", ()), *getattr(node, "kwargs", {}).values()]
    return next((a for a in reversed(args) if isinstance(a, str)), None)


def _pair_trace_ops(snodes: list[Any], ops: list[Op]) -> None:
    """Each trace op (issued: reads the collective's input; done: reads its waited output) by
    the collective or wait whose buffer it reads."""
    trace_op = torch.ops.shardkit.trace_collective.default
    collective_reading: dict[int, int] = {}  # an op -> the first collective that reads it
    for j, op in enumerate(ops):
        for d in op.deps if op.kind in (GATHER, SCATTER) else ():
            collective_reading.setdefault(d, j)
    for i, s in enumerate(snodes):
        if getattr(s.node, "op_overload", None) is not trace_op:
            continue
        done = bool(s.node.constant_args[-1]) if s.node.constant_args else False
        for d in ops[i].deps:
            if done and ops[d].kind == WAIT:
                ops[i].trace_of = d
            elif not done and d in collective_reading:
                ops[i].trace_of = collective_reading[d]


def install() -> None:
    """Add the pass to inductor's scheduler (once; after any pass already there)."""
    from torch._inductor import config

    passes = list(config.reorder_for_compute_comm_overlap_passes)
    if not any(isinstance(p, InductorPass) for p in passes):
        config.reorder_for_compute_comm_overlap_passes = passes + [InductorPass()]
    config.reorder_for_compute_comm_overlap = True
