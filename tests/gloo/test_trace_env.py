"""SHARDKIT_TRACE=<folder> on 2 real gloo ranks under torchrun: each rank writes its trace at
exit, and ``python -m shardkit timeline <folder>`` merges them into one Perfetto file."""

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("trace_env_worker.py")
GROUPS = {"<root>", "1", "2", "3"}  # the worker's Sequential: blocks 1..3, then the root


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory) -> Path:
    """One 2-rank run of the worker (2 steps), traced into a fresh folder."""
    folder = tmp_path_factory.mktemp("trace") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SHARDKIT_TRACE": str(folder)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return folder


def test_shardkit_trace_env_writes_each_ranks_text_and_json(traced_run):
    assert sorted(p.name for p in traced_run.iterdir()) == ["rank0.json", "rank0.txt", "rank1.json", "rank1.txt"]
    for rank in (0, 1):
        doc = json.loads((traced_run / f"rank{rank}.json").read_text())
        names = [(e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "process_name"]
        assert names == [(rank, f"rank {rank}")]  # the rank from torchrun, not the one at import
        lines = (traced_run / f"rank{rank}.txt").read_text().splitlines()
        collectives = Counter(re.search(r" ms  (\w+) ", line)[1] for line in lines if " mesh=dp" in line)
        # 2 steps; step 1: the root and 3 blocks forward, 3 blocks again in backward; then one
        # reduce-scatter per group (run as an all-to-all on gloo)
        assert collectives == {"all_gather": 14, "reduce_scatter": 8}, lines
        assert all(re.search(r"\(in flight [\d.]+ ms, waited [\d.]+ ms\)$", line) for line in lines if " mesh=dp" in line)


def test_python_m_shardkit_timeline_merges_both_ranks(traced_run):
    # SHARDKIT_TRACE still set (exported in the shell): this process traces nothing, so it
    # must not overwrite rank 0's files at exit.
    rank0 = (traced_run / "rank0.txt").read_text()
    done = subprocess.run([sys.executable, "-m", "shardkit", "timeline", str(traced_run)], cwd=ROOT,
                          env={**os.environ, "SHARDKIT_TRACE": str(traced_run)}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (traced_run / "rank0.txt").read_text() == rank0
    out = traced_run / "timeline.json"
    assert f"wrote {out}" in done.stdout
    doc = json.loads(out.read_text())
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}
    for rank in (0, 1):
        slices = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == rank]
        kinds = Counter(e["cat"] for e in slices)
        text = (traced_run / f"rank{rank}.txt").read_text()
        assert kinds["all_gather"] == len(re.findall(r" ms  all_gather ", text)) == 14
        assert kinds["reduce_scatter"] == 8 and kinds["phase"] == 2 * 2 * len(GROUPS)
        assert {e["args"]["group"] for e in slices if e["cat"] == "all_gather"} == GROUPS
        assert all(e["args"]["note"] == "via all_to_all" for e in slices if e["cat"] == "reduce_scatter")
        assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in slices)
