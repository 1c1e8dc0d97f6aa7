"""Tensors inside a module's inputs and outputs (tuples, lists, dicts, dataclasses): casts,
device moves, and the autograd hooks that tell the schedule when gradients arrive."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch
from torch.distributed.utils import _apply_to_tensors
from torch.utils._pytree import tree_flatten, tree_unflatten


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor inside ``obj`` (tuples, dicts, dataclasses, ...) as ``dtype``."""
    cast = lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x  # noqa: E731
    return _apply_to_tensors(cast, obj)


def cast_inputs(policy: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward's arguments as a ``MixedPrecisionPolicy`` casts them: in ``param_dtype`` unless
    ``cast_forward_inputs`` is off."""
    if policy.param_dtype is None or not policy.cast_forward_inputs:
        return args, kwargs
    return cast_floating((args, kwargs), policy.param_dtype)


def cast_output(policy: Any, output: Any) -> Any:
    """A forward's output as a ``MixedPrecisionPolicy`` casts it: in ``output_dtype``, if set."""
    return output if policy.output_dtype is None else cast_floating(output, policy.output_dtype)


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples, lists, dicts and dataclasses (model outputs)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from iter_tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_tensors(x)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))


def to_device(obj: Any, device: torch.device) -> Any:
    """Every tensor inside ``obj`` on ``device`` (asynchronously from pinned memory)."""
    return _apply_to_tensors(lambda x: x.to(device, non_blocking=True), obj)


def on_output_grads(output: Any, callback: Callable[[torch.Tensor], None]) -> None:
    """Call ``callback`` whenever the gradient of a tensor of ``output`` (that needs one) arrives."""
    for t in iter_tensors(output):
        if t.requires_grad:
            t.register_hook(callback)


def on_input_grads(args: tuple, kwargs: dict, callback: Callable[[], None]) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` with their tensors that need grad passed through an identity
    autograd Function whose backward calls ``callback``: once the gradients of all of them are
    computed (a module's parameters' gradients are accumulated by then)."""
    if not kwargs and all(type(x) in _LEAVES or isinstance(x, torch.Tensor) for x in args):
        flat, spec = list(args), None  # the usual call, module(x): no need to flatten
    else:
        flat, spec = tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not where:
        return args, kwargs
    outs = _apply(callback, *(flat[i] for i in where))
    for i, out in zip(where, outs):
        flat[i] = out
    return (tuple(flat), kwargs) if spec is None else tree_unflatten(flat, spec)


_LEAVES = {int, float, bool, str, type(None)}  # arguments that hold no tensors


class _OnInputGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, callback: Callable[[], None], *inputs: torch.Tensor):
        ctx.callback = callback
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.callback()
        return (None, *grads)


# ``Function.apply`` minus its Python checks (setup_context, functorch wrappers: neither applies
# here), once per group per forward.
_apply = super(torch.autograd.Function, _OnInputGrads).apply
