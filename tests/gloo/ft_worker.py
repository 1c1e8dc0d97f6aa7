"""One rank of one torchft replica group (tests/gloo/test_torchft.py starts them).

    python ft_worker.py '<json settings>'

Each replica group is its own gloo world of ``GROUP_WORLD`` ranks, sharded with ``fully_shard``
(shardkit's, through ``shardkit.ft``, or torch's FSDP2 with the hook torchtitan installs); a
torchft ``Manager`` per rank averages each group's reduced gradients across the groups in the
quorum. The group trains with SGD until it has committed ``steps`` steps and the last one had
every group in it. ``die``: ``"after_commit"`` or ``"in_hook"`` at step ``die_at`` (both ranks of
the group exit there, as a host that fails). Each step appends (step, participants,
participating, committed) to its log file; at the end it writes its shards.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

GROUP_WORLD = 2
DIED = 17  # the exit code of a rank that dies on purpose
LR = 0.1


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def batch(step: int, replica: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + 10 * replica + rank))


def loss_of(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return net(x).square().mean()


def managed_mesh(manager, replicas: int, rank: int):
    """HSDP whose replicate dim is torchft's managed group (the ranks of this position in every
    group of the quorum: its size is the participants) and whose shard dim is this group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchft.process_group import ManagedProcessGroup

    group = ManagedProcessGroup(manager)
    name = f"torchft_managed_{rank}"
    group._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, group)  # DeviceMesh.get_group finds it by name
    ranks = torch.arange(replicas * GROUP_WORLD).view(replicas, GROUP_WORLD)  # (only this group's row is ever read)
    return DeviceMesh.from_group([group, dist.group.WORLD], "cpu", mesh=ranks, mesh_dim_names=("replicate", "shard"))


def registered(manager, net: nn.Module, sgd: torch.optim.Optimizer):
    """The model's and the optimizer's state given to torchft by hand, and its optimizer."""
    from torchft import Optimizer

    def load(state):
        net.load_state_dict(state["model"])
        sgd.load_state_dict(state["optim"])

    manager.register_state_dict_fn("user", load, lambda: {"model": net.state_dict(), "optim": sgd.state_dict()})
    return Optimizer(manager, sgd)


def main(settings: dict) -> None:
    from torchft import Manager, ProcessGroupGloo

    replica, rank = settings["replica"], settings["rank"]
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(settings["port"]), RANK=str(rank), WORLD_SIZE=str(GROUP_WORLD))
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=5)), min_replica_size=1, load_state_dict=None, state_dict=None,
                      replica_id=f"replica_{replica}", store_addr="localhost", store_port=settings["port"], rank=rank,
                      world_size=GROUP_WORLD, lighthouse_addr=settings["lighthouse"], timeout=timedelta(seconds=10),
                      quorum_timeout=timedelta(seconds=30), connect_timeout=timedelta(seconds=30), init_sync=settings["init_sync"])
    net = model()
    managed = settings.get("mesh") == "managed"
    mesh = managed_mesh(manager, settings["replicas"], rank) if managed else init_device_mesh("cpu", (GROUP_WORLD,), mesh_dim_names=("dp_shard",))
    if settings["impl"] == "shardkit":
        import shardkit
        import shardkit.ft

        fully_shard = shardkit.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in net[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    sgd = torch.optim.SGD(net.parameters(), lr=LR)  # (on the sharded parameters)
    if managed:  # the mesh reduces across the groups itself: no hook
        opt = registered(manager, net, sgd)
    elif settings["impl"] == "shardkit":
        opt = shardkit.ft.fault_tolerant(net, manager, sgd).optimizer
    else:  # FSDP2 as torchtitan drives it
        from torch.distributed.fsdp import FSDPModule

        for m in net.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(lambda reduced: manager.allreduce(reduced).wait())
        opt = registered(manager, net, sgd)

    (Path(settings["ready"]) / f"{replica}-{rank}").touch()  # every group heartbeats before the first quorum:
    while len(list(Path(settings["ready"]).iterdir())) < settings["replicas"] * GROUP_WORLD:  # it holds them all
        time.sleep(0.02)
    step_now = [0]
    if settings["die"] == "in_hook":  # the group dies in the middle of its gradient average
        allreduce = manager.allreduce

        def dying_allreduce(tensor, *args, **kwargs):
            if step_now[0] == settings["die_at"]:
                os._exit(DIED)
            return allreduce(tensor, *args, **kwargs)

        manager.allreduce = dying_allreduce
    log, deadline = open(settings["log"], "a"), time.monotonic() + settings["timeout_s"]
    while time.monotonic() < deadline:
        opt.zero_grad()  # the step's quorum
        step = step_now[0] = manager.current_step()
        loss_of(net, batch(step, replica, rank)).backward()
        participants, participating = manager.num_participants(), manager.is_participating()
        opt.step()  # commits (and steps) only if every group in the quorum can
        committed = manager.current_step() == step + 1
        print(json.dumps([step, participants, participating, committed]), file=log, flush=True)  # (kept if it dies next)
        if settings["die"] == "after_commit" and committed and step == settings["die_at"]:
            # the group dies once all its ranks have their commit: group rank 0 serves the
            # group's torchft manager, and a peer still waiting on its should_commit reply would
            # fail of the death ("transport error") instead of dying of it
            dist.barrier()
            os._exit(DIED)
        done = torch.tensor([committed and step + 1 >= settings["steps"] and participants == settings["replicas"]], dtype=torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)  # the group's ranks stop together (each asks its own quorum)
        if done.item():
            break
        time.sleep(settings["sleep_s"])
    shards = {n: p.to_local().detach().clone() for n, p in net.named_parameters()}
    torch.save({"shards": shards, "step": manager.current_step()}, settings["out"])
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    os._exit(0)  # (torchft's threads need not be joined)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
