"""The control state of a step, and the rules that change it, as data.

Each group (one ``fully_shard`` call) is in one ``Phase``. The module hooks report what torch
tells them to the root's ``Schedule`` (``schedule.py``), which turns it into an ``Event`` for
one group, looks ``(phase, event)`` up in ``RULES``, enters the rule's next phase and then
runs its actions, in order. A pair the table does not hold raises ``IllegalTransition``.
Re-entry (another module of the group, a nested call), recomputation under activation
checkpointing and the calls that open and close the forward pass are rows, not special
cases in the hooks. ``render_rules()`` prints the table (pinned by a test and in
docs/design.md).

Whether a group's parameters are sharded or unsharded is a second, orthogonal state, the
``ParamGroup``'s ``Holding`` (``param_group.py``), which only unshard / reshard change.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from shardkit.core.options import GroupOptions, RootOptions
from shardkit.eager.param_group import ParamGroup
from shardkit.core.policies import MixedPrecisionPolicy


class Phase(enum.Enum):
    IDLE = "IDLE"  # between passes: parameters sharded (or kept unsharded by choice)
    FORWARD = "FORWARD"  # inside the group's forward
    PRE_BACKWARD = "PRE_BACKWARD"  # backward has reached the group: parameters unsharded
    POST_BACKWARD = "POST_BACKWARD"  # the group's gradients are reduced


class Event(enum.Enum):
    START_FORWARD = "start_forward"  # a forward call starts and opens the forward pass
    PRE_FORWARD = "pre_forward"  # a forward call starts inside the pass
    RECOMPUTE = "recompute"  # a forward call starts inside backward (activation checkpointing)
    INNER_POST_FORWARD = "inner_post_forward"  # a call ends; others of the group are still open or to run
    POST_FORWARD = "post_forward"  # the group's last open call ends
    END_FORWARD = "end_forward"  # ... and it is the call that opened the pass
    PRE_BACKWARD = "pre_backward"  # a gradient reaches one of the group's outputs
    POST_BACKWARD = "post_backward"  # the gradients reach its inputs (or backward ends without that)
    FINALIZE = "finalize"  # the end of backward: the root's final callback
    RESET = "reset"  # reset_iter_state() after an exception


class Action(enum.Enum):
    """Each is the ``Schedule`` method of the same name."""

    OPEN_PASS = "open_pass"  # remember who opened the pass; move the inputs to the device
    BEGIN_CALLS = "begin_calls"  # count the open call and the group's modules yet to run
    ENTER = "enter"  # one more open call
    LEAVE = "leave"  # one call fewer
    UNSHARD = "unshard"  # unshard and wait: this group and the owners of tied weights it uses
    PREFETCH_FORWARD = "prefetch_forward"  # issue the all-gathers of the groups that run next
    HOOK_INPUTS = "hook_inputs"  # the post-backward fires when the inputs' gradients are computed
    RESHARD_AFTER_FORWARD = "reshard_after_forward"  # unless reshard_after_forward=False
    HOOK_OUTPUTS = "hook_outputs"  # the pre-backward fires when an output's gradient arrives
    CLOSE_PASS = "close_pass"  # finish groups that ran in part, free unused prefetches, keep the order
    QUEUE_FINALIZE = "queue_finalize"  # queue the end-of-backward callback, once per backward
    UNSHARD_FOR_BACKWARD = "unshard_for_backward"  # unless set_unshard_in_backward(False)
    PREFETCH_BACKWARD = "prefetch_backward"  # issue the all-gather of the group before it
    REDUCE = "reduce"  # reduce-scatter (or defer, for tied weights), reshard, finish completed ones
    END_STEP = "end_step"  # forget the step's calls; free an all-gather prefetched but not used
    DROP_STEP = "drop_step"  # wait for and drop collectives, reshard, drop partial gradients


@dataclass(frozen=True)
class Rule:
    next: Phase
    actions: tuple[Action, ...]
    why: str

    @functools.cached_property
    def methods(self) -> tuple[str, ...]:
        """The actions' ``Schedule`` method names (looked up once: enum values are slow)."""
        return tuple(a.value for a in self.actions)


