"""examples/train_2d.py runs on 4 gloo ranks (2 x 2: tensor parallel on "tp", shardkit on
"dp") and its loss falls: a smoke test of the documented 2-D recipe."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# With activation checkpointing: tp + fsdp alone is the same run without the recompute, and
# tests/gloo (test_composition.py, test_clip_four_ranks.py) train FSDP x TP against the reference.
@pytest.mark.parametrize("extra", [["--ac"]], ids=["tp+ac+fsdp"])
def test_train_2d_on_four_ranks_loss_falls(extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "train_2d.py"), "--steps", "6", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dp=2 tp=2" in done.stdout and "it fell" in done.stdout, done.stdout[-2000:]
    assert "_StridedShard(dim=0, sf=2), Shard(dim=0)" in done.stdout  # the placements it printed
