"""The optimizer swap (shardkit/optim/local_step.py): DTensors outside the step, local tensors inside."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from shardkit import fully_shard
from tests.conftest import fake_world


def model_with_grads(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 3))
    fully_shard(model, mesh=mesh)
    model(torch.randn(4, 6)).sum().backward()
    return model


def test_inside_the_step_the_optimizer_sees_local_tensors_and_outside_dtensors():
    with fake_world(4, 1) as mesh:
        model = model_with_grads(mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        seen = []
        opt.register_step_pre_hook(lambda o, *_: seen.append([type(p) for p in o.param_groups[0]["params"]]))
        before = [p.to_local().clone() for p in model.parameters()]
        opt.step()
        assert seen == [[torch.Tensor] * 4]
        assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
        for p, b in zip(model.parameters(), before):
            assert not torch.equal(p.to_local(), b), "the step did not update the shard in place"
            assert p._local_tensor.grad is None  # the local grad is only lent during the step
            assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
            assert isinstance(opt.state[p]["exp_avg"], DTensor) and not isinstance(opt.state[p]["step"], DTensor)
        exp_avg = [opt.state[p]["exp_avg"] for p in model.parameters()]
        opt.step()
        assert [opt.state[p]["exp_avg"] for p in model.parameters()] == exp_avg  # same objects: no rewrap per step


def test_a_step_that_raises_is_undone_by_the_next_step():
    with fake_world(2, 0) as mesh:
        model = model_with_grads(mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt.step()
        with pytest.raises(ZeroDivisionError):
            opt.step(lambda: 1 / 0)
        opt.step()
        assert all(isinstance(p, DTensor) for p in opt.param_groups[0]["params"])
        assert all(isinstance(opt.state[p]["momentum_buffer"], DTensor) for p in model.parameters())
        assert len(opt.state) == 4


def test_other_optimizers_and_parameters_are_left_alone():
    with fake_world(2, 0) as mesh:
        model = model_with_grads(mesh)
        plain = nn.Parameter(torch.ones(3))
        plain.grad = torch.ones(3)
        opt = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [plain]}], lr=0.5)
        opt.step()
        assert torch.equal(plain.detach(), torch.full((3,), 0.5))
        assert opt.param_groups[1]["params"][0] is plain
