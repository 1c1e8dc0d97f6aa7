"""The only place that knows about CUDA streams and events.

[Note: buffer lifetimes]
In this version the hooks issue every collective synchronously on the current (compute)
stream and wait for it at once, so the caching allocator's stream order already keeps each
buffer valid: an all-gather output lives until ``reshard`` frees it, a reduce-scatter input
until the collective enqueued behind its producer has read it. An explicit prefetch or
``unshard(async_op=True)`` runs on the process group's own stream (NCCL) or thread (gloo);
its input buffer stays alive because the pending all-gather holds it until ``wait()``.
Overlap on our own streams (and the events and keep-alive references it needs) comes with
the overlap work; its methods will live here, and on CPU they stay no-ops, so fake-PG, gloo
and CUDA runs take the same control flow.
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
