"""Exact resume, resharding on load, and crash-safe saving, each run in fresh processes
(resume_worker.py), with shardkit.checkpoint (DCP underneath)."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("resume_worker.py")
TIMEOUT_S = 180  # one run


class ForkServer:
    """``resume_worker.py serve``: each run a fresh child forked from one process that imported
    torch and shardkit once (seconds per run saved), as ``python resume_worker.py ...`` would run."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.buffer = b""

    def run(self, argv: list[str], env: dict[str, str], log: Path) -> int:
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, str(WORKER), "serve"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                                         stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, bufsize=0)
            self.buffer = b""
        deadline = time.monotonic() + TIMEOUT_S
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n").encode())
            pid = self._answer(deadline)["pid"]
        except BaseException:
            self.close(kill=True)  # a server that does not start runs is no use: the next run starts another
            raise
        try:
            return self._answer(deadline)["returncode"]
        except TimeoutError:
            os.killpg(pid, signal.SIGKILL)  # the run and its ranks; the server answers and goes on
            try:
                self._answer(time.monotonic() + 30)
            except BaseException:
                self.close(kill=True)
            raise

    def _answer(self, deadline: float) -> dict:
        while b"\n" not in self.buffer:
            if not select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError(f"no answer from {WORKER.name} serve in time")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"{WORKER.name} serve exited ({self.proc.wait()})")
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


_server: ForkServer | None = None


@pytest.fixture(scope="module", autouse=True)
def fork_server():
    global _server
    _server = ForkServer()
    yield _server
    _server.close()
    _server = None


def run(tmp: Path, mode: str, world: int, ckpt: Path, dropout: float = 0.1) -> dict:
    out = tmp / f"{mode}-{world}-{ckpt.name}.json"
    log = tmp / f"{mode}-{world}-{ckpt.name}.log"
    returncode = _server.run([mode, str(world), str(ckpt), str(out)], {"DROPOUT": str(dropout)}, log)
    if not mode.startswith("crash"):
        assert returncode == 0, log.read_text()[-3000:]
    return json.loads(out.read_text()) if out.exists() else {"returncode": returncode}


@pytest.fixture(scope="module")
def with_dropout(tmp_path_factory):
    """10 steps straight; 5 steps and a save; a resume for the last 5 (dropout on: the RNG
    states must be restored too)."""
    tmp = tmp_path_factory.mktemp("dropout")
    return tmp, run(tmp, "straight", 2, tmp / "ck"), run(tmp, "save", 2, tmp / "ck"), run(tmp, "resume", 2, tmp / "ck")


@pytest.fixture(scope="module")
def without_dropout(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain")
    return tmp, run(tmp, "straight", 2, tmp / "ck", dropout=0), run(tmp, "save", 2, tmp / "ck", dropout=0)


def test_resume_on_the_same_ranks_is_bit_identical(with_dropout):
    _, straight, first, second = with_dropout
    assert second["step"] == 5
    assert second["loaded"] == first["saved"]  # exactly the saved parameters
    assert first["losses"] + second["losses"] == straight["losses"]  # bit for bit, dropout included
    assert second["params"] == straight["params"]


@pytest.mark.parametrize("world", [1, 4])
def test_save_at_2_load_at_other_world_sizes_continues(without_dropout, world):
    tmp, straight, first = without_dropout
    second = run(tmp, "resume", world, tmp / "ck", dropout=0)
    assert second["loaded"] == first["saved"]  # identical full parameters after resharding
    for mine, theirs in zip(second["losses"], straight["losses"][5:]):
        assert abs(mine - theirs) <= 1e-6, (second["losses"], straight["losses"][5:])


def test_a_save_killed_before_publishing_leaves_the_last_checkpoint_loadable(with_dropout):
    tmp_path, _, first, _ = with_dropout
    ck = tmp_path / "ck"
    crashed = run(tmp_path, "crash", 2, ck)
    assert crashed.get("returncode", 0) != 0  # the ranks died inside save
    assert (tmp_path / "ck.incomplete").is_dir() and (ck / "COMPLETE").is_file()
    resumed = run(tmp_path, "resume", 2, ck)
    assert resumed["loaded"] == first["saved"]
    refused = run(tmp_path, "refuse", 2, tmp_path / "ck.incomplete")
    assert "not a complete shardkit checkpoint" in refused["error"] and "interrupted" in refused["error"]


def test_an_async_save_lets_training_go_on_and_resumes_bit_identically(with_dropout):
    tmp, straight, first, _ = with_dropout
    ck = tmp / "ck_async"
    during = run(tmp, "save-async", 2, ck)
    assert during["losses"] == straight["losses"]  # the save did not disturb the steps after it
    assert during["saved"] == first["saved"]  # the state at step 5, as the synchronous save had it
    resumed = run(tmp, "resume", 2, ck)
    assert resumed["loaded"] == first["saved"]
    assert resumed["losses"] == straight["losses"][5:]


def test_an_async_save_killed_before_publishing_leaves_the_previous_checkpoint(with_dropout):
    tmp, _, first, _ = with_dropout
    ck = tmp / "ck_for_async_crash"
    run(tmp, "save", 2, ck)
    crashed = run(tmp, "crash-async", 2, ck)
    assert crashed.get("returncode", 0) != 0
    assert (tmp / "ck_for_async_crash.incomplete").is_dir() and (ck / "COMPLETE").is_file()
    assert run(tmp, "resume", 2, ck)["loaded"] == first["saved"]


def test_a_flipped_bit_in_another_ranks_file_stops_every_rank(with_dropout, tmp_path):
    tmp, _, _, _ = with_dropout
    ck = tmp_path / "flipped"
    shutil.copytree(tmp / "ck", ck)
    data = bytearray((ck / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x10
    (ck / "__1_0.distcp").write_bytes(bytes(data))
    refused = run(tmp_path, "refuse", 2, ck)
    assert refused["error"].startswith(f"CorruptCheckpointError: {ck} (rank 0): __1_0.distcp is damaged"), refused
