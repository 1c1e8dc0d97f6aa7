"""Compiled mode's unused parameters: ``.grad`` stays None, as in eager mode, where a graph's
backward would give them a zero gradient.

The grad-presence column of eager mode's reduce-scatter (``comm/collectives.py``), carried by
the graph: each bucket's gather also returns one zero *mark* per parameter, and the class
property that reads a parameter during its group's forward passes the tensor through
``_Read``, whose backward gives the parameter's mark a gradient of one. The bucket's backward
lays the marks' gradients next to the gradient's rows, one column per parameter, so the
reduce-scatter sums them over the ranks: a parameter's column counts the ranks whose loss
depended on it. The counts come back as the ``.grad`` of the bucket's presence leaf
(``CompiledGroup.presence_leaf``).

Which parameters a forward did not read is known when dynamo traces it (``forward_begins`` and
``forward_ends`` run at trace time, ``assume_constant_result``, and dynamo runs ``_read`` once
while tracing each read; without compile, all of them run at every call). Only for those
(none, in most models) does the end of backward read the counts back (a device sync on GPU,
as eager mode's when a rank lacks a gradient): the graph's gradient of such a parameter waits
for them (``Watch.pending``), and one that no rank used is dropped (``_after_backward``):
its ``.grad`` stays as it was, its hooks do not run. A parameter read but not used by the loss
(its ``.shape`` only, or a second backward through a ``create_graph=True`` one that does not
reach it) is not watched: it gets the graph's zero gradient. A read with autograd off (under
``no_grad`` inside the forward) is no use: read only so, the parameter is watched.
A weight tied across calls is not watched (the two calls count it apart): it keeps its zero.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from shardkit.compiled.group import CompiledGroup, by_uid


class Watch:
    """What a group knows of its unused parameters; only this file writes it."""

    reads: set[int]  # what the forward being traced read
    unread: set[int]  # what some traced forward did not read: watched
    hooked: dict[int, torch.Tensor]  # bucket -> its presence leaf, with the hook that checks the counts
    pending: dict[int, torch.Tensor]  # parameter -> its gradient this backward reduced, held for the check
    check_queued: bool  # the check at the end of this backward is queued

    def __init__(self) -> None:
        self.reads, self.unread, self.hooked, self.pending, self.check_queued = set(), set(), {}, {}, False

    def holds_back(self, i: int, grad: torch.Tensor) -> bool:
        """Parameter ``i``'s reduced gradient: held until the counts are known if it is watched."""
        if i not in self.unread:
            return False
        self.pending[i] = grad
        return True


class _Read(torch.autograd.Function):
    """The identity on a gathered parameter; its backward marks the parameter as used."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, mark: torch.Tensor) -> torch.Tensor:
        ctx.dtype, ctx.device = mark.dtype, mark.device
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, torch.ones((), dtype=ctx.dtype, device=ctx.device)


def reading(group: CompiledGroup, i: int) -> torch.Tensor:
    """Parameter ``i`` as its group's forward reads it (the gathered tensor, marked as read)."""
    param, mark = group.forward.gathered[i], group.forward.marks[i]
    if not torch.is_grad_enabled():  # (a norm taken under no_grad): no gradient can come of it, so no use
        return param
    if not mark.requires_grad or not param.requires_grad or group.params[i].extension is not None:  # (frozen; marked by gather._Attach)
        read(group, i)
        return param
    return _read(param, mark, group.uid, i)


@torch._dynamo.allow_in_graph
def _read(param: torch.Tensor, mark: torch.Tensor, uid: str, i: int) -> torch.Tensor:
    """In the graph as one call: dynamo runs it (on fake tensors) once while tracing, which
    notes the read as ``read`` would, and dynamo traces one call instead of ``_Read`` and the
    note apart, which made the first compiled step slower. ``i`` may come
    symbolic: after a graph break inside the group's forward, dynamo made the index an input of
    the resumed frame (``int``: the value it was traced with)."""
    by_uid(uid).watch.reads.add(int(i))
    return _Read.apply(param, mark)


_UNREAD_IN_REGION: dict[int, set[int]] = {}  # region id -> the parameters its traced body did not read


@torch.compiler.assume_constant_result
def forward_begins(group: CompiledGroup) -> bool:
    group.watch.reads = set()
    return True


@torch.compiler.assume_constant_result
def read(group: CompiledGroup, i: int) -> bool:
    group.watch.reads.add(i)
    return True


@torch.compiler.assume_constant_result
def forward_ends(group: CompiledGroup, module: nn.Module, region_id: int = -1) -> bool:
    """``module``'s forward, one of the group's, has been traced (``region_id``: as the body of
    that region): what it did not read of the parameters under it (a group of several modules
    runs one forward per module). A forward without autograd (evaluation under no_grad) gives
    no gradient: it watches nothing."""
    if not torch.is_grad_enabled():
        return True
    under = set(module.modules())
    ran = {i for i, p in enumerate(group.params) if any(slot.module in under for slot in p.slots)}
    unread = ran - group.watch.reads
    if region_id >= 0:
        _UNREAD_IN_REGION[region_id] = unread
    watch(group, unread)
    return True


@torch.compiler.assume_constant_result
def region_ran(group: CompiledGroup, region_id: int) -> bool:
    """A block ran region ``region_id``, traced for another block of its structure: the same
    parameters go unread."""
    watch(group, _UNREAD_IN_REGION.get(region_id, set()))
    return True


def watch(group: CompiledGroup, unread: set[int]) -> None:
    """Check the counts at the end of each backward for these parameters (once watched, always)."""
    new = {i for i in unread if i not in group.owners and i not in group.lent} - group.watch.unread
    if not new:
        return
    group.watch.unread |= new
    for b in range(len(group.buckets)):
        group.presence_leaf(b).grad = None  # counts from now on only
    rewatch(group)


def rewatch(group: CompiledGroup) -> None:
    """A hook on the presence leaf of each bucket with a watched parameter (``make_buckets``
    makes new leaves). Not on the parameters: ``.to()`` swaps a DTensor parameter's contents
    in place, and the hooks registered on it stop firing."""
    for b, bucket in enumerate(group.buckets):
        leaf = group.presence_leaf(b)
        if bucket.differentiable and group.watch.unread.intersection(bucket.indices) and group.watch.hooked.get(b) is not leaf:
            leaf.register_hook(lambda counts, group=group: _counted(group))
            group.watch.hooked[b] = leaf


def _counted(group: CompiledGroup) -> None:
    """A backward reduced a bucket with a watched parameter: check them all once it has ended."""
    if not group.watch.check_queued:
        group.watch.check_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _after_backward(group))


def _after_backward(group: CompiledGroup) -> None:
    """The end of a backward that reduced a watched parameter: its gradient, held back by
    ``group._to_param`` until the counts are known, goes to ``.grad`` where some rank used it
    (with its post-accumulate-grad hooks); where no rank did, it is dropped: ``.grad`` stays as
    it was (None after ``zero_grad()``; a gradient from outside its group's forward, a
    regularizer of the loss on the sharded parameter itself, is autograd's and stays), and no
    hook runs, as in eager mode and FSDP2."""
    group.watch.check_queued = False
    pending, group.watch.pending = group.watch.pending, {}
    for b, bucket in enumerate(group.buckets):
        leaf = group.presence_leaf(b)
        counts, leaf.grad = leaf.grad, None
        watched = [(k, i) for k, i in enumerate(bucket.indices) if i in pending]
        values = counts.tolist() if counts is not None and watched else None
        for k, i in watched:
            if values is None or values[k] != 0:
                group.params[i].set_sharded_grad(pending[i])
