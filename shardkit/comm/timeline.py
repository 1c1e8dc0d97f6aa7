"""Every rank's trace on one Perfetto / Chrome timeline, so overlap can be seen.

Each rank is a process with these lanes (threads):

- ``compute``: each group's forward and backward as a slice (nested: the root's slice holds
  the blocks'), and inside them ``wait <collective> <group>`` where a hook blocked on
  communication: the part of it the compute did not hide.
- ``all_gather``, ``reduce_scatter``, ``all_reduce``: each collective from when it was
  issued to when it completed; when two are in flight at once the second gets its own lane
  (``all_gather #2``).

Open the file at https://ui.perfetto.dev (or chrome://tracing). Times are microseconds from
the earliest event of any rank, on the wall clock each rank's trace noted when it began.

Example::

    with shardkit.trace() as t:
        train_step()
    traces = t.gather()  # every rank calls this; rank 0 gets the list
    if traces:
        shardkit.timeline.write(traces, "timeline.json")

Setting ``SHARDKIT_TRACE=<folder>`` traces the whole run: each rank writes ``rank<r>.txt`` and
``rank<r>.json`` there at exit, and ``python -m shardkit timeline <folder>`` merges the ranks
into ``timeline.json``.
"""

from __future__ import annotations

import atexit
import json
import os
import re
from pathlib import Path

import torch.distributed as dist

from shardkit.comm import trace
from shardkit.comm.trace import COLLECTIVES, Record, Trace

COMPUTE = "compute"


def origin_ns(traces: list[Trace]) -> int:
    """The wall-clock time of the earliest event of any rank: time zero of the timeline."""
    return min((_wall(t, t.events[0].t) for t in traces if t.events), default=0)


def chrome_events(traces: list[Trace], origin: int | None = None) -> list[dict]:
    """The Chrome trace events of these ranks' traces (one process per rank)."""
    origin = origin_ns(traces) if origin is None else origin
    events: list[dict] = []
    for t in traces:
        pid = t.rank or 0  # None: a trace without torch.distributed
        lanes = _Lanes(pid, events)
        us = lambda ns: (_wall(t, ns) - origin) / 1000  # noqa: E731
        events.append(_meta("process_name", pid, None, f"rank {pid}"))
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        lanes.tid(COMPUTE)
        open_spans: dict[tuple[str, str], int] = {}  # (group, "forward"/"backward") -> start ns
        for e in t.events:
            if e.kind == "phase":
                _phase(e, open_spans, lambda name, start, end, g: events.append(
                    _slice(name, "phase", pid, lanes.tid(COMPUTE), us(start), us(end), {"group": g or "<root>"})))
            elif e.kind in COLLECTIVES and e.done_ns:
                args = {
                    "group": e.group or "<root>", "dtype": str(e.dtype).removeprefix("torch."),
                    "bytes": e.nbytes, "world": e.world, "mesh_dim": e.mesh_dim,
                    "waited_us": round(e.exposed_ns / 1000, 3),
                }
                if e.detail:
                    args["note"] = e.detail
                tid = lanes.collective(e.kind, e.t, e.done_ns)
                events.append(_slice(f"{e.kind} {e.group or '<root>'}", e.kind, pid, tid, us(e.t), us(e.done_ns), args))
                if e.exposed_ns:
                    events.append(_slice(f"wait {e.kind} {e.group or '<root>'}", "wait", pid,
                                         lanes.tid(COMPUTE), us(e.wait_ns), us(e.done_ns), args))
    return events


def write(traces: list[Trace], path: str | Path) -> Path:
    """Write the ranks' traces as one Chrome trace JSON file; returns its path."""
    origin = origin_ns(traces)
    return _write_json(chrome_events(traces, origin), origin, Path(path))


