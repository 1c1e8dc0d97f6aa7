"""The training phase of one ``fully_shard`` group, as one table.

Every phase change goes through ``PhaseMachine.advance``: it looks the ``(phase, event)``
pair up in ``TRANSITIONS``, records the change in the trace, and raises on a pair the table
does not hold. Whether the group's parameters are sharded or unsharded is a second,
orthogonal state that only ``ParamGroup.unshard`` / ``reshard`` change.
"""

from __future__ import annotations

import enum

from shardkit.comm import trace


class Phase(enum.Enum):
    IDLE = "IDLE"  # between passes: parameters sharded (or kept unsharded by choice)
    FORWARD = "FORWARD"  # inside the group's forward
    PRE_BACKWARD = "PRE_BACKWARD"  # backward has reached the group: parameters unsharded
    POST_BACKWARD = "POST_BACKWARD"  # the group's gradients are reduced


class PhaseEvent(enum.Enum):
    PRE_FORWARD = "pre_forward"
    POST_FORWARD = "post_forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"
    FINALIZE = "finalize"  # the root's end-of-backward callback


P, E = Phase, PhaseEvent
TRANSITIONS: dict[tuple[Phase, PhaseEvent], Phase] = {
    # A normal step: forward, then backward reaches the group's outputs, then its inputs.
    (P.IDLE, E.PRE_FORWARD): P.FORWARD,
    (P.FORWARD, E.POST_FORWARD): P.IDLE,
    (P.IDLE, E.PRE_BACKWARD): P.PRE_BACKWARD,
    (P.PRE_BACKWARD, E.POST_BACKWARD): P.POST_BACKWARD,
    # A module called twice in forward is met twice in backward. (Further outputs of one
    # call fire the pre-backward hook again in PRE_BACKWARD; the hook ignores those.)
    (P.POST_BACKWARD, E.PRE_BACKWARD): P.PRE_BACKWARD,
    # Gradients reach the inputs but never passed through the outputs' hooks (again).
    (P.IDLE, E.POST_BACKWARD): P.POST_BACKWARD,
    (P.POST_BACKWARD, E.POST_BACKWARD): P.POST_BACKWARD,
    # Activation checkpointing recomputes the forward inside the backward.
    (P.PRE_BACKWARD, E.PRE_FORWARD): P.PRE_BACKWARD,
    (P.PRE_BACKWARD, E.POST_FORWARD): P.PRE_BACKWARD,
    # The root's final callback returns every group to IDLE, whatever it reached.
    (P.IDLE, E.FINALIZE): P.IDLE,
    (P.FORWARD, E.FINALIZE): P.IDLE,
    (P.PRE_BACKWARD, E.FINALIZE): P.IDLE,
    (P.POST_BACKWARD, E.FINALIZE): P.IDLE,
}
del P, E


class IllegalTransition(RuntimeError):
    pass


class PhaseMachine:
    """The one writer of a group's phase."""

    def __init__(self, name: str = "") -> None:
        self.name = name  # the group's module FQN, set at lazy init
        self.phase = Phase.IDLE

    def advance(self, event: PhaseEvent) -> Phase:
        old = self.phase
        new = TRANSITIONS.get((old, event))
        if new is None:
            raise IllegalTransition(
                f"shardkit group '{self.name or '<root>'}': {event.value} is not allowed in "
                f"phase {old.value}. This usually means a forward or backward was interrupted; "
                "call reset_iter_state() on the root module before the next step."
            )
        self.phase = new
        if trace.is_recording():
            trace.record("phase", self.name, f"{event.value}: {old.value} -> {new.value}")
        return new

    def reset(self) -> None:
        """Back to IDLE after an aborted step (the only write outside ``advance``)."""
        self.phase = Phase.IDLE


def render_transitions() -> str:
    """The table as text, one ``phase --event--> phase`` per line (pinned by a test and in docs)."""
    width = max(len(p.value) for p in Phase)
    return "\n".join(
        f"{old.value:<{width}} --{event.value}--> {new.value}"
        for (old, event), new in TRANSITIONS.items()
    )
