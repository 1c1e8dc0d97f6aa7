"""shardkit.optim.Muon is torch.optim.Muon on plain tensors, in one process with no process
group: the same constructor, defaults, errors, results (bit for bit) and state_dict. And
PolarExpress orthogonalizes. Sharded parameters: tests/fake/test_muon_plan.py, tests/gloo/."""

import inspect

import pytest
import torch
import torch.distributed as dist

import shardkit.optim
from shardkit.optim.muon import adjust_lr

MUONS = [torch.optim.Muon, shardkit.optim.Muon]


def test_constructor_signature_and_defaults_are_torchs():
    def parameters(cls):  # annotations aside: ours are strings (from __future__ import annotations)
        return [(p.name, p.kind, p.default) for p in inspect.signature(cls).parameters.values()]

    ours, theirs = parameters(shardkit.optim.Muon), parameters(torch.optim.Muon)
    assert ours[:-1] == theirs
    assert ours[-1] == ("bucket_mb", inspect.Parameter.KEYWORD_ONLY, 256.0)  # ours only: see Muon's doc
    params = [torch.zeros(3, 2, requires_grad=True)]
    assert shardkit.optim.Muon(params).defaults == torch.optim.Muon(params).defaults


def matrix(*shape, **kwargs) -> torch.Tensor:
    return torch.zeros(*shape, requires_grad=True, **kwargs)


# name: (constructor kwargs, the parameter, its gradient (None: the constructor raises)).
BAD_INPUTS = {
    "tensor lr of 2 elements": ({"lr": torch.tensor([0.1, 0.2])}, matrix(3, 2), None),
    "negative lr": ({"lr": -0.1}, matrix(3, 2), None),
    "negative momentum": ({"momentum": -0.5}, matrix(3, 2), None),
    "negative weight decay": ({"weight_decay": -0.1}, matrix(3, 2), None),
    "unknown adjust_lr_fn": ({"adjust_lr_fn": "rms"}, matrix(3, 2), None),
    "1-D parameter": ({}, matrix(3), None),
    "4-D parameter": ({}, matrix(2, 3, 2, 2), None),
    "sparse gradient": ({}, matrix(3, 2), torch.zeros(3, 2).to_sparse()),
    "complex parameter": ({}, matrix(3, 2, dtype=torch.complex64), torch.zeros(3, 2, dtype=torch.complex64)),
    "ns_steps of 100": ({"ns_steps": 100}, matrix(3, 2), torch.ones(3, 2)),
}


def error_of(cls, kwargs: dict, param: torch.Tensor, grad: torch.Tensor | None) -> tuple[type, str]:
    p = param.detach().clone().requires_grad_()
    try:
        opt = cls([p], **kwargs)
        p.grad = grad
        opt.step()
    except Exception as e:  # noqa: BLE001 - we compare whatever each raises
        return type(e), str(e)
    raise AssertionError(f"{cls.__module__}.{cls.__name__} raised nothing")


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_errors_are_torchs_type_and_message(name):
    ours, theirs = (error_of(cls, *BAD_INPUTS[name]) for cls in (shardkit.optim.Muon, torch.optim.Muon))
    assert ours == theirs


def test_a_3d_parameter_is_a_batch_of_matrices_where_torch_refuses_it():
    # The one documented difference: expert weights (E, M, N), each expert a matrix of its own.
    with pytest.raises(ValueError, match="only supports 2D parameters"):
        torch.optim.Muon([matrix(2, 3, 4)])
    p = torch.randn(2, 3, 4, requires_grad=True)
    p.grad = torch.randn(2, 3, 4)
    experts = [p[e].detach().clone().requires_grad_() for e in range(2)]
    for e, expert in enumerate(experts):
        expert.grad = p.grad[e].clone()
    shardkit.optim.Muon([p], lr=0.1).step()
    torch.optim.Muon(experts, lr=0.1).step()
    assert torch.equal(p.detach(), torch.stack([e.detach() for e in experts]))


def three_steps(cls, lr, nesterov: bool, adjust_lr_fn: str):
    """Two param groups (their own lr, momentum, weight decay) of tall, wide and square
    matrices, three steps with fixed random gradients: (params, optimizer)."""
    torch.manual_seed(0)
    params = [torch.randn(shape, requires_grad=True) for shape in [(16, 8), (8, 24), (12, 12)]]
    groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}]
    opt = cls(groups, lr=lr, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    gradients = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gradients)
        opt.step()
    return params, opt


@pytest.mark.parametrize("lr", [0.02, pytest.param(torch.tensor(0.02), id="tensor lr")])
@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_three_steps_equal_torchs_bit_for_bit(nesterov, adjust_lr_fn, lr):
    ours, ours_opt = three_steps(shardkit.optim.Muon, lr, nesterov, adjust_lr_fn)
    theirs, theirs_opt = three_steps(torch.optim.Muon, lr, nesterov, adjust_lr_fn)
    assert not dist.is_initialized()  # plain tensors need no process group
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"parameter {k}: max diff {(a - b).abs().max()}"
        assert torch.equal(ours_opt.state[a]["momentum_buffer"], theirs_opt.state[b]["momentum_buffer"]), f"parameter {k}"


def test_state_dict_is_shaped_as_torchs_and_loads_into_torchs():
    ours, ours_opt = three_steps(shardkit.optim.Muon, 0.02, True, "original")
    theirs, theirs_opt = three_steps(torch.optim.Muon, 0.02, True, "original")
    a, b = ours_opt.state_dict(), theirs_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]  # every hyperparameter, and the params' ids
    assert a["state"].keys() == b["state"].keys()
    for k in b["state"]:
        assert a["state"][k].keys() == b["state"][k].keys() == {"momentum_buffer"}
        assert torch.equal(a["state"][k]["momentum_buffer"], b["state"][k]["momentum_buffer"])
    # A checkpoint of one resumes in the other.
    theirs_opt.load_state_dict(a)
    ours_opt.load_state_dict(b)


@pytest.mark.parametrize("shape", [(32, 16), (16, 48)])
def test_polar_express_update_is_nearly_orthogonal(shape):
    # One step from zero weights with no momentum and no weight decay leaves -lr' x the update.
    # (A square Gaussian matrix has singular values near 0 that five iterations do not lift,
    # neither Polar Express's nor torch's Newton-Schulz's: we take tall and wide ones.)
    torch.manual_seed(0)
    p = torch.zeros(shape, requires_grad=True)
    p.grad = torch.randn(shape)
    shardkit.optim.PolarExpress([p], lr=1.0, momentum=0.0, nesterov=False, weight_decay=0.0).step()
    update = -p.detach().double() / adjust_lr(1.0, None, p.shape)
    singular_values = torch.linalg.svdvals(update)
    assert 0.5 <= singular_values.min() and singular_values.max() <= 1.5, singular_values
