"""What the compute itself holds: one forward and backward of the unsharded model on fake
tensors, counting the bytes of every tensor an operator creates until it is freed.

The run records, per operator, the live bytes of activations, temporaries and activation
gradients (``curve``), and where each group's forward and backward begin and end and when
each parameter's gradient first arrives (op indices). Parameters are not counted here (the
schedule in ``simulate.py`` owns them and their unsharded gradients), and a parameter's
gradient is dropped as soon as it is accumulated, as the runtime hands it to a
reduce-scatter instead.

Fake tensors on the CPU pick the same kernels as real ones (the CPU flash attention, say),
which the meta device does not.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from shardkit.core.tensors import iter_tensors


@dataclass
class Profile:
    curve: list[int] = field(default_factory=list)  # live compute bytes after each op
    forward: dict[str, tuple[int, int]] = field(default_factory=dict)  # group -> (first op, end)
    backward: dict[str, tuple[int, int]] = field(default_factory=dict)  # group -> (first op, end)
    grad_arrival: dict[str, int] = field(default_factory=dict)  # parameter FQN -> op index
    backward_start: int = 0
    end: int = 0  # ops in all

    def forward_order(self) -> list[str]:
        return sorted(self.forward, key=lambda g: self.forward[g][0])

    def post_forward_order(self) -> list[str]:
        return sorted(self.forward, key=lambda g: self.forward[g][1])


class _LiveBytes(TorchDispatchMode):
    """Counts each storage an operator returns once, until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.seen: set[int] = set()
        self.curve: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage())
        self.curve.append(self.live)
        return out

    def ignore(self, tensors) -> None:
        """Storages not to count (parameters and buffers: the schedule owns those)."""
        self._ignored = [t.untyped_storage() for t in tensors]  # kept alive: their ids stay theirs
        self.seen.update(id(st) for st in self._ignored)

    def _count(self, storage) -> None:
        key = id(storage)
        if key in self.seen:
            return
        nbytes = storage.nbytes()
        self.seen.add(key)
        self.live += nbytes
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


class _Mark(torch.autograd.Function):
    """Identity on a group's inputs; its backward marks the end of the group's backward."""

    @staticmethod
    def forward(ctx, callback, *inputs):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.callback()
        return (None, *grads)


def run(model: nn.Module, groups: dict[str, nn.Module], params: dict[str, str], make_inputs: Callable[[], tuple],
        loss_of: Callable[[Any, tuple], torch.Tensor]) -> Profile:
    """One training step of ``model`` (fake tensors) under the counter. ``groups`` maps group
    names to modules ("" the root), ``params`` parameter FQNs to their group."""
    prof, counter = Profile(), _LiveBytes()
    counter.ignore([*model.parameters(), *model.buffers()])
    now = lambda: len(counter.curve)  # noqa: E731
    handles = []
    for name, module in groups.items():
        handles += _mark_group(module, name, prof, now)
    for fqn, p in model.named_parameters():
        handles.append(p.register_post_accumulate_grad_hook(_drop_grad(fqn, prof, now)))
    try:
        with counter:
            inputs = make_inputs()
            loss = loss_of(model(*inputs), inputs)
            prof.backward_start = now()
            loss.backward()
            del loss, inputs
    finally:
        for h in handles:
            h.remove()
    prof.curve, prof.end = counter.curve, now()
    return prof


def _mark_group(module: nn.Module, name: str, prof: Profile, now) -> list:
    """Forward pre/post hooks, a hook on the outputs (backward begins) and a ``_Mark`` on the
    inputs (backward ends), as the runtime places its own."""

    def pre(mod, args, kwargs):
        prof.forward.setdefault(name, (now(), -1))
        flat, spec = tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not where:
            return None
        outs = _Mark.apply(lambda: _end_backward(name, prof, now), *(flat[i] for i in where))
        for i, out in zip(where, outs):
            flat[i] = out
        return torch.utils._pytree.tree_unflatten(flat, spec)

    def post(mod, args, output):
        start, _ = prof.forward[name]
        prof.forward[name] = (start, now())
        for t in iter_tensors(output):
            if t.requires_grad:
                t.register_hook(lambda grad: _begin_backward(name, prof, now))
        return output

    return [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]


def _begin_backward(name: str, prof: Profile, now) -> None:
    prof.backward.setdefault(name, (now(), -1))


def _end_backward(name: str, prof: Profile, now) -> None:
    start, _ = prof.backward.get(name, (now(), -1))
    prof.backward[name] = (start, now())


def _drop_grad(fqn: str, prof: Profile, now):
    def hook(p: torch.Tensor) -> None:
        prof.grad_arrival.setdefault(fqn, now())
        p.grad = None

    return hook
