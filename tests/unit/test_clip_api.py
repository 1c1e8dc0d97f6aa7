"""``shardkit.clip_grad_norm_`` / ``grad_norm`` on plain tensors (no process group): torch's
``clip_grad_norm_`` exactly, argument for argument."""

import inspect
import math
import warnings

import pytest
import torch

import shardkit


def params(seed: int = 0, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in ((5, 3), (7,), (2, 2, 2))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(dtype) * 3
    ps.append(torch.nn.Parameter(torch.randn(4)))  # no gradient
    return ps


def test_the_signatures_are_torchs():
    params = lambda fn: [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # noqa: E731
    assert params(shardkit.clip_grad_norm_) == params(torch.nn.utils.clip_grad_norm_)
    assert params(shardkit.grad_norm)[1:] == params(torch.nn.utils.get_total_norm)[1:]  # of parameters, not tensors


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3])
def test_clip_grad_norm_is_torchs_on_plain_tensors(norm_type, foreach):
    ours, theirs = params(), params()
    norm = shardkit.clip_grad_norm_(ours, 1.5, norm_type, foreach=foreach)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 1.5, norm_type, foreach=foreach)
    torch.testing.assert_close(norm, expected, atol=0, rtol=1e-6)
    assert norm.dtype == expected.dtype and norm.device == expected.device
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, atol=0, rtol=1e-6)
    torch.testing.assert_close(shardkit.grad_norm(ours, norm_type), torch.tensor(1.5), atol=0, rtol=1e-5)


def test_grad_norm_leaves_the_gradients_and_a_norm_under_max_norm_scales_by_one():
    ps = params()
    before = [p.grad.clone() for p in ps[:3]]
    norm = shardkit.grad_norm(ps)
    assert all(torch.equal(p.grad, b) for p, b in zip(ps, before))
    assert shardkit.clip_grad_norm_(ps, norm.item() * 2) == norm
    assert all(torch.equal(p.grad, b) for p, b in zip(ps, before))


def test_one_tensor_no_gradients_and_low_precision_as_torch():
    p = params()[0]
    torch.testing.assert_close(shardkit.grad_norm(p), torch.linalg.vector_norm(p.grad))
    assert shardkit.clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0).equal(torch.tensor(0.0))
    with pytest.warns(UserWarning, match="empty generator"):
        shardkit.clip_grad_norm_((p for p in []), 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shardkit.clip_grad_norm_([], 1.0)  # a list warns nothing, as in torch
    assert shardkit.grad_norm(params(dtype=torch.bfloat16)).dtype == torch.bfloat16  # summed in fp32


def test_error_if_nonfinite_raises_torchs_error_and_otherwise_scales_by_the_nonfinite_norm():
    ours, theirs = params(), params()
    for ps in (ours, theirs):
        ps[0].grad[0, 0] = math.inf
    with pytest.raises(RuntimeError, match="The total norm of order 2.0 for gradients from `parameters` is non-finite"):
        shardkit.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
    norm = shardkit.clip_grad_norm_(ours, 1.0)
    assert norm.isinf() and norm.equal(torch.nn.utils.clip_grad_norm_(theirs, 1.0))
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True)


def test_an_empty_shard_adds_nothing_to_the_inf_norm():
    """A rank may hold no rows of a parameter; torch has no inf norm of an empty tensor."""
    ps = params()
    empty = torch.nn.Parameter(torch.zeros(0, 3))
    empty.grad = torch.zeros(0, 3)
    assert shardkit.grad_norm(ps + [empty], math.inf) == torch.nn.utils.get_total_norm([p.grad for p in ps[:3]], math.inf)
