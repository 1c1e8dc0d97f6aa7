"""The root's schedule: what each hook event does, for every group under one root.

The module hooks (``hooks.py``) are adapters: a forward call starts or ends, a gradient
reaches a group's outputs or inputs, backward ends. Each reaches the root's ``Schedule``,
which names it as an ``Event`` of one group (does the call open the forward pass, is it a
recomputation, are other calls of the group still open?), looks ``(phase, event)`` up in
``state.RULES``, enters the next phase and runs the rule's actions: the methods below of the
same names. The schedule also owns what spans groups: the orders prefetching follows, the
reductions in flight (``param_group.Reducing``, which every group records its reductions
in), the end of the forward pass (``close_pass``) and of backward (``end_backward``). The three steps that issue collectives (gather a group, reduce a group,
the end of a pass) go through the schedule's ``collectives`` strategy: ``Direct`` here, or
``lockstep.Lockstep`` (agree with the other ranks, then act), swapped between steps.
Weights tied across groups are ``state.Tied``'s business: the actions ask it and tell it
what they did. Every record the actions change (``Step``, ``Tied``, the options) is changed
through its own methods. docs/design.md walks through a step.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.autograd import Variable

from shardkit.comm import trace
from shardkit.comm.streams import streams_for
from shardkit.eager.param_group import Holding, Reducing
from shardkit.eager.state import RULES, Event, GroupState, Phase, Shared, rule_for
from shardkit.core.tensors import on_input_grads, on_output_grads, to_device

MAX_REDUCING = 2  # reduce-scatters in flight: this group's and the previous one's


@dataclass
class Call:
    """What a hook hands the schedule: the module called, its inputs or its output (actions
    may replace them: cast, moved to the device, passed through the post-backward node)."""

    module: nn.Module | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    output: Any = None


@dataclass
class Orders:
    forward: list[GroupState] = field(default_factory=list)  # pre-forward order of the last pass
    seen: list[GroupState] = field(default_factory=list)  # ... and of this pass so far
    post_forward: list[GroupState] = field(default_factory=list)  # backward prefetch walks it back


class Direct:
    """How the schedule issues its collectives: at once, with prefetching (every rank runs the
    same groups in the same order). ``lockstep.Lockstep`` is the other strategy."""

    uses_post_forward_shards = True  # reshard_after_forward=R keeps 1/R for backward

    def __init__(self, schedule: "Schedule") -> None:
        self.schedule = schedule

    def gather(self, state: GroupState) -> None:
        """Unshard ``state``'s group and wait for it."""
        if state.group is not None:
            state.group.issue_unshard()
            state.group.wait_for_unshard()

    def prefetch(self, target: GroupState, backward: bool) -> None:
        """Issue ``target``'s all-gather early; its own hook waits for it."""
        if target.group is not None and (target.options.unshard_in_backward or not backward):
            target.group.issue_unshard()

    def reduce(self, state: GroupState, reshard: bool) -> None:
        """Issue the group's reductions and reshard it; then finish, oldest first, the earlier
        reductions that have completed meanwhile, and the oldest anyway while more than
        MAX_REDUCING are in flight. (Moving them on goes in issue order: every rank starts its
        HSDP all-reduces in the same order.)"""
        group = state.group
        group.reduce_gradients()  # recorded in the schedule's Reducing
        if state.tied.borrower_in(Phase.PRE_BACKWARD):
            reshard = False  # that group's backward may still read the tied weights
        if reshard and group.options.reshard_after_backward:
            # (after backward(create_graph=True) the graph it made reads the unsharded data in
            # the next backward: kept, while the module shows its sharded parameters and grads)
            group.reshard(free=not self.schedule.creates_graph)
        reducing = self.schedule.reducing
        limit = group.options.max_reducing or MAX_REDUCING  # set_reduce_scatter_max_input_buffers
        while len(reducing) > 1:
            if len(reducing) <= limit:  # within the limit, the oldest finishes only once complete
                oldest = reducing.oldest()
                oldest.move_reductions_on()
                if not oldest.reduce_done():
                    break
            reducing.finish_oldest()

    def pass_ends(self) -> None:
        """This rank's forward pass or backward is over."""


