"""Lockstep: the schedule for ``fully_shard`` modules that run on some ranks only.

Every collective must be issued by every rank, in the same order. Normally that holds because
every rank runs the same modules in the same order. When a model skips whole ``fully_shard``
modules depending on the data (rank 0's batch takes branch ``a``, rank 1's branch ``b``;
a vision encoder runs only where there are images), rank 0 would all-gather ``a`` while rank
1 all-gathers ``b``: a hang, or worse, each rank receiving the other group's bytes.

``Lockstep`` (``root.set_lockstep(True)``) is the schedule's collectives strategy that does
its three collective steps (gather a group, reduce a group, the end of a pass) as *agree,
then act*: every
rank all-gathers one integer, the token of what it is about to do (gather or reduce group
``i``, or nothing), then every rank acts on the union of the requests, in token order: its
own action for its own token, and a stand-in for the others' (all-gather a group it does not
run now and free it again; reduce a group it has no gradients for, with zeros). A rank whose
forward or backward is over keeps agreeing (token ``DONE``) until every rank is. So the ranks
issue the same collectives in the same order, whatever each runs.

The price: one small blocking all-gather per collective, no prefetching, and each round's
reductions finished before the next token (their issue order must not depend on timing).
Reductions stay correct whatever the order: each reduce-scatter takes the gradient
accumulated so far and sums over ranks, so a group reduced twice (once for each rank's
backward) gets the sum of both parts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardkit.comm.collectives import _all_gather_single
from shardkit.eager.schedule import Direct, Schedule
from shardkit.eager.state import Event, GroupState, Phase

DONE, NOTHING = -1, -2
GATHER, REDUCE = 0, 1  # token = 2 * group index + kind


class Lockstep(Direct):
    uses_post_forward_shards = False  # every all-gather spans the whole shard dim

    def __init__(self, schedule: Schedule) -> None:
        super().__init__(schedule)
        self.tokens = _token_group(schedule.states)  # (process group, world)
        self._acting = False  # inside an agreed round: act at once

    def gather(self, state: GroupState) -> None:
        if state.group is None:
            return
        if not self._acting:
            self._agree(2 * self.schedule.states.index(state) + GATHER if state.group.needs_all_gather() else NOTHING)
        super().gather(state)  # registers data this rank already held, if nobody gathered

    def prefetch(self, target: GroupState, backward: bool) -> None:
        pass  # every all-gather is agreed on at the moment it is needed

    def reduce(self, state: GroupState, reshard: bool) -> None:
        if self._acting:
            return super().reduce(state, reshard)
        self._agree(2 * self.schedule.states.index(state) + REDUCE, own=(state, reshard))

    def pass_ends(self) -> None:
        while not self._agree(DONE):  # serve the ranks still in their pass
            pass

    def _agree(self, token: int, own: tuple | None = None) -> bool:
        """Every rank's token, then every requested action in token order, on every rank.
        Returns whether every rank said DONE."""
        tokens = self._exchange(token)
        self._acting = True
        try:
            for t in sorted({t for t in tokens if t >= 0}):
                state, kind = self.schedule.states[t // 2], t % 2
                if kind == GATHER:
                    self._stand_in_gather(state, keep=t == token or state.group.is_unsharded)
                elif t == token:
                    super().reduce(*own)
                else:
                    self._stand_in_reduce(state)
            # Every reduction finishes within its round: when it completes is a matter of timing,
            # and an HSDP all-reduce started "once the reduce-scatter is done" would land
            # before the next token on one rank and after it on another, on the same process
            # group where the replicate dim spans the world (torch then uses the default group).
            self.schedule.reducing.finish_all()
        finally:
            self._acting = False
        return all(t == DONE for t in tokens)

    def _stand_in_gather(self, state: GroupState, keep: bool) -> None:
        """All-gather the group on this rank too, even if it holds the data (another rank does
        not); keep it registered if this rank uses it (``keep``), else free it again."""
        group = state.group
        group.reshard()
        group.issue_unshard()
        group.wait_for_unshard()
        if not keep:
            group.reshard()

    def _stand_in_reduce(self, state: GroupState) -> None:
        """Another rank reduces this group now: take part with what this rank has so far (zeros
        if it never ran). A group in the middle of its backward here keeps its parameters."""
        if state.step.phase is Phase.IDLE:
            self.schedule.fire(state, Event.POST_BACKWARD)  # its reduce acts at once: we are acting
        else:
            super().reduce(state, reshard=state.step.phase is not Phase.PRE_BACKWARD)

    def _exchange(self, token: int) -> list[int]:
        pg, world = self.tokens
        mine = torch.tensor([token], dtype=torch.int64, device=self.schedule.device)
        every = mine.new_empty(world)
        work = _all_gather_single(every, mine, group=pg)
        if work is not None:
            work.wait()
        return every.tolist()


def _token_group(states: list[GroupState]) -> tuple:
    """The ranks the tokens go to: every rank of the groups' mesh (both dims for HSDP; with
    tensor parallel beside it, the data-parallel ranks only: each tp rank agrees with its own)."""
    meshes = [part.mesh for s in states if s.group is not None for part in s.group.parts]
    if not meshes:
        return dist.group.WORLD, dist.get_world_size()
    mesh = meshes[0]
    if mesh.ndim == 1:
        return mesh.get_group(), mesh.size()
    if mesh.size() == dist.get_world_size():
        return dist.group.WORLD, mesh.size()
    return mesh._flatten().get_group(), mesh.size()  # (made once per mesh; every rank sets lockstep)