P, E, A = Phase, Event, Action
_FORWARD = (A.UNSHARD, A.PREFETCH_FORWARD, A.HOOK_INPUTS)
_BACKWARD = (A.QUEUE_FINALIZE, A.UNSHARD_FOR_BACKWARD, A.PREFETCH_BACKWARD)
_AFTER_FORWARD = (A.LEAVE, A.RESHARD_AFTER_FORWARD, A.HOOK_OUTPUTS)
RULES: dict[tuple[Phase, Event], Rule] = {
    (P.IDLE, E.START_FORWARD): Rule(P.FORWARD, (A.OPEN_PASS, A.BEGIN_CALLS, *_FORWARD), "the root's forward opens the pass"),
    (P.IDLE, E.PRE_FORWARD): Rule(P.FORWARD, (A.BEGIN_CALLS, *_FORWARD), "a group's forward starts"),
    (P.FORWARD, E.PRE_FORWARD): Rule(P.FORWARD, (A.ENTER,), "re-entry: another module of the group, or a nested call"),
    (P.FORWARD, E.INNER_POST_FORWARD): Rule(P.FORWARD, (A.LEAVE,), "that call ends; the group's forward goes on"),
    (P.FORWARD, E.POST_FORWARD): Rule(P.IDLE, _AFTER_FORWARD, "the group's forward ends"),
    (P.FORWARD, E.END_FORWARD): Rule(P.IDLE, (*_AFTER_FORWARD, A.CLOSE_PASS), "the root's forward ends: so does the pass"),
    (P.IDLE, E.RECOMPUTE): Rule(P.FORWARD, (A.BEGIN_CALLS, A.UNSHARD, A.HOOK_INPUTS), "a group inside a recomputed one runs forward again"),
    (P.POST_BACKWARD, E.RECOMPUTE): Rule(P.FORWARD, (A.BEGIN_CALLS, A.UNSHARD, A.HOOK_INPUTS), "... for its other call, after this one's backward (two forwards, one backward)"),
    (P.FORWARD, E.RECOMPUTE): Rule(P.FORWARD, (A.ENTER,), "re-entry while it does"),
    (P.PRE_BACKWARD, E.RECOMPUTE): Rule(P.PRE_BACKWARD, (A.UNSHARD,), "activation checkpointing recomputes the forward"),
    (P.PRE_BACKWARD, E.POST_FORWARD): Rule(P.PRE_BACKWARD, (), "the recomputation ends: parameters stay for backward"),
    (P.IDLE, E.PRE_BACKWARD): Rule(P.PRE_BACKWARD, _BACKWARD, "a gradient reaches the group's outputs"),
    (P.PRE_BACKWARD, E.PRE_BACKWARD): Rule(P.PRE_BACKWARD, (), "another output of the same call"),
    (P.POST_BACKWARD, E.PRE_BACKWARD): Rule(P.PRE_BACKWARD, _BACKWARD, "a group called twice: its other call's outputs"),
    (P.PRE_BACKWARD, E.POST_BACKWARD): Rule(P.POST_BACKWARD, (A.REDUCE,), "the gradients reach the group's inputs"),
    (P.IDLE, E.POST_BACKWARD): Rule(P.POST_BACKWARD, (A.REDUCE,), "no gradient reached the outputs (or end of backward)"),
    (P.POST_BACKWARD, E.POST_BACKWARD): Rule(P.POST_BACKWARD, (A.REDUCE,), "a group called twice, both calls' gradients first"),
    **{(p, E.FINALIZE): Rule(P.IDLE, (A.END_STEP,), "the end of backward") for p in Phase},
    **{(p, E.RESET): Rule(P.IDLE, (A.DROP_STEP,), "after an exception: reset_iter_state()") for p in Phase},
}
del P, E, A


class IllegalTransition(RuntimeError):
    pass


def rule_for(phase: Phase, event: Event, name: str) -> Rule:
    rule = RULES.get((phase, event))
    if rule is None:
        raise IllegalTransition(
            f"shardkit group '{name or '<root>'}': {event.value} is not allowed in phase "
            f"{phase.value}. This usually means a forward or backward was interrupted; call "
            "reset_iter_state() on the root module before the next step."
        )
    return rule


def render_rules() -> str:
    """The table as markdown, one row per rule (``*``: the same in every phase); pinned by a
    test and shown in docs/design.md."""
    rows, shown = [], set()
    for (phase, event), rule in RULES.items():
        everywhere = all(RULES.get((p, event)) == rule for p in Phase)
        if everywhere and event in shown:
            continue
        shown.add(event)
        actions = ", ".join(a.value for a in rule.actions) or "-"
        rows.append(f"| {'*' if everywhere else phase.value} | {event.value} | {rule.next.value} | {actions} | {rule.why} |")
    return "\n".join(["| phase | event | next phase | actions, in order | when |", "|---|---|---|---|---|", *rows])


# The per-group record ----------------------------------------------------------------------
@dataclass
class Shared:
    """What every group under one root shares: the step's options and the root's schedule.
    Each group has its own until the root's lazy init makes the root's the one they all share."""

    options: RootOptions = field(default_factory=RootOptions)
    schedule: Any = None  # the root's Schedule (schedule.py), made at lazy init
    comm_ctx: Any = field(default_factory=object)  # its identity: which roots share_comm_ctx joined

    def use_schedule(self, schedule: Any) -> None:
        """Lazy init: the root's schedule, which every group under it reports to."""
        self.schedule = schedule

    def share_comm_ctx(self, ctx: Any) -> None:
        """``share_comm_ctx``: report ``ctx`` (another root's) as ours."""
        self.comm_ctx = ctx


