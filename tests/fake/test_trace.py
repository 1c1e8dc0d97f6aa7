"""The collective trace on a fake process group: its rendering, its times, its Perfetto
timeline (comm/timeline.py), its torch.profiler labels and the mesh dimension it names.
A real SHARDKIT_TRACE run on 2 gloo ranks: tests/gloo/test_trace_env.py."""

import contextlib
import copy
import json
import re
from collections import Counter

import torch
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh

import shardkit
from shardkit import fully_shard
from shardkit.comm import trace as trace_module
from shardkit.comm.trace import Record, Trace
from tests.conftest import TanhStack, fake_world

GROUPS = ["<root>", "blocks.0", "blocks.1", "blocks.2"]


def sharded(mesh) -> TanhStack:
    torch.manual_seed(0)
    net = TanhStack(3, dim=8)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def second_step(mesh) -> Trace:
    """The trace of the second training step (the first records the prefetch order)."""
    net = sharded(mesh)
    net(torch.randn(2, 8)).sum().backward()
    with shardkit.trace() as t:
        net(torch.randn(2, 8)).sum().backward()
    return t


def traced_step() -> Trace:
    with fake_world(4, 0) as mesh:
        return second_step(mesh)


def slices(doc: dict, pid: int = 0) -> list[dict]:
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]


