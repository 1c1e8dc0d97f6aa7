"""Simulated CUDA streams and their race checker (shardkit/comm/sim.py) on a fake process group.

A clean step reports no race and orders every collective both ways; each planted bug (a
dropped wait, a dropped keep-alive reference, unsharded parameters freed under a pending
all-gather, a side stream that does not wait for the compute stream, a user edit during an
all-gather) is reported with the buffer, both streams and the missing edge.
"""

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import fully_shard
from shardkit.comm import sim
from shardkit.comm.sim import StreamRace
from shardkit.comm.streams import DeviceStreams, Handle
from shardkit.eager.param_group import ParamGroup, Holding
from tests.conftest import TanhStack, fake_world


def sharded(mesh, n_blocks: int = 3, bias: bool = True) -> nn.Module:
    torch.manual_seed(0)
    net = TanhStack(n_blocks, dim=8)
    if not bias:  # one parameter per block: its all-gather writes the unsharded parameter in place
        for block in net.blocks:
            block[0] = nn.Linear(8, 8, bias=False)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def train(net: nn.Module, steps: int = 2) -> None:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for _ in range(steps):
        net(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_a_training_run_has_no_races_and_orders_each_collective_both_ways():
    with fake_world(4, 0) as mesh, sim.checking() as checker, shardkit.trace() as t:
        train(sharded(mesh), steps=3)
    assert checker.races == 0 and checker.accesses > 500
    # Each collective: its side stream waits for the compute stream, and the compute stream
    # waits for the side stream's event before the copy-out.
    assert checker.edges == 2 * len(t.collectives()) == 2 * 3 * (4 + 3 + 4)
    assert checker.summary() == f"sim streams: {checker.accesses} accesses checked, {checker.edges} cross-stream edges, 0 races"


def test_the_schedule_and_trace_are_those_of_the_cpu_path():
    def traced_second_step() -> str:
        with fake_world(4, 0) as mesh:
            net = sharded(mesh)
            net(torch.randn(4, 8)).sum().backward()
            with shardkit.trace() as t:
                net(torch.randn(4, 8)).sum().backward()
        return t.format()

    with sim.checking():
        simulated = traced_second_step()
    assert simulated == traced_second_step()


def test_a_dropped_wait_is_reported(monkeypatch):
    monkeypatch.setattr(DeviceStreams, "wait", lambda self, handle: None)  # planted: no wait_event
    with fake_world(4, 0) as mesh, sim.checking() as checker:
        with pytest.raises(StreamRace) as error:
            train(sharded(mesh))
    assert "read of the output of all_gather <root> on stream 'compute'" in str(error.value)
    assert "not ordered after its write on stream 'all_gather'" in str(error.value)
    assert "Missing edge: all_gather -> compute" in str(error.value)
    assert checker.races == 1


def test_a_dropped_keep_alive_reference_is_reported(monkeypatch):
    issue = DeviceStreams.issue

    def forgetful(self, kind, *args, **kwargs) -> Handle:
        handle = issue(self, kind, *args, **kwargs)
        handle.buffers.pop("unsharded gradients", None)  # planted: the gradients die at once
        return handle

    monkeypatch.setattr(DeviceStreams, "issue", forgetful)
    with fake_world(4, 0) as mesh, sim.checking():
        with pytest.raises(StreamRace) as error:
            train(sharded(mesh))
    message = str(error.value)
    assert "the memory of the unsharded gradients of reduce_scatter blocks.2 was freed while stream 'reduce_scatter' may still use it" in message
    assert "its read there is not ordered before stream 'compute'" in message
    assert "Missing edge: reduce_scatter -> compute" in message


def test_unsharded_parameters_freed_under_a_pending_all_gather_are_reported(monkeypatch):
    reshard = ParamGroup._reshard

    def hasty(self, free, detail):
        if self.holding is Holding.GATHERING:  # planted: drop the all-gather instead of waiting
            self.all_gathers, self.holding = [], Holding.KEPT
        reshard(self, free, detail)

    monkeypatch.setattr(ParamGroup, "_reshard", hasty)
    with fake_world(4, 0) as mesh, sim.checking():
        net = sharded(mesh, bias=False)
        train(net, steps=1)
        net.blocks[1].unshard(async_op=True)  # a prefetch...
        net.blocks[1].reshard()  # ... given up before it completed
        with pytest.raises(StreamRace) as error:
            net(torch.randn(4, 8))
    message = str(error.value)
    assert "the memory of the output of all_gather blocks.1 was freed while stream 'all_gather' may still use it (its write" in message
    assert "Missing edge: all_gather -> compute" in message


def test_a_side_stream_that_does_not_wait_for_the_compute_stream_is_reported(monkeypatch):
    monkeypatch.setattr(sim.SimStream, "wait_stream", lambda self, other: None)  # planted
    with fake_world(4, 0) as mesh, sim.checking():
        net = sharded(mesh)
        with pytest.raises(StreamRace) as error:
            train(net)  # the second step's all-gathers read what the optimizer wrote
    message = str(error.value)
    assert "read of the shards of all_gather <root> on stream 'all_gather'" in message
    assert "not ordered after its write on stream 'compute'" in message
    assert "Missing edge: compute -> all_gather" in message


def test_an_edit_of_a_shard_during_its_all_gather_is_reported():
    with fake_world(4, 0) as mesh, sim.checking():
        net = sharded(mesh)
        train(net, steps=1)
        net.blocks[0].unshard(async_op=True)
        with pytest.raises(StreamRace) as error, torch.no_grad():
            net.blocks[0][0].weight.mul_(2)  # still being read by the all-gather's copy-in
    message = str(error.value)
    assert "write of the shards of all_gather blocks.0 on stream 'compute'" in message
    assert "not ordered after its read on stream 'all_gather'" in message
