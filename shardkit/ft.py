"""torchft with shardkit in one call: a replica group that dies is dropped, the others go on.

torchft (PyPI ``torchft``) runs replica groups that each train the whole model: a lighthouse
decides each step's quorum, a ``Manager`` in every group averages the gradients across the
groups in the quorum, and a group that restarts heals from a live peer's state. Within a
group, ``fully_shard`` shards over the group's own ranks (a 1-D mesh, or HSDP inside it).
``fault_tolerant`` joins the two as torchtitan's own wrapper does for FSDP2::

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=1,
                              load_state_dict=None, state_dict=None, replica_id=..., ...)
    ft = shardkit.ft.fault_tolerant(model, manager, torch.optim.AdamW(model.parameters()))
    for batch in data:
        ft.optimizer.zero_grad()    # starts the step's quorum
        loss(model, batch).backward()  # each group's reduced gradient averaged across the groups
        ft.optimizer.step()          # steps only if every group in the quorum committed

It installs the all-reduce hook on every ``fully_shard`` module (the reduced shard, averaged
over the group's ranks, is averaged over the groups taking part; a group that is healing adds
zeros), and registers the model's and the optimizer's state with the manager: torchft reads it
from its own thread while the step runs, which shardkit answers with the shards and without
touching the step (see ``eager/hooks.py``); a restarted group loads it on the training thread.

torchft is not a dependency of shardkit: this module imports it only when it is called.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

INSTALL = "pip install --no-deps torchft==0.2.0 (and its opentelemetry packages; see the Makefile's FT_DEPS)"


def _torchft() -> Any:
    try:
        import torchft
    except ImportError as e:
        raise ImportError(f"shardkit.ft needs torchft, which is not installed: {INSTALL}.") from e
    return torchft


@dataclass
class FaultTolerant:
    """What ``fault_tolerant`` set up: the manager, and the optimizer wrapped for it."""

    model: nn.Module
    manager: Any  # torchft.Manager
    optimizer: Any  # torchft.Optimizer around the user's, or None

    def participants(self) -> int:
        """The replica groups in this step's quorum (waits for the quorum)."""
        return self.manager.num_participants()

    def committed_steps(self) -> int:
        """The steps every group in the quorum committed: this group's step count."""
        return self.manager.current_step()

    def is_healing(self) -> bool:
        """Whether this group is restoring a peer's state this step (it adds zeros to the
        gradient average, and steps with the peers once loaded)."""
        return not self.manager.is_participating()


def fault_tolerant(model: nn.Module, manager: Any, optimizer: torch.optim.Optimizer | None = None, *, key: str = "shardkit") -> FaultTolerant:
    """Make ``model`` (sharded with ``shardkit.fully_shard`` within this replica group) train
    under torchft's ``manager``: the gradient average across replica groups in every group's
    all-reduce hook, the model's (and ``optimizer``'s) state registered under ``key`` for
    healing, and ``optimizer`` wrapped so that it steps only on a committed step."""
    torchft = _torchft()
    modules = _fsdp_modules(model)
    hook = _across_replicas(manager)
    for module in modules:
        module.set_all_reduce_hook(hook)

    def state_dict() -> dict:
        out = {"model": model.state_dict()}
        if optimizer is not None:
            out["optim"] = optimizer.state_dict()
        return out

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        if optimizer is not None:
            optimizer.load_state_dict(state["optim"])

    manager.register_state_dict_fn(key, load_state_dict, state_dict)
    wrapped = torchft.Optimizer(manager, optimizer) if optimizer is not None else None
    return FaultTolerant(model, manager, wrapped)


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from shardkit.core.meshes import resizable
    from shardkit.core.module import FSDPModule

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError(f"shardkit.ft.fault_tolerant: {type(model).__name__} has no fully_shard module; call "
                         "shardkit.fully_shard on its blocks and on it (over this replica group's ranks) first.")
    for name, m in model.named_modules():
        state = getattr(m, "_shardkit_state", None)
        group = getattr(state, "group", None) if state is not None else None
        for part in getattr(group, "parts", ()) or ():
            if part.mesh.ndim == 2 and resizable(part.mesh.get_group(0)):
                raise ValueError(
                    f"shardkit.ft.fault_tolerant: fully_shard module '{name or '<root>'}' already reduces across "
                    "replica groups through its mesh's replicate dimension (a resizable group); its all-reduce hook "
                    "would average twice. Shard over this replica group's ranks only (a 1-D mesh, or HSDP within it)."
                )
    return modules


def _across_replicas(manager: Any):
    def average_across_replica_groups(reduced: torch.Tensor) -> None:
        manager.allreduce(reduced).wait()  # AVG over the groups in the quorum, in place

    return average_across_replica_groups