@dataclass(eq=False)
class Tied:
    """Weights tied across groups (an embedding tied to a head that another call shards). A
    tied weight belongs to the group that sharded it first, its owner; a borrower registers
    the same parameter in its own modules and unshards the owner's group around its own
    forward and backward. Autograd sums both uses into the one ``.grad``; the owner reduces it
    once, after every group using it has passed its post-backward. The schedule's actions ask
    this helper and tell it what they did; nothing else in the schedule knows about tied
    weights, and only these methods write its fields."""

    owners: list["GroupState"] = field(default_factory=list)  # groups whose tied weights we use
    borrowers: list["GroupState"] = field(default_factory=list)  # groups using our tied weights
    deferred_reduce: bool = False  # our reduction waits for the borrowers' backward

    def borrow_from(self, me: "GroupState", owner: "GroupState") -> None:
        if owner not in self.owners:
            self.owners.append(owner)
            owner.tied.borrowers.append(me)

    def borrower_in(self, phase: "Phase") -> bool:
        """Whether a group using our tied weights is in ``phase`` (it still reads them)."""
        return any(b.step.phase is phase for b in self.borrowers)

    def owners_to_free_after_forward(self) -> list["GroupState"]:
        """Owners whose tied weights our forward gathered and which do not run now themselves."""
        return [o for o in self.owners if o.step.phase is not Phase.FORWARD and o.options.reshard_after_forward]

    def reduce_waits(self) -> bool:
        """Whether our reduction must wait: a group using our tied weights still adds gradients."""
        return any(b.step.phase is not Phase.POST_BACKWARD for b in self.borrowers)

    def defer_reduce(self) -> None:
        """Our reduction waits (``reduce_waits``): the last borrower's post-backward, or the end
        of backward, issues it."""
        self.deferred_reduce = True

    def owners_ready_to_reduce(self) -> list["GroupState"]:
        """Owners that deferred their reduction for us and every other borrower: all are done."""
        return [o for o in self.owners if o.tied.deferred_reduce and all(b.step.phase is Phase.POST_BACKWARD for b in o.tied.borrowers)]

    def reduce_resumed(self) -> None:
        """Our deferred reduction is being issued now (or dropped with the step)."""
        self.deferred_reduce = False


@dataclass
class Step:
    """Where a group is in the current step; the schedule changes it through these methods:
    ``phase`` only through ``RULES`` (``Schedule.fire``), the rest in the actions the rules name."""

    phase: Phase = Phase.IDLE
    calls: int = 0  # forward calls entered and not yet left
    to_run: set = field(default_factory=set)  # modules of the group yet to run in this forward
    backward_index: list[int] = field(default_factory=list)  # places in the post-forward order

    def enter_phase(self, phase: Phase) -> None:
        self.phase = phase

    def begin_calls(self, modules: tuple[nn.Module, ...]) -> None:
        """A forward of the group starts: one open call, every module yet to run."""
        self.calls, self.to_run = 1, set(modules)

    def enter(self) -> None:
        self.calls += 1

    def leave(self, module: nn.Module | None) -> None:
        self.calls -= 1
        self.to_run.discard(module)

    def end_calls(self) -> None:
        self.calls, self.to_run = 0, set()

    def ran_forward_at(self, index: int) -> None:
        """Our forward ended at ``index`` of the post-forward order (backward prefetch walks it back)."""
        self.backward_index.append(index)

    def pop_backward_index(self) -> int:
        """The place of our latest forward not yet met in backward, forgotten here."""
        return self.backward_index.pop()

    def forget_backward_order(self) -> None:
        self.backward_index.clear()


@dataclass(eq=False, repr=False)  # compared by identity: it sits in sets and lists of groups
class GroupState:
    """One ``fully_shard`` call: its modules, parameters and options, and its step."""

    modules: tuple[nn.Module, ...]
    group: ParamGroup | None  # None: the modules hold no parameters of their own
    options: GroupOptions
    mp_policy: MixedPrecisionPolicy
    device: torch.device
    shared: Shared = field(default_factory=Shared)
    name: str = ""  # the modules' FQNs under the root ("" for the root), set at lazy init
    parent: "GroupState | None" = None  # the fully_shard call around this one
    tied: Tied = field(default_factory=Tied)
    step: Step = field(default_factory=Step)

    @property
    def schedule(self) -> Any:
        return self.shared.schedule

    def join_root(self, shared: Shared, fqn: str) -> None:
        """Lazy init: our root's shared record, and our FQN under it."""
        self.shared, self.name = shared, fqn

    def nest_in(self, parent: "GroupState") -> None:
        """A later ``fully_shard`` call on a module around ours: it is our parent."""
        self.parent = parent

    def also_named(self, fqn: str) -> None:
        """Lazy init: another module of the group, met under the root at ``fqn``."""
        self.name += f", {fqn}"

    def __repr__(self) -> str:
        return f"GroupState({self.name or '<root>'!r}, {self.step.phase.value})"


def under_another_root(state: GroupState) -> bool:
    """Whether lazy init made another group the root of ``state``'s tree (before the first
    forward, any group may still become a root)."""
    schedule = state.shared.schedule
    return schedule is not None and schedule.states[0] is not state
