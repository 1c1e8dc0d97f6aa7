"""The module hooks: adapters from torch's hook points to the root's schedule.

``fully_shard`` registers a forward pre-hook and a forward hook on each module of a group.
They cast inputs and outputs (``MixedPrecisionPolicy``) and report the call to the root's
``Schedule``, running lazy init at the first forward; the schedule decides everything else,
including the autograd hooks it puts on the call's inputs and outputs for backward
(``tensors.on_input_grads`` / ``on_output_grads``). torch.compile'd modules run these hooks
inside the compiled region; ours allocate and free storage and issue collectives, so dynamo
leaves them out (a graph break per hook).
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch
import torch.nn as nn

from shardkit.eager.root import lazy_init
from shardkit.eager.schedule import Call
from shardkit.eager.state import GroupState
from shardkit.core.tensors import cast_floating


def install(state: GroupState) -> None:
    for module in state.modules:
        module.register_forward_pre_hook(functools.partial(pre_forward, state), prepend=True, with_kwargs=True)
        module.register_forward_hook(functools.partial(post_forward, state))
        module.register_state_dict_pre_hook(lambda *_: reshard_for_state_dict(state))
        module.register_state_dict_post_hook(functools.partial(sharded_in_state_dict, state))
        module._register_load_state_dict_pre_hook(lambda *_: reshard_for_load(state))


def _groups(state: GroupState) -> tuple:
    """Our group, and the groups of the tied weights we borrow (registered in our modules)."""
    return tuple(g for g in (state.group, *(owner.group for owner in state.tied.owners)) if g is not None)


def reshard_for_state_dict(state: GroupState) -> None:
    """State dicts always see the sharded parameters: on the step's thread we reshard, ours and
    the tied weights we borrow (resharding the owner later, when the recursion reaches its
    modules, would free the storage of the unsharded tensor already put in the dict). From
    another thread (torchft's quorum thread, while the step runs) we touch nothing: the step
    may be using the unsharded buffers; ``sharded_in_state_dict`` puts the shards in the dict."""
    schedule = state.schedule
    if schedule is not None and schedule.off_step_thread():
        return
    for group in _groups(state):
        group.reshard()


def sharded_in_state_dict(state: GroupState, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """Once ``module``'s entries are in the dict (its submodules' too): each of our sharded
    parameters enters it as its sharded DTensor, even where a module held the unsharded one
    when it was read (another thread's ``state_dict()``)."""
    paths: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        paths.setdefault(id(sub), []).append(prefix + name + "." if name else prefix)
    for group in _groups(state):
        for p in group.params:
            for slot in p.slots:
                for path in paths.get(id(slot.module), ()):
                    value = state_dict.get(path + slot.name)
                    if value is not None and value is not p.sharded_param:
                        state_dict[path + slot.name] = p.sharded_param if isinstance(value, nn.Parameter) else p.sharded_param.detach()


def reshard_for_load(state: GroupState) -> None:
    """``load_state_dict`` writes into the shards the step reads: not from another thread while
    a step runs."""
    schedule = state.schedule
    if schedule is not None and schedule.off_step_thread() and schedule.busy():
        raise RuntimeError(
            f"shardkit: load_state_dict() on fully_shard module '{state.name or '<root>'}' from thread "
            f"'{threading.current_thread().name}' while a step runs on another thread (forward, backward or "
            "their reductions): it would overwrite parameters the step is reading. Load on the thread that "
            "trains, between steps (torchft calls its load_state_dict callback there, in should_commit)."
        )
    reshard_for_state_dict(state)


@torch.compiler.disable
def pre_forward(state: GroupState, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    schedule = state.schedule or lazy_init(state)
    policy = state.mp_policy
    if policy.param_dtype is not None and policy.cast_forward_inputs:
        args, kwargs = cast_floating((args, kwargs), policy.param_dtype)
    call = Call(module, args, kwargs)
    schedule.pre_forward(state, call)
    return call.args, call.kwargs


@torch.compiler.disable
def post_forward(state: GroupState, module: nn.Module, args: tuple, output: Any) -> Any:
    if state.mp_policy.output_dtype is not None:
        output = cast_floating(output, state.mp_policy.output_dtype)
    state.schedule.post_forward(state, Call(module, output=output))
    return output
