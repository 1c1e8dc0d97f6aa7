"""A plan as a rich table (``python -m shardkit plan``) or as JSON (``--json``)."""

from __future__ import annotations

from rich.table import Table

from shardkit.planner.model import GiB

MiB = 1024**2


def size(nbytes: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def table(p) -> Table:
    m = p.memory
    mesh = " x ".join(f"{n}={s}" for n, s in zip(p.mesh_dim_names, p.mesh_shape))
    t = Table(title=f"shardkit plan: {_count(p.total_params)} parameters on {mesh}, per rank",
              caption=f"prefetch depth {p.prefetch}; communication time at {p.bandwidth_gbps:g} GB/s if nothing overlapped",
              show_header=True)
    t.add_column("what")
    t.add_column("per rank", justify="right")
    t.add_row("sharded parameters", size(m.params))
    t.add_row("sharded gradients", size(m.grads))
    t.add_row("optimizer state", size(m.optimizer))
    t.add_row("grad-presence columns", size(m.bookkeeping))
    t.add_row("[bold]persistent[/]", f"[bold]{size(m.persistent)}[/]")
    t.add_row("max unsharded parameters", size(m.max_of.get("unsharded parameters", 0)))
    t.add_row("max gradient buffers (unsharded grads + reduce-scatter buffers)", size(m.max_of.get("gradient buffers", 0)))
    t.add_row("max activations and temporaries", size(m.max_of.get("activations and temporaries", 0)))
    t.add_row(f"[bold]peak[/] (in {m.peak_at})", f"[bold]{size(m.peak)}[/]")
    for part, nbytes in m.at_peak.items():
        if nbytes:
            t.add_row(f"  at the peak: {part}", size(nbytes))
    for kind, s in p.comm.items():
        if s.calls:
            t.add_row(f"{kind.replace('_', '-')} per step", f"{s.calls} calls, {size(s.nbytes)} ({size(s.wire_bytes)} sent)")
    t.add_row("communication time per step", f"{p.comm_seconds * 1e3:.1f} ms")
    choices = {}
    for g in p.groups:
        if g.name:
            choices.setdefault(str(g.reshard_after_forward), []).append(g.name)
    t.add_row("reshard_after_forward", "; ".join(f"{k}: {_span(v)}" for k, v in choices.items()))
    for note in p.notes:
        t.add_row("budget", note)
    return t


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:,}"


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{len(names)} groups ({names[0]} .. {names[-1]})"


def to_json(p) -> dict:
    m = p.memory
    return {
        "mesh_shape": list(p.mesh_shape),
        "mesh_dim_names": list(p.mesh_dim_names),
        "total_params": p.total_params,
        "prefetch": p.prefetch,
        "memory_bytes": {
            "params": m.params, "grads": m.grads, "optimizer": m.optimizer, "bookkeeping": m.bookkeeping, "persistent": m.persistent,
            "peak": m.peak, "peak_at": m.peak_at, "at_peak": m.at_peak, "max_of": m.max_of,
        },
        "comm_per_step": {k: {"calls": s.calls, "bytes": s.nbytes, "wire_bytes": s.wire_bytes} for k, s in p.comm.items()},
        "comm_seconds": p.comm_seconds,
        "bandwidth_gbps": p.bandwidth_gbps,
        "budget_bytes": p.budget,
        "groups": [{"name": g.name or "<root>", "params": g.numel, "reshard_after_forward": g.reshard_after_forward}
                   for g in p.groups],
        "notes": p.notes,
    }