def thread_names(doc: dict, pid: int = 0) -> list[str]:
    return [e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name" and e["pid"] == pid]


def test_three_block_step_trace_lists_every_phase_change_and_collective():
    t = traced_step()
    assert_expected_inline(t.format(), """\
phase <root> start_forward: IDLE -> FORWARD
all_gather <root> float32 numel=108 world=4 mesh=dim0
wait all_gather <root>
unshard <root>
all_gather blocks.0 float32 numel=72 world=4 mesh=dim0
phase blocks.0 pre_forward: IDLE -> FORWARD
wait all_gather blocks.0
unshard blocks.0
all_gather blocks.1 float32 numel=72 world=4 mesh=dim0
phase blocks.0 post_forward: FORWARD -> IDLE
reshard blocks.0
phase blocks.1 pre_forward: IDLE -> FORWARD
wait all_gather blocks.1
unshard blocks.1
all_gather blocks.2 float32 numel=72 world=4 mesh=dim0
phase blocks.1 post_forward: FORWARD -> IDLE
reshard blocks.1
phase blocks.2 pre_forward: IDLE -> FORWARD
wait all_gather blocks.2
unshard blocks.2
phase blocks.2 post_forward: FORWARD -> IDLE
reshard blocks.2
phase <root> end_forward: FORWARD -> IDLE
phase <root> pre_backward: IDLE -> PRE_BACKWARD
all_gather blocks.2 float32 numel=72 world=4 mesh=dim0
phase blocks.2 pre_backward: IDLE -> PRE_BACKWARD
wait all_gather blocks.2
unshard blocks.2
all_gather blocks.1 float32 numel=72 world=4 mesh=dim0
phase blocks.2 post_backward: PRE_BACKWARD -> POST_BACKWARD
reduce_scatter blocks.2 float32 numel=80 world=4 mesh=dim0
reshard blocks.2
phase blocks.1 pre_backward: IDLE -> PRE_BACKWARD
wait all_gather blocks.1
unshard blocks.1
all_gather blocks.0 float32 numel=72 world=4 mesh=dim0
phase blocks.1 post_backward: PRE_BACKWARD -> POST_BACKWARD
reduce_scatter blocks.1 float32 numel=80 world=4 mesh=dim0
reshard blocks.1
wait reduce_scatter blocks.2
phase blocks.0 pre_backward: IDLE -> PRE_BACKWARD
wait all_gather blocks.0
unshard blocks.0
phase blocks.0 post_backward: PRE_BACKWARD -> POST_BACKWARD
reduce_scatter blocks.0 float32 numel=80 world=4 mesh=dim0
reshard blocks.0
wait reduce_scatter blocks.1
phase <root> post_backward: PRE_BACKWARD -> POST_BACKWARD
reduce_scatter <root> float32 numel=124 world=4 mesh=dim0
reshard <root>
wait reduce_scatter blocks.0
wait reduce_scatter <root>
phase <root> finalize: POST_BACKWARD -> IDLE
phase blocks.0 finalize: POST_BACKWARD -> IDLE
phase blocks.1 finalize: POST_BACKWARD -> IDLE
phase blocks.2 finalize: POST_BACKWARD -> IDLE""")


def test_format_with_times_starts_lines_with_milliseconds_and_ends_collectives_with_their_wait():
    t = traced_step()
    lines = t.format(times=True).splitlines()
    assert len(lines) == len(t.events) == 56  # 45 phase changes, unshards, reshards and collectives, 11 waits
    assert all(re.match(r" *\d+\.\d{3} ms  \S", line) for line in lines), lines
    times = [float(line.split(" ms")[0]) for line in lines]
    assert times == sorted(times) and times[0] >= 0
    timed = [line for line in lines if re.search(r"  \(in flight \d+\.\d{3} ms, waited \d+\.\d{3} ms\)$", line)]
    assert len(timed) == 11 and all(" all_gather " in line or " reduce_scatter " in line for line in timed)
    for e in t.collectives():  # issued, then complete (the fake work at once); every one waited for
        assert e.done_ns >= e.t and e.wait_ns >= e.t and e.exposed_ns >= 0
    summary = t.summary()
    assert [(kind, s.calls) for kind, s in summary.items()] == [("all_gather", 7), ("reduce_scatter", 4), ("all_reduce", 0)]
    assert all(s.exposed_ns >= 0 for s in summary.values())


def test_timeline_has_one_process_with_a_lane_per_kind_and_a_slice_per_collective_and_phase(tmp_path):
    t = traced_step()
    doc = json.loads(shardkit.timeline.write([t], tmp_path / "x.json").read_text())
    names = [e for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert [(e["pid"], e["args"]["name"]) for e in names] == [(0, "rank 0")]
    assert thread_names(doc) == ["compute", "all_gather", "reduce_scatter"]  # nothing in flight twice
    xs = slices(doc)
    assert Counter(e["cat"] for e in xs) == {"phase": 8, "all_gather": 7, "reduce_scatter": 4}  # no waits
    assert Counter(e["name"] for e in xs if e["cat"] == "phase") == {
        f"{what} {g}": 1 for what in ("forward", "backward") for g in GROUPS}
    collectives = [e for e in xs if e["cat"] != "phase"]
    assert [(e["name"], e["args"]["bytes"]) for e in collectives] == [
        (f"{e.kind} {e.group or '<root>'}", e.nbytes) for e in t.collectives()]
    assert [e["args"]["bytes"] for e in collectives if e["cat"] == "reduce_scatter"] == [320, 320, 320, 496]
    tids = {e["args"]["name"]: e["tid"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert all(e["tid"] == tids[e["cat"] if e["cat"] != "phase" else "compute"] for e in xs)
    # The root's forward holds the blocks' forwards (nested slices on the compute lane).
    span = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in xs if e["cat"] == "phase"}
    root = span["forward <root>"]
    assert all(root[0] <= span[f"forward blocks.{i}"][0] <= span[f"forward blocks.{i}"][1] <= root[1] for i in range(3))
    assert min(e["ts"] for e in xs) == 0 and doc["otherData"]["wall_origin_ns"] > 0


def test_timeline_of_two_ranks_has_two_processes(tmp_path):
    t0 = traced_step()
    t1 = copy.deepcopy(t0)
    t1.rank = 1
    doc = json.loads(shardkit.timeline.write([t0, t1], tmp_path / "x.json").read_text())
    names = [(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert names == [(0, "rank 0"), (1, "rank 1")]
    assert thread_names(doc, 1) == ["compute", "all_gather", "reduce_scatter"]
    assert len(slices(doc, 0)) == len(slices(doc, 1)) == 19
    assert [e["ts"] for e in slices(doc, 0)] == [e["ts"] for e in slices(doc, 1)]  # the same clock


def test_timeline_merge_lines_rank_files_up_on_the_wall_clock(tmp_path):
    t0 = traced_step()
    t1 = copy.deepcopy(t0)
    t1.rank = 1
    t1.start_wall_ns += 5_000_000  # rank 1 ran the same step 5 ms later
    shardkit.timeline.write([t0], tmp_path / "rank0.json")
    shardkit.timeline.write([t1], tmp_path / "rank1.json")
    files = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    shift_us = (files[1]["otherData"]["wall_origin_ns"] - files[0]["otherData"]["wall_origin_ns"]) / 1000
    assert shift_us == 5000
    assert [e["ts"] for e in slices(files[0], 0)] == [e["ts"] for e in slices(files[1], 1)]  # each from its 0

    merged = json.loads(shardkit.timeline.merge(tmp_path).read_text())
    assert (tmp_path / "timeline.json").exists()
    assert {e["pid"] for e in merged["traceEvents"]} == {0, 1}
    assert merged["otherData"]["wall_origin_ns"] == files[0]["otherData"]["wall_origin_ns"]
    assert [e["ts"] for e in slices(merged, 0)] == [e["ts"] for e in slices(files[0], 0)]
    assert [e["ts"] for e in slices(merged, 1)] == [round(e["ts"] + shift_us, 3) for e in slices(files[1], 1)]


def test_timeline_gives_overlapping_collectives_a_second_lane_and_marks_exposed_waits(tmp_path):
    t = Trace()
    ms = 1_000_000
    t.events = [
        Record("all_gather", "a", dtype=torch.float32, numel=4, world=2, t=t.start_ns, done_ns=t.start_ns + 3 * ms),
        Record("all_gather", "b", dtype=torch.float32, numel=4, world=2, t=t.start_ns + 1 * ms,
              wait_ns=t.start_ns + 2 * ms, done_ns=t.start_ns + 4 * ms),  # in flight beside "a", waited 2 ms
        Record("all_gather", "c", dtype=torch.float32, numel=4, world=2, t=t.start_ns + 3 * ms, done_ns=t.start_ns + 5 * ms),
    ]
    doc = json.loads(shardkit.timeline.write([t], tmp_path / "x.json").read_text())
    assert thread_names(doc) == ["compute", "all_gather", "all_gather #2"]
    lane = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert [(e["name"], lane[e["tid"]], e["ts"], e["dur"]) for e in slices(doc)] == [
        ("all_gather a", "all_gather", 0, 3000),
        ("all_gather b", "all_gather #2", 1000, 3000),
        ("wait all_gather b", "compute", 2000, 2000),
        ("all_gather c", "all_gather", 3000, 2000),  # "a" has completed: back on the first lane
    ]
    assert t.summary()["all_gather"].exposed_ns == 2 * ms


def test_profiler_labels_each_collective_with_its_group():
    with fake_world(4, 0) as mesh:
        net = sharded(mesh)
        net(torch.randn(2, 8)).sum().backward()
        assert isinstance(trace_module.label("all_gather", "blocks.0"), contextlib.nullcontext)
        with torch.profiler.profile() as prof:
            net(torch.randn(2, 8)).sum().backward()
    counts = Counter(e.name for e in prof.events() if e.name.startswith("shardkit::"))
    assert {k: v for k, v in counts.items() if not k.startswith("shardkit::wait_")} == {
        "shardkit::all_gather <root>": 1, "shardkit::all_gather blocks.0": 2,
        "shardkit::all_gather blocks.1": 2, "shardkit::all_gather blocks.2": 2,
        "shardkit::reduce_scatter <root>": 1, "shardkit::reduce_scatter blocks.0": 1,
        "shardkit::reduce_scatter blocks.1": 1, "shardkit::reduce_scatter blocks.2": 1,
    }
    assert counts["shardkit::wait_all_gather blocks.0"] == 2 and counts["shardkit::wait_reduce_scatter <root>"] == 1


def test_trace_names_the_mesh_dimension_of_each_collective():
    with fake_world(4, 0):
        t = second_step(init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)))
    assert {e.mesh_dim for e in t.collectives()} == {"dp"}
    assert_expected_inline(t.format(kinds=("reduce_scatter",)), """\
reduce_scatter blocks.2 float32 numel=80 world=4 mesh=dp
reduce_scatter blocks.1 float32 numel=80 world=4 mesh=dp
reduce_scatter blocks.0 float32 numel=80 world=4 mesh=dp
reduce_scatter <root> float32 numel=124 world=4 mesh=dp""")
