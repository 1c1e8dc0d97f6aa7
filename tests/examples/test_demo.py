"""demo/train.py (make demo) on 2 gloo ranks, briefly: its report, the timeline of its last 3
steps that rank 0 writes for Perfetto, its clipped gradients and the weights it writes with
--save-pretrained; and with --optim muon, starting from those weights (--pretrained)."""

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The plain demo, once for the module: its output, timeline slices and saved weights."""
    folder = tmp_path_factory.mktemp("demo")
    out, slices = run_demo(folder / "timeline.json", "--save-pretrained", str(folder / "weights"))
    return out, slices, folder / "weights"


def step1_loss(out: str) -> float:
    return float(re.search(r"mean loss over ranks: step 1 ([\d.]+);", out).group(1))


def test_demo_reports_and_writes_a_timeline_of_its_last_three_steps(first_run):
    out, slices, _ = first_run
    for rank in (0, 1):  # per step: the root and 2 blocks forward, the 2 blocks again in backward;
        # one reduce-scatter and a forward and a backward slice per group
        assert (slices[rank, "all_gather"], slices[rank, "reduce_scatter"], slices[rank, "phase"]) == (3 * 5, 3 * 3, 3 * 6)


def test_demo_clips_its_gradients_and_writes_its_weights_for_transformers_layout(first_run):
    out, _, weights = first_run
    assert re.search(r"gradient norm: [\d.]+ at the first step, [\d.]+ at the last; clipped to 1 in \d of 5 steps", out), out[-2000:]
    index = json.loads((weights / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert "tok_emb.weight" in index["weight_map"] and "head.weight" not in index["weight_map"]  # tied: once


def test_demo_with_muon_from_pretrained_steps_the_block_matrices_with_two_all_to_alls_per_step(first_run, tmp_path):
    first_out, _, weights = first_run
    out, slices = run_demo(tmp_path / "timeline.json", "--optim", "muon", "--pretrained", str(weights))
    assert f"weights from {weights}: each rank read only its rows" in out, out[-2000:]
    # it starts from the first run's weights, not a fresh init (whose first loss is ln 65 = 4.17;
    # 5 AdamW steps leave the first batch's loss anywhere: the weights' bits are checked in
    # tests/gloo/test_pretrained.py)
    assert abs(step1_loss(out) - step1_loss(first_out)) > 0.1, out[-2000:]
    # 2 blocks x (qkv, attention proj, fc, mlp proj) weights; AdamW: embeddings (the tied head), norms, biases
    assert "optimizers: Muon (8 parameters, lr 0.02) + AdamW (20 parameters, lr 0.003)" in out, out[-2000:]
    for rank in (0, 1):  # Muon's in and out, per step; the model's collectives as with AdamW
        assert (slices[rank, "all_to_all"], slices[rank, "all_gather"], slices[rank, "reduce_scatter"]) == (3 * 2, 3 * 5, 3 * 3)
