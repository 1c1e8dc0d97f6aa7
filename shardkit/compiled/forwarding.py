"""Compiled mode's forward of a group: the gathered parameters its modules read while it runs,
and the states it goes through.

A group gathers at the first of: its module's forward (``gathering``), or a pre-hook put before
the module's own forward pre-hooks (``gather_before_pre_hooks``: they read the parameters
gathered, as in FSDP2). A group of several modules directly inside another call (a *spanning*
group, ``fully_shard([a, b])``) is gathered at the first of its modules' forwards and held while
its parent's forward runs (the parent opens and closes its *scope*): one all-gather per forward
of the parent, as eager mode keeps it from the first of them to the last.

Its states: forward_state.py.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from shardkit.compiled import region, unused
from shardkit.compiled.gather import gather
from shardkit.compiled.group import CompiledGroup
from shardkit.core.tensors import cast_inputs, cast_output


def _gatherer(group: CompiledGroup, module: nn.Module) -> int:
    """Which of the group's modules gathers it. A group of several modules that each gather it
    in one graph (called outside their parent's forward, or a group without a parent) gathers
    the same way twice: AOTAutograd's CSE then merges the second gather into the first across
    their two checkpoints, and its partitioner fails ("failed to partition the joint
    forward-backward graph": it must save at that boundary the copy-out's list of outputs).
    ``gather._bucket_gathered`` views the first shard by this index, which keeps them apart."""
    return group.modules.index(module) if len(group.modules) > 1 else 0


def param_property(group: CompiledGroup, name: str, i: int) -> property:
    """Parameter ``i`` of ``group``, registered as ``name``: the gathered tensor while the group
    is gathered, the sharded parameter otherwise."""

    def get(module: nn.Module) -> Any:
        return unused.reading(group, i) if group.forward.gathered is not None else module._parameters[name]

    return property(get)


def _gathering_of(group: CompiledGroup, module: nn.Module) -> Any:
    def gathering() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return gather(group, _gatherer(group, module))

    return gathering


def registering_pre_hooks(group: CompiledGroup, base: type) -> Any:
    """``register_forward_pre_hook`` of one of the group's modules: the group gathers before
    the module's pre-hooks, whenever they were registered (``prepend`` too)."""

    def register_forward_pre_hook(self: nn.Module, hook: Any, *, prepend: bool = False, with_kwargs: bool = False) -> Any:
        handle = base.register_forward_pre_hook(self, hook, prepend=prepend, with_kwargs=with_kwargs)
        gather_before_pre_hooks(group, self)
        return handle

    return register_forward_pre_hook


def gather_before_pre_hooks(group: CompiledGroup, module: nn.Module) -> None:
    """FSDP2 unshards a module's parameters in a forward pre-hook registered first, so the
    module's own pre-hooks read them unsharded: the hook-based ``nn.utils.spectral_norm`` and
    ``weight_norm`` compute the weight there from ``weight_orig`` or ``weight_g``/``weight_v``.
    Compiled mode gathers inside forward, after the hooks; a module of the group with forward
    pre-hooks gets one more, first of all, that gathers (and casts the inputs) instead. Modules
    without pre-hooks get none (a hook costs dynamo's trace and each eager call some time)."""
    old = module.__dict__.pop("_shardkit_pre_hook", None)
    if old is not None:
        old.remove()
    hook = functools.partial(_gather_early, group)
    module.__dict__["_shardkit_pre_hook"] = nn.Module.register_forward_pre_hook(module, hook, prepend=True, with_kwargs=True)


def _gather_early(group: CompiledGroup, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    forward = group.forward
    if forward.running:  # re-entry, as in gathering_forward
        return None
    unused.forward_begins(group)
    forward.pre_hook(_gathering_of(group, module))
    return cast_inputs(group.mp_policy, args, kwargs)


def gathering(group: CompiledGroup, forward_fn: Any) -> Any:
    """``forward_fn`` (or a method given to ``register_fsdp_forward_method``) with the group's
    parameters gathered while it runs."""

    def gathering_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_inputs(group.mp_policy, args, kwargs)
        forward = group.forward
        if forward.running:  # re-entry: another module of the group, called inside this one
            output = forward_fn(self, *args, **kwargs)
        elif (forward.idle and group.region and forward_fn is type(self)._shardkit_plain_forward
              and region.callable_with(args, kwargs) and region.allowed_here()):
            output = region.run(group, self, args, kwargs)
        else:
            if not forward.early:
                unused.forward_begins(group)
            forward.begin(_gathering_of(group, self))
            for child in group.spanning:
                child.forward.open_scope()
            try:
                output = forward_fn(self, *args, **kwargs)
            finally:
                forward.end()
                for child in group.spanning:
                    child.forward.close()
            unused.forward_ends(group, self)
        return cast_output(group.mp_policy, output)

    # Its own code object: dynamo keeps a function's compiled graphs on its code object and
    # stops compiling it at ``recompile_limit`` (8) graphs. A graph guards on the identity of
    # the group it gathers, so each model compiled in the process added one graph to the one
    # shared code object, and the ninth failed (fullgraph=True) or ran its root eagerly. With a
    # code object per group, each model's root frame keeps its own graphs, as the unsharded
    # model's forward keeps one for all its instances.
    gathering_forward.__code__ = gathering_forward.__code__.replace()
    return gathering_forward
