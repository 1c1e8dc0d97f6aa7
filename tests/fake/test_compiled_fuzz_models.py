"""Compiled mode under ``torch.compile`` on the fuzzer's model family (tests/fuzz/sequences.py:
Net and its Spec features), against eager shardkit at world 1. The fuzzer runs compiled mode
without torch.compile, so what only dynamo does (a graph break inside a group's forward, a
parameter's ``.data`` replaced in forward, a tensor subclass parameter, weights tied across
calls) is checked here, with the default ``fullgraph=False``: 3 AdamW steps, the same
parameters and the same None gradients."""

import pytest
import torch

from tests.conftest import fake_world
from tests.fuzz.sequences import Net, Optimizers, Spec, batch, loss_of, shard

# (spec, tolerance): bf16 with a weight tied across calls sums the two calls' gradients in
# another order than eager mode (close, not the same bits); the rest are eager mode's bits.
# The third: blocks chosen as regions that break the graph (.data replaced) run inline under
# fullgraph=False (region.allowed_here; UncapturedHigherOrderOpError before).
SPECS = [(Spec(nested=True, mixed=True, tied="across", mp=True, unused=True, swap_data=True), 1e-4),
         (Spec(reshard=False, foreach=True, extension=True), 0.0),
         (Spec(regions=True, swap_data=True, unused=True), 0.0)]


def _train(spec: Spec, compiled: bool, mesh) -> tuple[dict, list]:
    torch.manual_seed(0)
    model = Net(spec)
    shard(model, spec, "shardkit", mesh)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    optimizers = Optimizers(dict(model.named_parameters()), spec, reference=False)
    for step in range(3):
        x, y = batch(step, spec)
        loss_of(run, x, y).backward()  # (run.tied: the compiled module reads the model's attributes)
        nones = sorted(n for n, p in model.named_parameters() if p.grad is None)
        optimizers.step()
        optimizers.zero_grad()
    return {n: p.full_tensor().detach() for n, p in model.named_parameters()}, nones


@pytest.mark.parametrize("spec,tolerance", SPECS, ids=["nested-mixed-tied-across-bf16-unused-swap-data", "no-reshard-foreach-extension", "regions-swap-data-unused"])
def test_compiled_mode_compiled_trains_the_fuzzers_models_as_eager_shardkit(spec, tolerance):
    with fake_world(1) as mesh:
        torch._dynamo.reset()
        eager, eager_nones = _train(spec, False, mesh)
        compiled, compiled_nones = _train(Spec(**{**spec.__dict__, "compiled_mode": True}), True, mesh)
    assert compiled_nones == eager_nones
    worst = max(float((compiled[n].double() - eager[n].double()).abs().max()) for n in eager)
    assert worst <= tolerance, worst
