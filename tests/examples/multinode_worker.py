"""One rank of tests/examples/test_multinode.py: two torchrun launchers on this machine play
two nodes of 2 gloo ranks each, joined by c10d rendezvous.

Two models, each the demo GPT trained 5 AdamW steps side by side with its single-process
reference on the whole global batch (tests/gloo/gloo_parity.py: losses and gradients
compared every step, parameters at the end, at 1e-5):

- "hsdp": a (replicate, shard) = (nodes, ranks per node) mesh: shards within a node,
  replicas across nodes.
- "fsdp_r": a 1-D mesh over all ranks with ``reshard_after_forward=<ranks per node>``: the
  forward all-gathers span the nodes, the backward ones stay within a node.

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT --rdzv-id JOB tests/examples/multinode_worker.py OUT_DIR

Each rank writes OUT_DIR/rank<R>.json: where torchrun put it, the process groups it ended up
in, and per model the losses and the collectives of one step.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import shardkit
from shardkit.models import apply_fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gloo"))
from gloo_parity import Parity, gpt_batches, gpt_loss, small_gpt

STEPS = 5
SEQS_PER_RANK = 2


def ranks_of(mesh: DeviceMesh, dim: str) -> list[int]:
    return dist.get_process_group_ranks(mesh.get_group(dim))


def train(shard, world: DeviceMesh) -> dict:
    p = Parity.build(small_gpt, shard, world, "shardkit", loss_of=gpt_loss)
    batches = gpt_batches(STEPS, size=SEQS_PER_RANK * world.size(), seed=1)  # each rank: its chunk
    with shardkit.trace() as t:
        passes = p.train(batches[:1])  # asserts the loss and the gradients
    passes += p.train(batches[1:])
    p.assert_params_match()
    return {
        "losses": [s.loss.item() for s in passes],  # mean over all ranks
        "ref_losses": [s.ref_loss.item() for s in passes],
        # the first step's collectives, in order: (kind, group, ranks taking part)
        "collectives": [(e.kind, e.group, e.world) for e in t.collectives()],
    }


def main(out: Path) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    node, local_rank = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = world_size // per_node
    # torchrun numbers ranks node by node: a node's ranks are consecutive
    assert rank == node * per_node + local_rank, (rank, node, local_rank)

    world = init_device_mesh("cpu", (world_size,))
    hsdp = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    shard_ranks, replicate_ranks = ranks_of(hsdp, "shard"), ranks_of(hsdp, "replicate")
    this_node = [node * per_node + i for i in range(per_node)]
    assert shard_ranks == this_node, (shard_ranks, this_node)  # shards within a node
    assert replicate_ranks == [n * per_node + local_rank for n in range(nodes)], replicate_ranks

    models = {
        "hsdp": train(lambda m: apply_fully_shard(m, shardkit.fully_shard, mesh=hsdp), world),
        "fsdp_r": train(lambda m: apply_fully_shard(m, shardkit.fully_shard, mesh=world, reshard_after_forward=per_node), world),
    }
    result = {
        "rank": rank, "node": node, "local_rank": local_rank, "launcher": os.environ.get("MULTINODE_LAUNCHER"),
        "shard_ranks": shard_ranks, "replicate_ranks": replicate_ranks, "models": models,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # As demo/train.py: the meshes (and the trained models' hook cycles, until the garbage
    # collector runs) hold the process groups; left to interpreter exit, gloo's teardown can
    # abort while a peer is still connected ("terminate called without an active exception":
    # seen once in a clean clone's make test, after every rank had written its results).
    del world, hsdp
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
