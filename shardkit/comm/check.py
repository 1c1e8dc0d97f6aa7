"""When ranks disagree about the next collective, say so instead of hanging.

Ranks that issue different collectives (one skipped a group's forward, or ran groups in a
different order) would block until the process group's timeout, or worse, exchange the
wrong bytes. Two aids:

- **Check mode** (``SHARDKIT_CHECK=1``, or ``shardkit.check_collectives(True)``): before each
  collective every rank all-gathers a small fingerprint of it (kind, group, dtype, elements,
  ranks) and compares; on a mismatch every rank raises ``CollectiveMismatch`` naming what
  each rank was about to do, within the time of one small collective. Costs one extra
  blocking collective per collective: for debugging.
- **Always**: each rank remembers its last collectives; when waiting for one fails (a
  timeout, a peer that died), the error says what this rank had issued.
"""

from __future__ import annotations

import collections
import os

import torch
import torch.distributed as dist

from shardkit.core.meshes import resizable

_enabled = os.environ.get("SHARDKIT_CHECK", "0") not in ("", "0")
_recent: collections.deque = collections.deque(maxlen=8)


class CollectiveMismatch(RuntimeError):
    pass


def check_collectives(enabled: bool = True) -> None:
    """Turn check mode on or off for this process (every rank must agree)."""
    global _enabled
    _enabled = enabled


def before(pg: dist.ProcessGroup, kind: str, name: str, dtype: torch.dtype, numel: int, world: int) -> None:
    """Record the collective about to be issued; in check mode, compare it across ranks."""
    _recent.append((kind, name, dtype, numel, world))  # formatted only if ever shown
    if not _enabled or resizable(pg):  # (a resizable group, e.g. torchft's, runs its own checks)
        return
    fingerprint = (kind, name or "<root>", str(dtype).removeprefix("torch."), numel, world)
    every: list = [None] * world
    dist.all_gather_object(every, fingerprint, group=pg)
    if any(f != fingerprint for f in every):
        sides = "\n".join(f"  rank {r}: {_describe(f)}" for r, f in enumerate(every))
        raise CollectiveMismatch(
            f"shardkit: the ranks are about to issue different collectives:\n{sides}\n"
            "Every rank must run the same fully_shard modules in the same order; for modules "
            "that run on some ranks only, call set_lockstep(True) on the root."
        )


def failed(exc: BaseException) -> RuntimeError:
    """A waiting error, with this rank's last collectives attached."""
    history = "\n".join(f"  {_describe(f)}" for f in _recent) or "  (none)"
    return RuntimeError(
        f"shardkit: a collective failed or timed out ({type(exc).__name__}: {exc}).\n"
        f"This rank's last collectives, oldest first:\n{history}\n"
        "Compare with the other ranks' errors; rerun with SHARDKIT_CHECK=1 to find the first "
        "collective where the ranks disagree."
    )


def _describe(f: tuple) -> str:
    kind, name, dtype, numel, world = f
    dtype = str(dtype).removeprefix("torch.")
    return f"{kind} of group '{name or '<root>'}', {dtype}, {numel} elements over {world} ranks"
