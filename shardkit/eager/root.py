"""Lazy init: the first forward makes its module the root of every group below it.

By then every ``fully_shard`` call has been made, so the root can collect its groups (in
module order, the root first), name them by their FQN, give each the root's shared options,
decide the default ``reshard_after_forward`` (False for the root only), materialize the
unsharded parameters, and build the one ``Schedule`` they all report to (with
``lockstep.py``'s collectives strategy when ``set_lockstep(True)``).
"""

from __future__ import annotations

import torch.nn as nn

from shardkit.eager.lockstep import Lockstep
from shardkit.eager.param_group import still_on_meta
from shardkit.eager.schedule import Direct, Schedule
from shardkit.core.setup import class_name, state_of
from shardkit.eager.state import GroupState, Shared


def lazy_init(root: GroupState) -> Schedule:
    """Make ``root`` the root of every group below its module (its first forward)."""
    root_module = root.modules[0]
    _check_root(root)
    shared = root.shared  # keeps what was set on the root before its first forward
    states: list[GroupState] = []
    seen: set[GroupState] = set()
    for fqn, module in root_module.named_modules():
        state = state_of(module)
        if state is None:
            continue
        if state in seen:  # a group of several modules, met again
            state.also_named(fqn)
            continue
        if state is not root and state.schedule is not None:
            raise RuntimeError(
                f"shardkit: the fully_shard module '{fqn}' already ran forward as its own root. "
                "Run the first forward through the outermost fully_shard module."
            )
        state.join_root(shared, fqn)
        state.options.settle_reshard_after_forward(is_root=state is root)
        states.append(state)
        seen.add(state)
    for p in (p for s in states if s.group for p in s.group.params):
        p.adopt_registered()  # what the modules hold now is what gets its FQN
    _name_params(root_module, states)
    meta = [fqn for fqn, p in root_module.named_parameters() if p.device.type == "meta"]
    if meta:
        raise still_on_meta(meta)
    for state in states:
        if state.group is not None:
            state.group.named(state.name)
            if not state.group.initialized:  # else an explicit unshard() before this forward made it
                state.group.lazy_init()
    shared.use_schedule(Schedule(states, root.device, shared))
    set_lockstep(shared, shared.options.lockstep)
    return shared.schedule


def set_lockstep(shared: Shared, enabled: bool) -> None:
    """Give the root's schedule the lockstep collectives strategy, or the direct one (between steps)."""
    shared.options.set_lockstep(enabled)
    schedule = shared.schedule
    if schedule is not None and isinstance(schedule.collectives, Lockstep) != enabled:  # else: at lazy init
        schedule.use(Lockstep(schedule) if enabled else Direct(schedule))


def _check_root(root: GroupState) -> None:
    if root.parent is not None:
        raise RuntimeError(
            f"shardkit: {class_name(root.modules[0])} (a fully_shard module inside "
            f"{class_name(root.parent.modules[0])}) ran forward before its root. Run the "
            "first forward through the root module, the one fully_shard was applied to last."
        )
    if len(root.modules) > 1:
        raise RuntimeError(
            f"shardkit: the first forward ran through a fully_shard group of several modules "
            f"({', '.join(class_name(m) for m in root.modules)}); the root must be one module "
            "that contains the others: call fully_shard on the whole model too."
        )


def _name_params(root_module: nn.Module, states: list[GroupState]) -> None:
    """Give every sharded parameter its FQN under the root, for error messages and traces."""
    by_param = {id(p.sharded_param): p for s in states if s.group for p in s.group.params}
    for fqn, param in root_module.named_parameters(remove_duplicate=False):
        if id(param) in by_param:
            by_param[id(param)].named(fqn)
