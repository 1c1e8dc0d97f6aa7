"""What torch's own code finds when it treats a shardkit module as one of FSDP2's.

shardkit's ``FSDPModule`` subclasses torch's, so ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
holds for every module ``fully_shard`` was applied to. torch code that checks it then calls
the public methods (shardkit's, by the same names) and, in a few places, reaches into
FSDP2's per-module state. This module answers those reaches with a small view of shardkit's
own state, and is the one place that knows their names:

- ``torch.distributed.pipelining`` (``stage.py``): after the last microbatch's backward,
  ``fully_shard.state(stage)._state_ctx.all_states``, each state's ``_fsdp_param_groups``,
  their ``post_backward()``, then ``_root_post_backward_final_callback()``. (Before each
  microbatch's backward it calls public methods: ``set_requires_gradient_sync(False)``,
  ``set_reshard_after_backward(False)``, ``set_is_last_backward(False)``; its schedules'
  ``UNSHARD`` / ``RESHARD`` actions call ``unshard(async_op=True)`` and ``reshard()``.)
- torch's ``register_fsdp_forward_method`` and ``share_comm_ctx``: ``module._get_fsdp_state()``,
  then ``_pre_forward`` / ``_post_forward``, or ``_comm_ctx`` and ``_fsdp_param_groups``;
  torch 2.15's schedules compare ``_comm_ctx`` identities (``defer_reduce_grad_wait``). Its
  stages call public methods only (``set_manual_backward_finalization``, ``finalize_backward``).

``fully_shard.state(module)`` reads the module's entry under torch's composable-API state key
for torch's ``fully_shard`` function; ``register`` puts the view there (and nothing in torch's
registry of applied APIs, so torch's own ``fully_shard`` and DCP still see no FSDP2 state).
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from shardkit.eager import hooks
from shardkit.eager.state import GroupState


class StateView:
    """``fully_shard.state(module)`` and ``module._get_fsdp_state()`` for a shardkit module."""

    def __init__(self, state: GroupState) -> None:
        self._state = state

    @property
    def _comm_ctx(self) -> Any:
        """Which roots share a communication context (torch 2.15's pipelining tells stages apart
        by its identity); shardkit's streams are one set per device whatever it is."""
        return self._state.shared.comm_ctx

    @_comm_ctx.setter
    def _comm_ctx(self, ctx: Any) -> None:  # torch's share_comm_ctx
        self._state.shared.share_comm_ctx(ctx)

    @property
    def _fsdp_param_groups(self) -> list["GroupView"]:
        return [GroupView(self._state)] if self._state.group is not None else []

    @property
    def _fsdp_param_group(self) -> "GroupView | None":
        groups = self._fsdp_param_groups
        return groups[0] if groups else None

    @property
    def _state_ctx(self) -> SimpleNamespace:
        """``.all_states``: the views of every group under this one's root."""
        schedule = self._state.schedule
        return SimpleNamespace(all_states=[view(s) for s in (schedule.states if schedule is not None else [self._state])])

    def _root_post_backward_final_callback(self) -> None:
        """The end of backward, called by pipelining after its ``post_backward()`` calls: finish
        the reductions they issued and end the step, as the autograd callback does."""
        if self._state.schedule is not None:
            self._state.schedule.end_backward()

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return hooks.pre_forward(self._state, module, args, kwargs)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return hooks.post_forward(self._state, module, args, output)


class GroupView:
    """One entry of ``_fsdp_param_groups``: a shardkit group (all its meshes; FSDP2 has one
    param group per mesh, and pipelining calls each of them the same way)."""

    def __init__(self, state: GroupState) -> None:
        self._state = state  # (torch's share_comm_ctx also sets a comm_ctx here: unused)

    def post_backward(self) -> None:
        """Reduce the gradients kept unreduced over the microbatches (and reshard), as the
        group's own post-backward does when backward reaches its inputs."""
        if self._state.schedule is not None:
            self._state.schedule.post_backward(self._state)


def view(state: GroupState) -> StateView:
    if "_fsdp2_view" not in state.__dict__:
        state.__dict__["_fsdp2_view"] = StateView(state)
    return state.__dict__["_fsdp2_view"]


def register(module: nn.Module, state: GroupState) -> None:
    """Make ``torch.distributed.fsdp.fully_shard.state(module)`` return the view."""
    # (the package's ``contract`` name is the decorator: the module is imported by its path)
    key = importlib.import_module("torch.distributed._composable.contract").STATE_KEY
    module.__dict__.setdefault(key, {})[_torch_fully_shard.__wrapped__] = view(state)
