"""examples/train_3d_pp.py runs on 8 gloo ranks (pp 2 x dp 2 x tp 2: pipeline stages under
Schedule1F1B, shardkit on "dp", tensor parallel on "tp" inside the blocks), its loss falls, a
block weight is sharded over dp and tp, and torch's FSDP2 in shardkit's place (the same run,
--impl shardkit,fsdp2, one after the other in the same processes) gives the same loss curve."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def losses(stdout: str, impl: str) -> list[float]:
    found = re.findall(rf"^\[{impl}\] losses: (.*)$", stdout, re.MULTILINE)
    assert len(found) == 1, stdout[-2000:]
    return [float(v) for v in found[0].split()]


def test_train_3d_pp_on_eight_ranks_loss_falls_and_matches_fsdp2():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
           str(ROOT / "examples" / "train_3d_pp.py"), "--steps", "4", "--impl", "shardkit,fsdp2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout
    assert done.returncode == 0, out[-3000:] + done.stderr[-3000:]
    for impl in ("shardkit", "fsdp2"):
        assert f"[{impl}] pp=2 dp=2 tp=2" in out and f"[{impl}] pp=2 dp=2 tp=2: loss" in out, out[-2000:]
        assert re.search(rf"^\[{impl}\] pp=2 dp=2 tp=2: .*, it fell$", out, re.MULTILINE), out[-2000:]
        # a colwise weight: _StridedShard over dp (FSDP, on top of TP's shard), Shard(dim=0) over tp
        assert f"[{impl}] attention.wq.weight placements: (_StridedShard(dim=0, sf=2), Shard(dim=0))" in out, out[-2000:]
    ours, theirs = losses(out, "shardkit"), losses(out, "fsdp2")
    assert len(ours) == len(theirs) == 4
    assert ours[-1] < ours[0] - 0.5, ours  # it learns, not just drifts
    assert all(abs(a - b) <= 2e-4 for a, b in zip(ours, theirs)), (ours, theirs)  # printed with 4 decimals
