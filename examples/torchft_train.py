"""Train a small GPT under torchft on CPU: replica groups that die and heal while the others go on.

    python examples/torchft_train.py                   # 2 groups x 2 gloo ranks; group 1 killed at step 8, restarted
    python examples/torchft_train.py --no-kill --steps 20
    python examples/torchft_train.py --groups 1        # one group: the cost of torchft itself

This script is the launcher and, with ``--worker``, one rank of a group. The launcher starts a
torchft lighthouse in this process and each group's ranks as processes (each group its own gloo
world; ``shardkit.fully_shard`` shards the GPT over the group's ranks; ``shardkit.ft`` averages
the groups' gradients through torchft's manager). At ``--kill-at`` it kills every rank of group
1 with SIGKILL, as a failing host does, and starts the group again ``--restart-after`` seconds
later: the survivors stall until the lighthouse drops the dead group (its heartbeat timeout),
then step alone; the restarted group heals from a live peer's state and rejoins. A live table
shows each group's step, the participants in its quorum and its loss; the summary measures the
survivors' stall, the heal time and the steps lost (committed ones: none).

Needs torchft (``make venv`` installs it as a test dependency; ``pip install --no-deps
torchft==0.2.0`` and the opentelemetry packages of the Makefile's FT_DEPS elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

RANKS = 2  # per replica group


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=2, help="replica groups (each of 2 gloo ranks)")
    parser.add_argument("--steps", type=int, default=24, help="committed steps to train (survivors go on until a restarted group is back)")
    parser.add_argument("--kill-at", type=int, default=8, help="kill group 1 once it has committed this step")
    parser.add_argument("--no-kill", action="store_true", help="kill nothing")
    parser.add_argument("--restart-after", type=float, default=1.0, help="seconds between the kill and the restart")
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000, help="the lighthouse drops a silent group after this")
    parser.add_argument("--step-sleep", type=float, default=0.05, help="seconds each step also waits (a bigger model's compute)")
    parser.add_argument("--no-ft", action="store_true", help="one group, plain shardkit, no torchft (the baseline of the bench)")
    parser.add_argument("--quiet", action="store_true", help="no live table")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# One rank ------------------------------------------------------------------------------------
def worker(settings: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shardkit
    from shardkit.models import GPT, GPTConfig, apply_fully_shard

    group, rank = settings["group"], settings["rank"]
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(settings["port"]), RANK=str(rank), WORLD_SIZE=str(RANKS))
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    torch.manual_seed(0)
    model = apply_fully_shard(GPT(GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=64)), shardkit.fully_shard,
                              mesh=init_device_mesh("cpu", (RANKS,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    manager = None
    if settings["ft"]:
        from torchft import Manager, ProcessGroupGloo

        import shardkit.ft

        manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1, load_state_dict=None, state_dict=None,
                          replica_id=f"group_{group}", store_addr="localhost", store_port=settings["port"], rank=rank, world_size=RANKS,
                          lighthouse_addr=settings["lighthouse"], timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60))
        ft = shardkit.ft.fault_tolerant(model, manager, optimizer)
        optimizer = ft.optimizer
        _start_together(Path(settings["ready"]), f"{group}-{rank}", settings["ranks"])
    status = open(settings["status"], "a")
    step, deadline = 0, time.monotonic() + 300
    # Until the steps are done with every group in the quorum: survivors wait for a restarted group.
    while time.monotonic() < deadline:
        started = time.perf_counter()
        optimizer.zero_grad()  # under torchft: starts the step's quorum
        if manager is not None:
            step = manager.current_step()
        g = torch.Generator().manual_seed(1000 * step + 10 * group + rank)
        x = torch.randint(0, 32, (4, 32), generator=g)  # next token = this token + 1
        _, loss = model(x, (x + 1) % 32)
        loss.backward()
        participants = manager.num_participants() if manager is not None else 1
        healing = manager is not None and not manager.is_participating()
        optimizer.step()  # under torchft: only if every group in the quorum commits
        committed = manager is None or manager.current_step() == step + 1
        step += committed
        print(json.dumps(dict(time=time.time(), step=step, committed=committed, participants=participants, healing=healing,
                              loss=loss.item(), step_s=time.perf_counter() - started)), file=status, flush=True)
        done = torch.tensor([committed and step >= settings["steps"] and participants == settings["groups"]], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)  # the group's ranks stop together (each asks its own quorum)
        if done.item():
            break
        time.sleep(settings["sleep_s"])
    if manager is not None:
        manager.shutdown(wait=False)
    dist.destroy_process_group()
    os._exit(0)  # (torchft's threads need not be joined)


def _start_together(folder: Path, me: str, everyone: int) -> None:
    """Wait until every rank of every group has its manager (heartbeating to the lighthouse):
    the first quorum then holds every group. (A lighthouse that has heard of one group only
    gives it a quorum of its own, and a group that starts later would train apart from it.) A
    restarted group finds everyone there and joins the running quorum, healing."""
    (folder / me).touch()
    deadline = time.monotonic() + 60
    while len(list(folder.iterdir())) < everyone and time.monotonic() < deadline:
        time.sleep(0.02)


# The launcher --------------------------------------------------------------------------------
@dataclass
class Group:
    index: int
    procs: list[subprocess.Popen] = field(default_factory=list)
    started: float = 0.0  # this incarnation's start
    first_started: float = 0.0
    status: Path | None = None
    records: list[dict] = field(default_factory=list)
    read: int = 0  # bytes of ``status`` read so far

    def poll(self) -> None:
        if self.status is not None and self.status.exists():
            text = self.status.read_text()
            for line in text[self.read:].splitlines(keepends=True):
                if line.endswith("\n"):
                    self.records.append(json.loads(line))
                    self.read += len(line)

    @property
    def step(self) -> int:
        return self.records[-1]["step"] if self.records else 0


@dataclass
class Report:
    """What one job measured: seconds and steps."""

    steps: int = 0  # the committed steps the job reached
    lost: int = 0  # committed steps some group did not end up with
    stall_s: float | None = None  # the survivors: from the kill to their next committed step
    heal_s: float | None = None  # the restarted group: from its start to its first committed step
    alone_steps: int = 0  # survivors' commits with one participant
    step_s: float = 0.0  # median step time of group 0 at full strength, in steady state
    start_s: float | None = None  # group 0: from its start to its first committed step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, console=None) -> Report:
    """Run one job as ``args`` says; return what it measured."""
    lighthouse = None
    if not args.no_ft:
        os.environ.setdefault("RUST_LOG", "warn")  # (the lighthouse logs every quorum at info)
        from torchft.coordination import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=10000, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    tmp = Path(tempfile.mkdtemp(prefix="shardkit-torchft-"))
    (tmp / "ready").mkdir()
    groups = [Group(g) for g in range(1 if args.no_ft else args.groups)]
    incarnation = [0]

    def start(group: Group) -> None:
        port, group.status, group.read, group.records = free_port(), tmp / f"group{group.index}-{incarnation[0]}.jsonl", 0, []
        incarnation[0] += 1
        group.started, group.procs = time.time(), []
        group.first_started = group.first_started or group.started
        for rank in range(RANKS):
            settings = dict(group=group.index, rank=rank, port=port, lighthouse=lighthouse.address() if lighthouse else "",
                            ready=str(tmp / "ready"), ranks=len(groups) * RANKS, groups=len(groups),
                            ft=not args.no_ft, steps=args.steps, sleep_s=args.step_sleep, status=str(group.status if rank == 0 else tmp / f"rank{rank}.jsonl"))
            log = open(tmp / f"group{group.index}-rank{rank}.log", "a")
            env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error")
            group.procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(settings)], stdout=log, stderr=log, env=env))

    report, killed_at, restart_at, survivors_before = Report(), None, None, 0
    history: list[dict] = []  # group 0's records before the kill, for the step time
    try:
        for group in groups:
            start(group)
        with _display(console, groups, args) as refresh:
            while True:
                for group in groups:
                    group.poll()
                    for p in group.procs:
                        if p.poll() not in (None, 0) and killed_at is None or p.poll() not in (None, 0, -signal.SIGKILL):
                            raise RuntimeError(f"group {group.index} failed (exit {p.poll()}); logs in {tmp}")
                refresh()
                if all(p.poll() == 0 for g in groups for p in g.procs):
                    break
                victim = groups[1] if len(groups) > 1 and not args.no_kill else None
                if victim is not None and killed_at is None and victim.step >= args.kill_at:
                    history = list(groups[0].records)
                    for p in victim.procs:
                        p.send_signal(signal.SIGKILL)
                    killed_at, restart_at = time.time(), time.time() + args.restart_after
                    survivors_before = groups[0].step
                if restart_at is not None and time.time() >= restart_at:
                    for p in victim.procs:
                        p.wait()
                    start(victim)
                    restart_at = None
                time.sleep(0.05)
    finally:
        for group in groups:
            for p in group.procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        if lighthouse is not None:
            lighthouse.shutdown()
    return _measure(report, groups, history or groups[0].records, killed_at, survivors_before, args, tmp)


def _measure(report: Report, groups: list[Group], history: list[dict], killed_at, survivors_before: int, args, tmp: Path) -> Report:
    import shutil
    import statistics

    ends = [g.step for g in groups]
    report.steps, report.lost = max(ends), max(ends) - min(ends)
    full = [r["step_s"] for r in history[3:] if r["committed"] and r["participants"] == len(groups)]
    report.step_s = statistics.median(full) if full else float("nan")
    report.start_s = next((r["time"] - groups[0].first_started for r in history if r["committed"]), None)
    if killed_at is not None:
        after = [r for r in groups[0].records if r["time"] > killed_at and r["committed"] and r["step"] > survivors_before]
        report.stall_s = after[0]["time"] - killed_at if after else None
        report.alone_steps = sum(r["participants"] == 1 for r in after)
        first = [r for r in groups[1].records if r["committed"]]
        report.heal_s = first[0]["time"] - groups[1].started if first else None
    shutil.rmtree(tmp, ignore_errors=True)
    return report


class _display:
    """A live table of the groups (rich), or nothing with --quiet."""

    def __init__(self, console, groups: list[Group], args) -> None:
        self.console, self.groups, self.args, self.live = console, groups, args, None

    def _table(self):
        from rich.table import Table

        table = Table(title="torchft + shardkit: replica groups")
        for column in ("group", "step", "participants", "state", "loss"):
            table.add_column(column, justify="right")
        for g in self.groups:
            alive = g.procs and all(p.poll() in (None, 0) for p in g.procs)
            last = g.records[-1] if g.records else None
            state = "dead" if not alive else "healing" if last and last["healing"] else "done" if all(p.poll() == 0 for p in g.procs) else "training"
            table.add_row(str(g.index), str(g.step), str(last["participants"]) if last else "-", state,
                          f"{last['loss']:.3f}" if last else "-")
        return table

    def __enter__(self):
        if self.console is not None and not self.args.quiet:
            from rich.live import Live

            self.live = Live(self._table(), console=self.console, refresh_per_second=8)
            self.live.__enter__()
        return lambda: self.live.update(self._table()) if self.live is not None else None

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)


def main() -> int:
    args = parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    from rich.console import Console

    console = Console()
    report = launch(args, console)
    console.print()
    console.print(f"committed steps: {report.steps}; lost: {report.lost}; step at full strength: {report.step_s * 1e3:.1f} ms")
    if report.stall_s is not None:
        console.print(f"survivors: stalled {report.stall_s:.2f} s after the kill, then {report.alone_steps} steps alone; "
                      f"the restarted group committed {report.heal_s:.2f} s after its start (healed from a peer)")
    return 0 if report.lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
