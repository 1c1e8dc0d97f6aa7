"""examples/torchft_train.py: 2 torchft replica groups x 2 gloo ranks, group 1 killed with
SIGKILL at step 4 and restarted; the survivors go on alone, the restarted group heals, no
committed step is lost, and the summary says so (tests/gloo/test_torchft.py checks the numbers)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="torchft is a test dependency (make venv installs it)")

ROOT = Path(__file__).resolve().parents[2]


def test_the_torchft_example_kills_restarts_and_loses_no_step():
    cmd = [sys.executable, str(ROOT / "examples" / "torchft_train.py"), "--steps", "8", "--kill-at", "4", "--step-sleep", "0.02"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = " ".join(done.stdout.split())
    assert "lost: 0" in out and "torchft + shardkit: replica groups" in out, out[-2000:]
    alone = re.search(r"then (\d+) steps alone", out)
    assert alone and int(alone.group(1)) >= 1, out[-2000:]
    assert "healed from a peer" in out, out[-2000:]
