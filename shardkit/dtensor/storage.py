"""Freeing and refilling a buffer's storage while the tensor (and every view of it) lives on:
how unsharded parameters and all-gather outputs give their memory back between uses."""

import torch


def free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def alloc_storage(t: torch.Tensor) -> None:
    nbytes = t.numel() * t.element_size()
    if t.untyped_storage().size() != nbytes:
        t.untyped_storage().resize_(nbytes)
