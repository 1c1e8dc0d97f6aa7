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
        module._register_load_state_dict_pre_hook(lambda *_: reshard_for_state_dict(state))


def reshard_for_state_dict(state: GroupState) -> None:
    """State dicts always see the sharded parameters: ours, and the tied weights we borrow
    (registered in our modules, an owner's; resharding the owner later, when the recursion
    reaches its modules, would free the storage of the unsharded tensor already put in the dict)."""
    for group in (state.group, *(owner.group for owner in state.tied.owners)):
        if group is not None:
            group.reshard()


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
