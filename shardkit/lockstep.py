"""Lockstep mode: ``fully_shard`` modules that run on some ranks only.

Every collective must be issued by every rank, in the same order. Normally that holds because
every rank runs the same modules in the same order. When a model skips whole ``fully_shard``
modules depending on the data (rank 0's batch takes branch ``a``, rank 1's branch ``b``;
a vision encoder runs only where there are images), rank 0 would all-gather ``a`` while rank
1 all-gathers ``b``: a hang, or worse, each rank receiving the other group's bytes.

In lockstep mode (``root.set_lockstep(True)``) a group about to issue a collective first
*agrees* with the other ranks: every rank all-gathers one integer, the token of what it is
about to do (``gather`` or ``reduce`` group ``i``, or nothing). Then every rank does the
union of what was asked, in token order: its own action for its own token, and a stand-in
for the others' (all-gather a group it does not run now and free it again; reduce a group
it has no gradients for, with zeros). A rank that has finished its forward or backward keeps
agreeing (token ``DONE``) until every rank has. So the ranks issue the same collectives in
the same order, whatever each runs.

The price: one small blocking all-gather per collective, and no prefetching. Reductions stay
correct whatever the order: each reduce-scatter takes the gradient accumulated so far and
sums over ranks, so a group reduced twice (once for each rank's backward) gets the sum of
both parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shardkit.comm import collectives
from shardkit.state import Phase, PhaseEvent

if TYPE_CHECKING:
    from shardkit.hooks import GroupState
    from shardkit.root import RootContext

DONE, NOTHING = -1, -2


def gather(state: "GroupState") -> None:
    """Unshard ``state``'s group, agreeing first with the other ranks."""
    token = 2 * state.index if state.group.needs_all_gather() else NOTHING
    _round(state.ctx, token, state)
    state._unshard_locally()  # registers data this rank already held, if nobody gathered


def reduce(state: "GroupState") -> None:
    """Reduce ``state``'s gradients, agreeing first with the other ranks."""
    _round(state.ctx, 2 * state.index + 1, state)


def drain(ctx: "RootContext") -> None:
    """This rank's pass is over: serve the other ranks' requests until every rank is done."""
    while not _round(ctx, DONE, None):
        pass


def _round(ctx: "RootContext", token: int, own: "GroupState | None") -> bool:
    """Every rank's token, then every requested action in token order, on every rank.
    Returns whether every rank said DONE."""
    tokens = _all_tokens(ctx, token)
    for t in sorted({t for t in tokens if t >= 0}):
        state = ctx.states[t // 2]
        if t % 2 == 0:
            _gather(state, keep=state is own or state.group.is_unsharded)
        elif t == token:  # this rank's own reduction
            own._reduce_now()
        else:
            _stand_in_reduce(state)
    return all(t == DONE for t in tokens)


def _all_tokens(ctx: "RootContext", token: int) -> list[int]:
    mine = torch.tensor([token], dtype=torch.int64, device=ctx.device)
    every = mine.new_empty(ctx.lockstep_world)
    work = collectives._all_gather_single(every, mine, group=ctx.lockstep_group)
    if work is not None:
        work.wait()
    return every.tolist()


def _gather(state: "GroupState", keep: bool) -> None:
    """All-gather the group on this rank too, even if it holds the data (another rank does not);
    keep it registered if this rank uses it (``keep``), else free it again."""
    group = state.group
    group.reshard()
    group.unshard()
    group.wait_for_unshard()
    if not keep:
        group.reshard()


def _stand_in_reduce(state: "GroupState") -> None:
    """Another rank reduces this group now: take part with what this rank has so far (zeros
    if it never ran). A group in the middle of its backward here keeps its parameters."""
    if state.machine.phase is Phase.IDLE:
        state.machine.advance(PhaseEvent.POST_BACKWARD)
    state._reduce_now(reshard=state.machine.phase is not Phase.PRE_BACKWARD)
