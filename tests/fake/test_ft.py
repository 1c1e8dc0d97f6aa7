"""shardkit.ft.fault_tolerant on the fake process group, with a stand-in torchft manager: what it
installs and registers, and its errors (tests/gloo/test_torchft.py runs torchft for real)."""

import sys

import pytest
import torch
import torch.nn as nn

import shardkit
import shardkit.ft

pytest.importorskip("torchft", reason="torchft is a test dependency (make venv installs it)")


class Manager:
    """What fault_tolerant uses of torchft.Manager: the state callbacks and the average."""

    def __init__(self) -> None:
        self.registered, self.averaged = {}, []

    def register_state_dict_fn(self, key, load, state):
        self.registered[key] = (load, state)

    def allreduce(self, tensor):
        self.averaged.append(tensor.shape)
        manager = self

        class Work:
            def wait(self):
                tensor.mul_(0.5)  # a stand-in for the average over the groups
                return manager

        return Work()


def sharded(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    shardkit.fully_shard(model[0], mesh=mesh)
    shardkit.fully_shard(model, mesh=mesh)
    return model


def test_the_hook_on_every_group_the_state_registered_and_the_optimizer_wrapped(mesh8):
    model, manager = sharded(mesh8), Manager()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ft = shardkit.ft.fault_tolerant(model, manager, opt)
    assert type(ft.optimizer).__name__ == "OptimizerWrapper" and ft.optimizer.optim is opt
    model(torch.randn(2, 8)).sum().backward()
    # One average per group's reduction, of its chunk: a padded row of each weight (8) and of each bias (1)
    assert manager.averaged == [torch.Size([9]), torch.Size([9])], manager.averaged
    load, state = manager.registered["shardkit"]
    sd = state()
    assert set(sd) == {"model", "optim"} and set(sd["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(isinstance(v, torch.distributed.tensor.DTensor) for v in sd["model"].values())
    load(sd)  # on the training thread between steps: loads


def test_a_model_without_fully_shard_and_an_absent_torchft_are_refused_with_what_to_do(mesh8, monkeypatch):
    with pytest.raises(ValueError, match="has no fully_shard module; call shardkit.fully_shard"):
        shardkit.ft.fault_tolerant(nn.Linear(2, 2), Manager())
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match="shardkit.ft needs torchft, which is not installed: pip install"):
        shardkit.ft.fault_tolerant(sharded(mesh8), Manager())
