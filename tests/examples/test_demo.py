"""demo/train.py (make demo) on 2 gloo ranks, briefly: its report, and the timeline of its
last 3 steps that rank 0 writes for Perfetto."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_reports_and_writes_a_timeline_of_its_last_three_steps(tmp_path):
    path = tmp_path / "timeline.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "demo" / "train.py"), "--steps", "5", "--n-layer", "2", "--timeline", str(path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "waited on" in done.stdout and "the loss fell" in done.stdout, done.stdout[-2000:]
    assert f"timeline of the last 3 steps: {path} (open at https://ui.perfetto.dev)" in done.stdout, done.stdout[-2000:]
    doc = json.loads(path.read_text())
    slices = Counter((e["pid"], e["cat"]) for e in doc["traceEvents"] if e["ph"] == "X")
    for rank in (0, 1):  # per step: the root and 2 blocks forward, the 2 blocks again in backward;
        # one reduce-scatter and a forward and a backward slice per group
        assert (slices[rank, "all_gather"], slices[rank, "reduce_scatter"], slices[rank, "phase"]) == (3 * 5, 3 * 3, 3 * 6)
