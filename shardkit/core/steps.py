"""What an optimizer step makes stale, in both modes: whatever a group gathered or kept from its
shards before the step (eager mode's unsharded data, compiled mode's rows a backward kept).

torch's foreach and fused optimizers do not bump version counters, so a post-step hook is the
signal. It tells only the groups whose parameters the stepping optimizer holds: under torch's
threaded process group every rank's groups live in one process, and another rank's step must
not make this rank gather again (an all-gather the other ranks do not issue: a hang).
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

# The groups told of steps: each has ``holds_any(ids)`` (is one of its parameters, by id, in the
# step?) and ``shards_changed()``.
watched: weakref.WeakSet = weakref.WeakSet()
# Step hooks that must run before the staleness hook (optim/local_step.py's swap back to the
# DTensors, which the groups compare against): installed with it, first.
_installers: list[Callable[[], None]] = []
_installed = False


def install_before(installer: Callable[[], None]) -> None:
    """Run ``installer`` (it registers optimizer step hooks) before the staleness hook is registered."""
    _installers.append(installer)
    if _installed:
        installer()


def watch(group) -> None:
    """From now on, an optimizer step over ``group``'s parameters calls its ``shards_changed()``."""
    global _installed
    if not _installed:
        for installer in _installers:
            installer()
        register_optimizer_step_post_hook(_stale)
        _installed = True
    watched.add(group)


def _stale(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    held = {id(p) for opt_group in optimizer.param_groups for p in opt_group["params"]}
    for group in list(watched):
        if group.holds_any(held):
            group.shards_changed()
