"""torchft with shardkit, measured (make bench ARGS=--ft): what a death costs and what torchft
costs, as ratios, each round one job of each kind (examples/torchft_train.py runs them).

- step with torchft / without: one replica group of 2 gloo ranks under torchft (quorum, commit
  RPC, the gradient average through the manager over a group of one) against the same 2 ranks
  with plain shardkit; the median step at full strength of each job, paired per round.
- a death (2 groups x 2 ranks, group 1 killed with SIGKILL after a commit, restarted 1 s later):
  the survivors' stall from the kill to their next committed step, over the lighthouse's
  heartbeat timeout (the time any torchft job needs to notice a dead group: the floor); the
  restarted group's time from its start to its first committed step, over a group's cold start
  (its start to its first commit in the job without a death); the committed steps lost (0).

    python benchmarks/ft_bench.py [--rounds 3] [--steps 24] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import torchft_train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=1000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    common = ["--steps", str(args.steps), "--quiet", "--step-sleep", "0", "--heartbeat-timeout-ms", str(args.heartbeat_timeout_ms)]
    rows = []
    for r in range(args.rounds):
        plain = torchft_train.launch(torchft_train.parse_args(common + ["--no-ft"]))
        alone = torchft_train.launch(torchft_train.parse_args(common + ["--groups", "1"]))
        death = torchft_train.launch(torchft_train.parse_args(common + ["--groups", "2"]))
        row = dict(step_ft_over_plain=alone.step_s / plain.step_s, stall_over_heartbeat=death.stall_s / (args.heartbeat_timeout_ms / 1e3),
                   heal_over_cold_start=death.heal_s / alone.start_s, lost=death.lost, alone_steps=death.alone_steps,
                   stall_s=death.stall_s, heal_s=death.heal_s, cold_start_s=alone.start_s, step_ft_ms=alone.step_s * 1e3,
                   step_plain_ms=plain.step_s * 1e3)
        rows.append(row)
        print(f"round {r}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    summary = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    print("median: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rows, "median": summary}, indent=1))
    return 0 if all(row["lost"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
