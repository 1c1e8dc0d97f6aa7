"""torchft drives shardkit's replica groups as it drives FSDP2: 2 replica groups x 2 gloo ranks,
an in-process lighthouse, a group killed after a commit or inside its all-reduce hook, then
restarted, healing from its peer (``ft_worker.py`` is one rank).

After each run: every committed step 0..n-1 is in the survivors' log (none lost), both
groups end at the same step with bitwise equal shards, and the shards equal an unsharded
replay of the log (each committed step's gradient the mean over the groups that took part).
A healthy run is also run with torch's FSDP2, whose shards must be shardkit's.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is a test dependency (make venv installs it)")

from ft_worker import DIED, GROUP_WORLD, LR, batch, loss_of, model  # noqa: E402

HERE = Path(__file__).resolve().parent
REPLICAS = 2
STEPS = 6
RUN_TIMEOUT_S = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class Run:
    """One job: the lighthouse, and REPLICAS groups of GROUP_WORLD worker processes; a group
    whose ranks exit with DIED (or fail because a peer did) is started again (with no death), as
    a scheduler restarts it."""

    def __init__(self, tmp: Path, impl: str, die: str | None = None, die_at: int = 2, mesh: str = "group") -> None:
        from torchft.coordination import LighthouseServer

        self.tmp, self.impl, self.die, self.die_at, self.mesh = tmp, impl, die, die_at, mesh
        # A healthy run waits for every group at each quorum, and starts without init_sync's heal at
        # step 0 (whose state_dict read from torchft's thread FSDP2 does not survive: "setStorage"
        # in backward, about 1 run in 2); with a death the survivors go on alone.
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=REPLICAS if die is None else 1,
                                           join_timeout_ms=10000, heartbeat_timeout_ms=1000)
        (tmp / "ready").mkdir(parents=True, exist_ok=True)
        self.procs: dict[int, list[subprocess.Popen]] = {}
        self.log_files: dict[int, list[Path]] = {}
        self.restarts = 0

    def start(self, replica: int, die: str | None) -> None:
        port = free_port()
        self.procs[replica], self.log_files[replica] = [], []
        for rank in range(GROUP_WORLD):
            settings = dict(replica=replica, rank=rank, port=port, lighthouse=self.lighthouse.address(), impl=self.impl,
                            die=die if replica == 1 else None, die_at=self.die_at, steps=STEPS, replicas=REPLICAS,
                            init_sync=self.die is not None, sleep_s=0.02, mesh=self.mesh, timeout_s=RUN_TIMEOUT_S - 30, out=str(self.out(replica, rank)),
                            log=str(self.tmp / f"steps-replica{replica}-rank{rank}-{self.restarts}.jsonl"), ready=str(self.tmp / "ready"))
            self.log_files[replica].append(self.tmp / f"replica{replica}-rank{rank}-{self.restarts}.log")
            log = open(self.log_files[replica][-1], "w")
            self.procs[replica].append(subprocess.Popen([sys.executable, str(HERE / "ft_worker.py"), json.dumps(settings)],
                                                        stdout=log, stderr=subprocess.STDOUT, cwd=HERE))

    def died_of_its_peer(self, replica: int, codes: list[int | None]) -> bool:
        """Whether the ranks of ``replica`` that failed did so because a rank of their group died
        on purpose under them (a collective it had joined, still in flight, lost its peer), as a
        scheduler would see it: the group is restarted whole."""
        if DIED not in codes:
            return False
        logs = [f.read_text() for f, code in zip(self.log_files[replica], codes) if code not in (None, 0, DIED)]
        return all("Connection closed by peer" in log or "Connection reset by peer" in log for log in logs)

    def out(self, replica: int, rank: int) -> Path:
        return self.tmp / f"replica{replica}-rank{rank}.pt"

    def run(self) -> dict[tuple[int, int], dict]:
        try:
            for replica in range(REPLICAS):
                self.start(replica, self.die)
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while time.monotonic() < deadline:
                codes = {g: [p.poll() for p in ps] for g, ps in self.procs.items()}
                if all(c == 0 for cs in codes.values() for c in cs):
                    break
                for g, cs in codes.items():
                    if any(c not in (None, 0, DIED) for c in cs) and not self.died_of_its_peer(g, cs):
                        raise AssertionError(f"replica {g} failed: exit codes {cs}\n{self.logs()}")
                    if None not in cs and DIED in cs:  # the whole group is down: restart it
                        self.restarts += 1
                        self.start(g, None)
                time.sleep(0.05)
            else:
                raise AssertionError(f"the job did not end in {RUN_TIMEOUT_S} s\n{self.logs()}")
        finally:
            for ps in self.procs.values():
                for p in ps:
                    if p.poll() is None:
                        p.kill()
                    p.wait()
            self.lighthouse.shutdown()
        return {(g, r): torch.load(self.out(g, r), weights_only=False) for g in range(REPLICAS) for r in range(GROUP_WORLD)}

    def logs(self) -> str:
        return "\n".join(f"--- {f.name} ---\n{f.read_text()[-3000:]}" for f in sorted(self.tmp.glob("*.log")))


def full_params(results: dict, replica: int) -> dict[str, torch.Tensor]:
    shards = [results[replica, r]["shards"] for r in range(GROUP_WORLD)]
    return {n: torch.cat([s[n] for s in shards]) for n in shards[0]}


def steps_taken(tmp: Path) -> list[tuple[int, dict[int, set[int]]]]:
    """For each committed step, its participant count and, per rank position, the groups whose
    gradients its all-reduce summed: from every rank's log, a dead one's too. (torchft decides
    participation per rank: a rank that is healing, at the first step too, adds zeros.)"""
    steps: dict[int, tuple[int, dict[int, set[int]]]] = {}
    for f in tmp.glob("steps-*.jsonl"):
        replica, rank = (int(part.removeprefix("replica").removeprefix("rank")) for part in f.stem.split("-")[1:3])
        for line in f.read_text().splitlines():
            step, n, participating, committed = json.loads(line)
            if committed:
                count, who = steps.setdefault(step, (n, {r: set() for r in range(GROUP_WORLD)}))
                assert count == n, (step, count, n)
                if participating:
                    who[rank].add(replica)
    return [steps[s] for s in sorted(steps)]


def replay(steps: list[tuple[int, dict[int, set[int]]]]) -> dict[str, torch.Tensor]:
    """An unsharded model through the committed steps, as the groups took them: each group's
    gradient the mean over its ranks; rank position r's rows (its shard) the sum over the groups
    that took part at r, divided by the step's participant count; SGD."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    for step, (count, who) in enumerate(steps):
        per_group = []
        for g in range(REPLICAS):
            for r in range(GROUP_WORLD):
                (loss_of(net, batch(step, g, r)) / GROUP_WORLD).backward()
            per_group.append({n: p.grad.clone() for n, p in net.named_parameters()})
            net.zero_grad()
        for n, p in net.named_parameters():
            rows = [torch.chunk(per_group[g][n], GROUP_WORLD) for g in range(REPLICAS)]  # FSDP's Shard(0)
            parts = [sum((rows[g][r] for g in sorted(who[r])), torch.zeros_like(rows[0][r])) / count for r in range(len(rows[0]))]
            p.grad = torch.cat(parts)
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in net.named_parameters()}


