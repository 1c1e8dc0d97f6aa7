"""demo/train.py (make demo) on 2 gloo ranks, briefly: its report, and the timeline of its
last 3 steps that rank 0 writes for Perfetto; and with --optim muon."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_demo(timeline: Path, *flags: str) -> tuple[str, Counter]:
    """5 steps of a 2-layer GPT: rank 0's output, and the timeline's slices per (rank, category)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "demo" / "train.py"), "--steps", "5", "--n-layer", "2", "--timeline", str(timeline), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "waited on" in done.stdout and "the loss fell" in done.stdout, done.stdout[-2000:]
    assert f"timeline of the last 3 steps: {timeline} (open at https://ui.perfetto.dev)" in done.stdout, done.stdout[-2000:]
    doc = json.loads(timeline.read_text())
    return done.stdout, Counter((e["pid"], e["cat"]) for e in doc["traceEvents"] if e["ph"] == "X")


def test_demo_reports_and_writes_a_timeline_of_its_last_three_steps(tmp_path):
    _, slices = run_demo(tmp_path / "timeline.json")
    for rank in (0, 1):  # per step: the root and 2 blocks forward, the 2 blocks again in backward;
        # one reduce-scatter and a forward and a backward slice per group
        assert (slices[rank, "all_gather"], slices[rank, "reduce_scatter"], slices[rank, "phase"]) == (3 * 5, 3 * 3, 3 * 6)


def test_demo_with_muon_steps_the_block_matrices_with_two_all_to_alls_per_step(tmp_path):
    out, slices = run_demo(tmp_path / "timeline.json", "--optim", "muon")
    # 2 blocks x (qkv, attention proj, fc, mlp proj) weights; AdamW: embeddings (the tied head), norms, biases
    assert "optimizers: Muon (8 parameters, lr 0.02) + AdamW (20 parameters, lr 0.003)" in out, out[-2000:]
    for rank in (0, 1):  # Muon's in and out, per step; the model's collectives as with AdamW
        assert (slices[rank, "all_to_all"], slices[rank, "all_gather"], slices[rank, "reduce_scatter"]) == (3 * 2, 3 * 5, 3 * 3)
