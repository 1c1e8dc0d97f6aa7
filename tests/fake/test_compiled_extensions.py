"""shardkit.compiled with parameters that all-gather themselves (FSDP2's fsdp_pre_all_gather /
fsdp_post_all_gather) on the fake process group (world 8): what the graphs all-gather, and
what compiled mode does not take with them. Numbers: tests/gloo/test_compiled_mode_extensions.py."""

import pytest
import torch
import torch.nn as nn

import shardkit
import shardkit.compiled
from tests.conftest import fake_world
from tests.fake.test_compiled_graphs import Recording


def float8_model() -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 64, bias=False), nn.LayerNorm(64), nn.Linear(64, 32, bias=False)) for _ in range(2)])
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return model


def gathers(gm: torch.fx.GraphModule) -> list[tuple[torch.dtype, int]]:
    """(dtype, output elements) of each all-gather of a graph, in graph order."""
    return [(n.meta["val"].dtype, n.meta["val"].numel()) for n in gm.graph.nodes if n.op == "call_function" and "all_gather_into_tensor" in str(n.target)]


def test_float8_weights_are_all_gathered_as_their_one_byte_data_and_again_in_backward():
    """Per block, ONE uint8 all-gather, as eager mode: its two float8 weights' data (2 x 32 x
    64 bytes) and its LayerNorm's fp32 (2 x 64 x 4 bytes); the blocks reshard after forward, so
    backward all-gathers those bytes again (the recomputed cast and gather), never the float8
    weights in fp32."""
    with fake_world(8) as mesh:
        torch._dynamo.reset()
        recording = Recording()
        model = float8_model()
        for block in model:
            shardkit.compiled.fully_shard(block, mesh=mesh)
        shardkit.compiled.fully_shard(model, mesh=mesh)
        torch.compile(model, backend=recording, fullgraph=True)(torch.randn(2, 32)).sum().backward()
    block = (torch.uint8, 2 * 32 * 64 + 2 * 64 * 4)
    assert gathers(recording.graphs["forward"][0]) == [block] * 2
    assert gathers(recording.graphs["backward"][0]) == [block] * 2


@pytest.mark.parametrize("kwargs, what", [
    (dict(reshard_after_forward=2), "reshard_after_forward=2 \\(an int\\)"),
])
def test_what_compiled_mode_does_not_take_with_such_parameters_raises_naming_it(kwargs, what):
    with fake_world(8) as mesh:
        model = float8_model()
        with pytest.raises(NotImplementedError, match=f"{what} with parameter 'weight' with fsdp_pre_all_gather.*shardkit.fully_shard"):
            shardkit.compiled.fully_shard(model[0], mesh=mesh, **kwargs)


def test_not_resharding_after_backward_such_a_group_gathers_again_and_computes_as_with_resharding():
    """set_reshard_after_backward(False): a bucket of bytes keeps nothing (backward once raised
    handing the gathered rows to a leaf it does not have), so each forward all-gathers it again;
    the gradients are those of the default setting. (Run without torch.compile: the graph's code.)"""
    grads = {}
    with fake_world(2) as mesh:
        for keep in (False, True):
            model = float8_model()
            for block in model:
                shardkit.compiled.fully_shard(block, mesh=mesh)
            shardkit.compiled.fully_shard(model, mesh=mesh)
            model.set_reshard_after_backward(not keep)
            model.set_requires_gradient_sync(False)
            x = torch.randn(2, 32, generator=torch.Generator().manual_seed(1))
            model(x).sum().backward()
            with shardkit.trace() as t:
                model(x).sum().backward()
            assert sorted({e.group for e in t.collectives("all_gather")}) == ["0", "1"], keep
            model.set_requires_gradient_sync(True)
            model(x).sum().backward()
            grads[keep] = [p.grad.to_local().clone() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))
