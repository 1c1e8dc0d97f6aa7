"""Tensors inside a module's inputs and outputs: tuples, lists, dicts, dataclasses."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch
from torch.distributed.utils import _apply_to_tensors


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor inside ``obj`` (tuples, dicts, dataclasses, ...) as ``dtype``."""
    cast = lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x  # noqa: E731
    return _apply_to_tensors(cast, obj)


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