def merge(folder: str | Path, out: str | Path | None = None) -> Path:
    """Merge the per-rank ``rank<r>.json`` files a ``SHARDKIT_TRACE=<folder>`` run wrote into
    one timeline (``<folder>/timeline.json`` unless ``out`` says otherwise)."""
    folder = Path(folder)
    files = sorted((p for p in folder.glob("rank*.json") if re.fullmatch(r"rank\d+", p.stem)),
                   key=lambda p: int(p.stem.removeprefix("rank")))
    if not files:
        raise FileNotFoundError(f"shardkit: no rank<r>.json files in {folder}; was the run started with SHARDKIT_TRACE={folder}?")
    ranks = [json.loads(f.read_text()) for f in files]
    # Each file counts from its own first event: line the ranks up on the wall clock again.
    first = min(r["otherData"]["wall_origin_ns"] for r in ranks)
    events = []
    for r in ranks:
        shift_us = (r["otherData"]["wall_origin_ns"] - first) / 1000
        for e in r["traceEvents"]:
            if "ts" in e:
                e["ts"] = round(e["ts"] + shift_us, 3)
            events.append(e)
    return _write_json(events, first, Path(out) if out else folder / "timeline.json")


def _write_json(events: list[dict], origin: int, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"wall_origin_ns": origin}}
    path.write_text(json.dumps(doc))
    return path


def _wall(t: Trace, ns: int) -> int:
    return t.start_wall_ns + (ns - t.start_ns)


def _phase(e: Record, open_spans: dict, emit) -> None:
    """Open or close a group's forward/backward span when it enters or leaves FORWARD or
    PRE_BACKWARD (recomputation under activation checkpointing stays inside the backward span)."""
    old, new = e.detail.split(": ")[1].split(" -> ")
    for phase, what in (("FORWARD", "forward"), ("PRE_BACKWARD", "backward")):
        if old == phase and new != phase:
            _close(e, what, open_spans, emit)
        elif new == phase and old != phase:
            open_spans[(e.group, what)] = e.t


def _close(e: Record, what: str, open_spans: dict, emit) -> None:
    start = open_spans.pop((e.group, what), None)
    if start is not None:
        emit(f"{what} {e.group or '<root>'}", start, e.t, e.group)


class _Lanes:
    """Thread ids per rank: the compute lane, and as many lanes per collective kind as were
    in flight at once."""

    def __init__(self, pid: int, events: list[dict]) -> None:
        self.pid, self.events = pid, events
        self.tids: dict[str, int] = {}
        self.busy_until: dict[str, list[int]] = {k: [] for k in COLLECTIVES}

    def tid(self, lane: str) -> int:
        if lane not in self.tids:
            tid = self.tids[lane] = len(self.tids)
            self.events.append(_meta("thread_name", self.pid, tid, lane))
            self.events.append({"ph": "M", "name": "thread_sort_index", "pid": self.pid, "tid": tid, "args": {"sort_index": tid}})
        return self.tids[lane]

    def collective(self, kind: str, start: int, end: int) -> int:
        """The first ``kind`` lane free at ``start``; it is busy until ``end``."""
        busy = self.busy_until[kind]
        for i, until in enumerate(busy):
            if until <= start:
                busy[i] = end
                break
        else:
            i = len(busy)
            busy.append(end)
        return self.tid(kind if i == 0 else f"{kind} #{i + 1}")


def _meta(name: str, pid: int, tid: int | None, value: str) -> dict:
    event = {"ph": "M", "name": name, "pid": pid, "args": {"name": value}}
    if tid is not None:
        event["tid"] = tid
    return event


def _slice(name: str, cat: str, pid: int, tid: int, start_us: float, end_us: float, args: dict) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
            "ts": round(start_us, 3), "dur": round(max(end_us - start_us, 0.0), 3), "args": args}


def _trace_whole_run(folder: str) -> None:
    """``SHARDKIT_TRACE=<folder>``: record from import to exit, then write this rank's files."""
    t = trace.start()

    def write_at_exit() -> None:
        if not t.events:  # a process that ran no shardkit (``python -m shardkit timeline``, a
            return  # launcher) would otherwise overwrite rank 0's files with an empty trace
        t.resolve()
        if t.rank is None:  # no collective ran after init_process_group
            t.rank = int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0))
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{t.rank}.txt").write_text(t.format(times=True) + "\n")
        write([t], out / f"rank{t.rank}.json")

    atexit.register(write_at_exit)

if os.environ.get("SHARDKIT_TRACE"):
    _trace_whole_run(os.environ["SHARDKIT_TRACE"])
