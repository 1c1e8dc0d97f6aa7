"""Two nodes on one machine: two torchrun launchers of 2 gloo ranks each, joined by c10d
rendezvous as in docs/usage.md "Multi-node", run tests/examples/multinode_worker.py. Every
rank trains HSDP (shards within a node, replicas across) and FSDP with
``reshard_after_forward=<ranks per node>`` against a single-process reference."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NODES, PER_NODE = 2, 2
TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_launchers(out: Path) -> tuple[list[int], str]:
    """Start both launchers at once; their exit codes and output. When one fails, or at the
    deadline, the other is killed with its workers (a rank left alone would wait on its peers)."""
    port, job = free_port(), f"shardkit-multinode-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(PER_NODE),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job,
           str(ROOT / "tests" / "examples" / "multinode_worker.py"), str(out)]
    launchers, logs = [], []
    for n in range(NODES):
        logs.append(out / f"launcher{n}.log")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MULTINODE_LAUNCHER": str(n)}
        with logs[-1].open("w") as log:  # each launcher its own session: killpg takes its workers too
            launchers.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in launchers):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in launchers):
                break
            time.sleep(0.2)
    finally:
        for p in launchers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    output = "".join(f"--- launcher {n} (exit {p.returncode}):\n{log.read_text()[-4000:]}\n" for n, (p, log) in enumerate(zip(launchers, logs)))
    return [p.returncode for p in launchers], output


def test_two_launchers_as_two_nodes_train_hsdp_and_fsdp_like_one_process(tmp_path):
    codes, output = run_launchers(tmp_path)
    assert codes == [0] * NODES, output
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NODES * PER_NODE)]

    # c10d rendezvous numbers the nodes (not --node-rank, which only the static backend reads):
    # either launcher may be node 0, but each one's ranks are one node's, consecutive
    for launcher in map(str, range(NODES)):
        mine = [r for r in results if r["launcher"] == launcher]
        node = mine[0]["node"]
        assert [(r["rank"], r["node"], r["local_rank"]) for r in mine] == [(node * PER_NODE + i, node, i) for i in range(PER_NODE)], mine
        assert all(r["shard_ranks"] == [node * PER_NODE + i for i in range(PER_NODE)] for r in mine), mine  # shards within the node
    assert sorted(r["node"] for r in results) == [0, 0, 1, 1]

    # every rank saw the same losses (each already checked them, the gradients and the final
    # parameters against the reference at 1e-5), and the same collectives
    for r in results[1:]:
        assert r["models"] == results[0]["models"], (r["rank"], r["models"], results[0]["models"])
    hsdp, fsdp_r = results[0]["models"]["hsdp"], results[0]["models"]["fsdp_r"]
    assert len(hsdp["losses"]) == len(fsdp_r["losses"]) == 5
    # HSDP: gathers and reduce-scatters within a node (2 ranks), then an all-reduce across the nodes
    assert {(kind, world) for kind, _, world in hsdp["collectives"]} == {("all_gather", 2), ("reduce_scatter", 2), ("all_reduce", 2)}
    # 1-D over all 4 ranks with reshard_after_forward=2: the forward gathers span both nodes,
    # the backward ones (every group, the root too: it got the int as well) stay within a node
    gathers = [(group, world) for kind, group, world in fsdp_r["collectives"] if kind == "all_gather"]
    assert gathers == [("", 4), ("blocks.0", 4), ("blocks.1", 4), ("", 2), ("blocks.1", 2), ("blocks.0", 2)], gathers
    assert {world for kind, _, world in fsdp_r["collectives"] if kind == "reduce_scatter"} == {4}
