"""The only place that knows about CUDA streams and events.

[Note: buffer lifetimes]
In this version every collective runs on the current (compute) stream, so the caching
allocator's ordering already keeps each buffer valid until the kernels that read it have
run: an all-gather output lives until ``reshard`` frees it, a reduce-scatter input until the
Python reference to it is dropped after the collective was enqueued behind it. Overlap on
separate streams (and the events and keep-alive references it needs) comes in with the
overlap work; its methods will live here, and on CPU they stay no-ops, so fake-PG, gloo and
CUDA runs take the same control flow.
"""

from __future__ import annotations

import torch


class Streams:
    """Streams for one root's collectives; a no-op on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.is_cuda = device.type == "cuda"

    def sync_before_first_all_gather(self) -> None:
        """Order the first all-gather of a step after the optimizer's updates (same stream today)."""
        return None
