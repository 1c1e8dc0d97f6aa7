"""What tests/gloo/test_compiled_mode.py, test_compiled_mode_regions.py and test_compiled_mode_tied.py share: the small GPT
sharded in either mode, trained against the unsharded model, and compared bit for bit; every
block as a compile region (``regions``)."""

import contextlib

import torch

import shardkit
import shardkit.compiled
from gloo_parity import Parity, full, gpt_batches, gpt_loss, small_gpt

STEPS = 3
MODES = {"compiled": shardkit.compiled.fully_shard, "eager": shardkit.fully_shard}


def shard(mode: str, mesh, **kwargs):
    def apply(model):
        for block in model.blocks:
            MODES[mode](block, mesh=mesh, **kwargs)
        MODES[mode](model, mesh=mesh, **kwargs)

    return apply


def train(mesh, mode: str, backend=None, build=small_gpt, **kwargs) -> tuple[Parity, list[torch.Tensor]]:
    """3 AdamW steps of the small GPT (or what ``build`` makes), its gradients and losses checked
    against the unsharded model at each (``Parity``); the losses, for the other mode to compare."""
    torch._dynamo.reset()
    p = Parity.build(build, shard(mode, mesh, **kwargs), mesh, "compiled", loss_of=gpt_loss)
    if backend is not None:
        p.model = torch.compile(p.model, backend=backend, fullgraph=True)
    return p, [step.loss for step in p.train(gpt_batches(STEPS))]


def assert_same_bits(a: Parity, b: Parity, what: str) -> None:
    for (name, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(full(x.detach()), full(y.detach())), f"{what}: parameter {name} differs"


@contextlib.contextmanager
def regions(regions_from: int = 1):
    """Every block compiled as a nested compile region (region.py; by default only models with
    REGIONS_FROM blocks of one structure are); with ``regions_from=2``, the blocks of a
    structure that two or more blocks share (``gloo_parity.mixed_gpt``)."""
    import torch._inductor.config
    from shardkit.compiled import region

    before, region.REGIONS_FROM = region.REGIONS_FROM, regions_from
    config = torch._inductor.config
    reuse, inplace = config.allow_buffer_reuse, config.inplace_buffers  # fully_shard turns them off for regions
    try:
        yield
    finally:
        region.REGIONS_FROM, config.allow_buffer_reuse, config.inplace_buffers = before, reuse, inplace