class Schedule:
    def __init__(self, states: list[GroupState], device: torch.device, shared: Shared) -> None:
        self.states = states  # every group under the root, in module order: the root first
        self.device = device
        self.shared = shared  # the step's options, shared by every state under the root
        self.orders = Orders()
        self.forward_root: GroupState | None = None  # whose call opened the forward pass
        self.in_backward = False  # the end-of-backward callback is queued
        self.thread: int | None = None  # the thread that opened the last forward pass: the step's
        # backward(create_graph=True), as for a gradient penalty: the graph it makes reads the
        # unsharded parameters in the next backward, so this one keeps their gathered data
        self.creates_graph = False
        self.reducing = Reducing()  # the reductions in flight, of every group: oldest first
        for state in states:
            if state.group is not None:
                state.group.reduce_into(self.reducing)
        self.pins_host_memory = any(p.pin_memory for s in states if s.group for p in s.group.params)  # see finish_backward
        self.collectives: Direct = Direct(self)  # or lockstep.Lockstep: see use()

    def use(self, collectives: Direct) -> None:
        """Swap the collectives strategy (``set_lockstep``): between steps only."""
        if self.forward_root is not None or self.in_backward:
            raise RuntimeError("shardkit: set_lockstep() must be called between steps, not during forward or backward")
        self.collectives = collectives

    # Events ------------------------------------------------------------------------------------
    def off_step_thread(self) -> bool:
        """Whether the caller is another thread than the one running the steps (torchft's
        quorum thread asking for a state dict while the step runs)."""
        return self.thread is not None and threading.get_ident() != self.thread

    def busy(self) -> bool:
        """A pass is open: the modules may hold unsharded parameters, the collectives' buffers
        are in use, or reductions are in flight."""
        return self.forward_root is not None or self.in_backward or any(
            s.step.phase is not Phase.IDLE or s.group is not None and s.group.holding in (Holding.GATHERING, Holding.UNSHARDED) for s in self.states)

    def pre_forward(self, state: GroupState, call: Call) -> None:
        if self.in_backward:
            event = Event.RECOMPUTE
        else:
            event = Event.START_FORWARD if self.forward_root is None else Event.PRE_FORWARD
        self.fire(state, event, call)

    def post_forward(self, state: GroupState, call: Call) -> None:
        step, forward = state.step, state.step.phase is Phase.FORWARD
        if forward and self.forward_root is state and step.calls == 1:
            event = Event.END_FORWARD  # even if others of its modules did not run (a head called alone)
        elif forward and (step.calls > 1 or step.to_run - {call.module}):
            event = Event.INNER_POST_FORWARD
        else:
            event = Event.POST_FORWARD  # (outside FORWARD: the end of a recomputation)
        self.fire(state, event, call)

    def pre_backward(self, state: GroupState) -> None:
        self.fire(state, Event.PRE_BACKWARD)

    def post_backward(self, state: GroupState) -> None:
        self.fire(state, Event.POST_BACKWARD)

    def fire(self, state: GroupState, event: Event, call: Call | None = None) -> None:
        """The one writer of a group's phase: enter the rule's phase, then run its actions."""
        old = state.step.phase
        rule = RULES.get((old, event)) or rule_for(old, event, state.name)  # rule_for raises
        state.step.enter_phase(rule.next)
        if trace.is_recording() and (rule.actions or rule.next is not old):
            trace.record("phase", state.name, f"{event.value}: {old.value} -> {rule.next.value}")
        for method in rule.methods:
            getattr(self, method)(state, call)

    def end_backward(self) -> None:
        """The final autograd callback: reduce what did not reduce, finish every reduction (the
        optimizer step comes next), every group back to IDLE."""
        for state in reversed(self.states):  # backward order: blocks last-to-first, root last
            if state.step.phase in (Phase.IDLE, Phase.PRE_BACKWARD):
                self.fire(state, Event.POST_BACKWARD)
        options = self.shared.options
        self.finish_backward(last=options.is_last_backward and not options.manual_finalization)

    def finalize_backward(self) -> None:
        """``finalize_backward()`` (manual finalization, after backwards with gradient sync
        off): reduce the gradients the groups hold unreduced; ``finish_backward`` finishes."""
        for state in reversed(self.states):
            if state.group is not None and state.options.requires_gradient_sync and state.group.holds_unreduced_grads():
                self.fire(state, Event.POST_BACKWARD)

    def finish_backward(self, last: bool = True) -> None:
        """Finish every reduction, every group back to IDLE; ``last``: the step's backward is
        over (forget the order backward prefetching followed)."""
        for state in self.states:
            if state.tied.deferred_reduce:  # the groups using its tied weights never ran backward
                state.tied.reduce_resumed()
                self.collectives.reduce(state, reshard=True)
        self.collectives.pass_ends()
        self.reducing.finish_all()
        if self.pins_host_memory:  # gradients copied to pinned host memory asynchronously
            streams_for(self.device).wait_host_copies()
        for state in self.states:
            self.fire(state, Event.FINALIZE)
        self.in_backward = self.creates_graph = False
        if last:
            self.orders.post_forward.clear()
            for state in self.states:
                state.step.forget_backward_order()

    def reset(self) -> None:
        """After an exception in forward or backward (``reset_iter_state``)."""
        for state in self.states:
            self.fire(state, Event.RESET)
        self.forward_root, self.in_backward, self.creates_graph = None, False, False
        self.orders.seen.clear()
        self.orders.post_forward.clear()
        self.reducing.finish_all(keep=False)  # (drop_step finished each group's: this forgets them)

    # Forward actions ---------------------------------------------------------------------------
    def open_pass(self, state: GroupState, call: Call) -> None:
        self.forward_root, self.thread = state, threading.get_ident()
        if self.device.type != "cpu":  # like DDP and FSDP2
            call.args, call.kwargs = to_device((call.args, call.kwargs), self.device)
        event = self.shared.options.take_post_optim_event()
        if event is not None:
            streams_for(self.device).all_gathers_wait_for(event)

    def begin_calls(self, state: GroupState, call: Call) -> None:
        state.step.begin_calls(state.modules)

    def enter(self, state: GroupState, call: Call) -> None:
        state.step.enter()

    def leave(self, state: GroupState, call: Call) -> None:
        state.step.leave(call.module)

    def unshard(self, state: GroupState, call: Call | None) -> None:
        """Issue the all-gathers and wait for them (the action's name is the rules' word for
        both): this group's, and its tied weights' owners'."""
        for group_state in (state, *state.tied.owners):
            self.collectives.gather(group_state)

    def prefetch_forward(self, state: GroupState, call: Call) -> None:
        orders = self.orders
        orders.seen.append(state)
        if state.options.forward_prefetch is not None:
            targets = state.options.forward_prefetch
        else:
            i, order = len(orders.seen), orders.forward
            targets = order[i : i + 1] if len(order) >= i and order[i - 1] is state else ()
        for target in targets:
            self.collectives.prefetch(target, backward=False)

    def hook_inputs(self, state: GroupState, call: Call) -> None:
        if state.group is not None and torch.is_grad_enabled():
            call.args, call.kwargs = on_input_grads(call.args, call.kwargs, functools.partial(_post_backward, state))

    def reshard_after_forward(self, state: GroupState, call: Call) -> None:
        group, reshard = state.group, state.options.reshard_after_forward
        if group is not None and not state.tied.borrower_in(Phase.FORWARD):
            if reshard and group.has_post_forward_mesh and self.collectives.uses_post_forward_shards and torch.is_grad_enabled():
                group.reshard_to_post_forward()  # keep 1/R for the backward all-gather among R ranks
            elif reshard:
                group.reshard()
            elif not torch.is_grad_enabled():
                # No backward follows, so the step is over: the module shows its sharded
                # parameters again, and keeps the gathered data for the next forward.
                group.reshard(free=False)
        for owner in state.tied.owners_to_free_after_forward():
            owner.group.reshard()

    def hook_outputs(self, state: GroupState, call: Call) -> None:
        if not torch.is_grad_enabled():
            return  # no backward follows
        if not self.in_backward:  # a recomputation keeps the forward's order
            state.step.ran_forward_at(len(self.orders.post_forward))
            self.orders.post_forward.append(state)
        on_output_grads(call.output, functools.partial(_pre_backward, state))

    def close_pass(self, state: GroupState, call: Call) -> None:
        for other in self.states:
            if other.step.phase is Phase.FORWARD:  # a group of several modules that ran in part
                self.fire(other, Event.POST_FORWARD, call)
            elif other.group is not None and other.group.holding is Holding.GATHERING:
                other.group.reshard()  # prefetched, then not run
        if state is self.states[0]:  # a pass of the whole model: its order is next step's prefetch order
            self.orders.forward = self.orders.seen
        self.forward_root, self.orders.seen = None, []
        self.collectives.pass_ends()

    # Backward actions --------------------------------------------------------------------------
    def queue_finalize(self, state: GroupState, call: None) -> None:
        if not self.in_backward:
            self.in_backward, self.creates_graph = True, torch.is_grad_enabled()
            Variable._execution_engine.queue_callback(self.end_backward)

    def unshard_for_backward(self, state: GroupState, call: None) -> None:
        if state.options.unshard_in_backward:
            self.collectives.gather(state)
        for owner in state.tied.owners:
            self.collectives.gather(owner)

    def prefetch_backward(self, state: GroupState, call: None) -> None:
        if state.options.backward_prefetch is not None:
            targets = state.options.backward_prefetch
        elif state.step.backward_index:
            i = state.step.pop_backward_index()
            targets = self.orders.post_forward[i - 1 : i] if i > 0 else ()
        else:
            targets = ()
        for target in targets:
            self.collectives.prefetch(target, backward=True)

    def reduce(self, state: GroupState, call: None) -> None:
        if state.group is not None:
            if state.tied.reduce_waits():
                state.tied.defer_reduce()
            else:
                self.collectives.reduce(state, reshard=True)
        ready = state.tied.owners_ready_to_reduce()
        for owner in ready:  # (every one of them told first, as a reduce may fire other groups' events)
            owner.tied.reduce_resumed()
        for owner in ready:
            self.collectives.reduce(owner, reshard=owner.step.phase is not Phase.PRE_BACKWARD)

    def end_step(self, state: GroupState, call: None) -> None:
        state.step.end_calls()
        if state.group is not None and state.group.holding is Holding.GATHERING:
            state.group.reshard()  # prefetched, then not used

    def drop_step(self, state: GroupState, call: None) -> None:
        state.step.end_calls()
        state.tied.reduce_resumed()  # (dropped with the step)
        state.step.forget_backward_order()
        if state.group is not None:
            state.group.finish_reduce(keep=False)
            state.group.reshard()
            for p in state.group.params:
                p.drop_grads()


# Autograd calls these during backward; they find the root's schedule through the state. Dynamo leaves the tensor hook out, as
# the module hooks.
@torch.compiler.disable
def _pre_backward(state: GroupState, grad: torch.Tensor) -> None:
    state.schedule.pre_backward(state)


def _post_backward(state: GroupState) -> None:
    state.schedule.post_backward(state)