def check_run(run: Run, results: dict) -> list[tuple[int, dict[int, set[int]]]]:
    """The checks of every run (the module's docstring); the committed steps as torchft took them."""
    final = {results[k]["step"] for k in results}
    assert len(final) == 1, final  # every rank of every group ends at the same step
    steps = steps_taken(run.tmp)
    assert len(steps) == final.pop(), steps  # every committed step 0..n-1 is there: none lost
    for r in range(GROUP_WORLD):
        for name, shard in results[0, r]["shards"].items():
            assert torch.equal(shard, results[1, r]["shards"][name]), (r, name)  # the groups agree bitwise
    want = replay(steps)
    for name, value in full_params(results, 0).items():
        torch.testing.assert_close(value, want[name], msg=lambda m: f"{name} against the replay of {steps}: {m}")
    return steps


def test_a_healthy_job_trains_as_the_unsharded_replay_and_bitwise_as_fsdp2(tmp_path):
    runs = {}
    for impl in ("shardkit", "torch"):
        (tmp_path / impl).mkdir()
        runs[impl] = Run(tmp_path / impl, impl)
        results = runs[impl].run()
        steps = check_run(runs[impl], results)
        assert [count for count, _ in steps] == [REPLICAS] * STEPS, steps
        runs[impl].results = results
    for k, theirs in runs["torch"].results.items():
        for name, shard in theirs["shards"].items():
            assert torch.equal(runs["shardkit"].results[k]["shards"][name], shard), (k, name)


def test_torchfts_managed_group_as_the_replicate_dim_trains_as_the_replay_and_as_fsdp2(tmp_path):
    """HSDP (replicate, shard) whose replicate dim is torchft's ManagedProcessGroup: its size is
    the participants, read at each reduction; no hook."""
    runs = {}
    for impl in ("shardkit", "torch"):
        (tmp_path / impl).mkdir()
        runs[impl] = Run(tmp_path / impl, impl, mesh="managed")
        runs[impl].results = runs[impl].run()
        check_run(runs[impl], runs[impl].results)
    for k, theirs in runs["torch"].results.items():  # (FSDP2 averages in the collectives, shardkit sums then divides)
        for name, shard in theirs["shards"].items():
            torch.testing.assert_close(runs["shardkit"].results[k]["shards"][name], shard, msg=lambda m: f"{k} {name}: {m}")


@pytest.mark.parametrize("mesh,die", [("group", "after_commit"), ("group", "in_hook"), ("managed", "after_commit")])
def test_a_group_killed_and_restarted_heals_and_nothing_is_lost(tmp_path, mesh, die):
    run = Run(tmp_path, "shardkit", die=die, mesh=mesh)
    results = run.run()
    assert run.restarts == 1, run.restarts
    counts = [count for count, _ in check_run(run, results)]
    assert 1 in counts, counts  # the survivors went on without the dead group for a while
    assert counts[-1] == REPLICAS, counts  # ... and with it again once it healed
