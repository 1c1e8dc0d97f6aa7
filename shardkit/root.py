"""The root of a step: what the groups under one root ``fully_shard`` module share.

Built at the root's first forward (``RootContext.build``): every group below gets its name
(its module's FQN), its index, its lazy init. Then, each step, the root context holds the
orders that prefetching follows, the reduce-scatters in flight, and the final autograd
callback that ends a backward (``finish_backward``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from shardkit import lockstep
from shardkit.param_group import still_on_meta
from shardkit.state import Phase, PhaseEvent

if TYPE_CHECKING:
    from shardkit.hooks import GroupState
    from shardkit.param_group import ParamGroup


MAX_REDUCING = 2  # reduce-scatters in flight: this group's and the previous one's


class RootContext:
    """What the groups under one root share, set up at the root's lazy init."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.states: list["GroupState"] = []  # every group under the root, module order
        self.forward_root: "GroupState | None" = None  # whose forward opened this pass
        self.final_callback_queued = False
        self.is_last_backward = True
        self.forward_order: list["GroupState"] = []  # pre-forward order of the last forward pass
        self.forward_seen: list["GroupState"] = []  # ... and of this one so far (forward prefetch)
        self.post_forward_order: list["GroupState"] = []  # for backward prefetch
        self.reducing: list["ParamGroup"] = []  # groups whose reduce-scatter is in flight
        self.lockstep = False  # agree on every collective first (shardkit/lockstep.py)
        self.lockstep_group, self.lockstep_world = None, 1
        self.host_sync = False  # set by build

    @classmethod
    def build(cls, root: "GroupState") -> "RootContext":
        """Make ``root`` the root of every group below its module (its first forward)."""
        root_module = root.modules[0]
        if root.parent is not None:
            raise RuntimeError(
                f"shardkit: {class_name(root_module)} (a fully_shard module inside "
                f"{class_name(root.parent.modules[0])}) ran forward before its root. Run the "
                "first forward through the root module, the one fully_shard was applied to last."
            )
        if len(root.modules) > 1:
            raise RuntimeError(
                f"shardkit: the first forward ran through a fully_shard group of several modules "
                f"({', '.join(class_name(m) for m in root.modules)}); the root must be one module "
                "that contains the others: call fully_shard on the whole model too."
            )
        ctx = cls(root.device)
        for fqn, module in root_module.named_modules():
            state = state_of(module)
            if state is None:
                continue
            if state.ctx is ctx:  # a group of several modules, met again
                state.machine.name += f", {fqn}"
                continue
            if state is not root and state.is_root is not None:
                raise RuntimeError(
                    f"shardkit: the fully_shard module '{fqn}' already ran forward as its own root. "
                    "Run the first forward through the outermost fully_shard module."
                )
            state.is_root, state.ctx, state.machine.name = state is root, ctx, fqn
            if state.reshard_after_forward_arg is None:
                state.reshard_after_forward = not state.is_root
            state.index = len(ctx.states)
            ctx.states.append(state)
        # Offloaded gradients go to pinned host memory asynchronously: wait at the end of backward.
        ctx.host_sync = ctx.device.type == "cuda" and any(s.group.host_sync for s in ctx.states if s.group)
        _name_params(root_module, ctx.states)
        _check_materialized(root_module)
        for state in ctx.states:
            if state.group is not None:
                state.group.name = state.name
                state.group.lazy_init()
        return ctx

    def finish_backward(self) -> None:
        """The root's final autograd callback: reduce what did not reduce, return to IDLE."""
        for state in reversed(self.states):  # backward order: blocks last-to-first, root last
            if state.machine.phase in (Phase.IDLE, Phase.PRE_BACKWARD):
                state._post_backward()
        for state in self.states:
            if state.deferred_reduce:  # its borrowers never ran backward
                state.deferred_reduce = False
                state._reduce_now()
        if self.lockstep:
            lockstep.drain(self)  # serve the ranks still in their backward
        for group in self.reducing:  # the optimizer step comes next
            group.finish_reduce()
        self.reducing = []
        if self.host_sync:
            torch.cuda.current_stream(self.device).synchronize()  # offloaded grads copied to pinned memory
        for state in self.states:
            state.machine.advance(PhaseEvent.FINALIZE)
            if state.group is not None and state.group._pending:  # prefetched, then not used
                state.group.reshard()
        self.final_callback_queued = False
        if self.is_last_backward:
            self.post_forward_order.clear()
            for state in self.states:
                state._post_forward_indices.clear()

    def reset(self) -> None:
        """Every group to IDLE and sharded, collectives in flight waited for and dropped, the
        failed step's partial gradients discarded (``reset_iter_state`` after an exception)."""
        for state in self.states:
            _reset_state(state)
        self.forward_root = None
        self.final_callback_queued = False
        self.post_forward_order.clear()
        self.forward_seen.clear()
        self.reducing = []


def _reset_state(state: "GroupState") -> None:
    state.machine.reset()
    state._modules_to_run.clear()
    state._open_calls = 0
    state._post_forward_indices.clear()
    state.deferred_reduce = False
    if state.group is not None:
        state.group.finish_reduce(keep=False)
        state.group.reshard()
        for p in state.group.params:
            if p.unsharded_param is not None:
                p.unsharded_param.grad = None
            p.accumulated_grad = None


def state_of(module: nn.Module) -> "GroupState | None":
    return module.__dict__.get("_shardkit_state")


def class_name(module: nn.Module) -> str:
    """The user's class name, without the ``FSDP`` subclass that fully_shard swaps in."""
    cls = type(module)
    return cls.__mro__[2].__name__ if state_of(module) is not None else cls.__name__


def _check_materialized(root_module: nn.Module) -> None:
    meta = [fqn for fqn, p in root_module.named_parameters() if p.device.type == "meta"]
    if meta:
        raise still_on_meta(meta)


def _name_params(root_module: nn.Module, states: list["GroupState"]) -> None:
    """Give every sharded parameter its FQN under the root, for error messages and traces."""
    by_param = {id(p.sharded_param): p for s in states if s.group for p in s.group.params}
    for fqn, param in root_module.named_parameters(remove_duplicate=False):
        if id(param) in by_param:
            by_param[id(param)].fqn = fqn
