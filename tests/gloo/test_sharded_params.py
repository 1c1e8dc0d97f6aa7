"""The sharded parameters on 2 gloo ranks: local shapes, state_dict, manual unshard/reshard,
and the gradient divide factor, each against a non-sharded reference.

Every check also runs with torch's own FSDP2 (``-torch`` items). The checks run inside the
spawned ranks; see gloo_harness.py.
"""

import pytest
import torch
from gloo_harness import Checks, run_worker
from gloo_parity import (
    FULLY_SHARD, Parity, Stack, assert_close, full, gpt_batches, gpt_loss, shard_blocks_then_root,
    small_gpt, stack_batches,
)
from torch.distributed.tensor import DTensor, Shard

from shardkit.models.gpt import apply_fully_shard

checks = Checks()


def _chunk_shape(shape: torch.Size, world: int, rank: int) -> tuple[int, ...]:
    """This rank's shape under ``torch.chunk`` on dim 0 (which yields fewer chunks when rows < world)."""
    chunks = torch.empty(shape, device="meta").chunk(world)
    return tuple(chunks[rank].shape) if rank < len(chunks) else (0, *shape[1:])


@checks()
def local_shapes_follow_torch_chunk_with_uneven_rows(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    rank, world = mesh.get_local_rank(), mesh.size()
    params = dict(p.model.named_parameters())
    expected = {name: _chunk_shape(t.shape, world, rank) for name, t in p.ref.named_parameters()}
    assert {name: tuple(t.to_local().shape) for name, t in params.items()} == expected
    assert tuple(params["blocks.0.lin.weight"].to_local().shape) == [(7, 13), (6, 13)][rank]
    assert tuple(params["blocks.1.lin.weight"].to_local().shape) == [(1, 13), (0, 13)][rank]  # one row
    for name, t in p.ref.named_parameters():
        assert params[name].shape == t.shape, f"{name}: global shape {params[name].shape} != {t.shape}"
        assert tuple(params[name].placements) == (Shard(0),), f"{name}: {params[name].placements}"


def _assert_state_dict_matches(p: Parity, when: str) -> None:
    state, ref_state = p.model.state_dict(), p.ref.state_dict()
    assert list(state) == list(ref_state), f"{when}: keys {list(state)} != {list(ref_state)}"
    plain = [k for k, v in state.items() if not isinstance(v, DTensor)]
    assert not plain, f"{when}: not DTensors: {plain}"
    state = {k: full(v) for k, v in state.items()}  # collectives first
    for k, v in state.items():
        assert_close(v, ref_state[k], f"{when}: state_dict[{k!r}]")


def _state_dict_check(p: Parity, batch) -> None:
    _assert_state_dict_matches(p, "before the first step")
    p.step(batch)
    _assert_state_dict_matches(p, "after a step")
    with torch.no_grad():
        p.loss_of(p.model, batch)  # the root keeps its parameters unsharded after forward
    _assert_state_dict_matches(p, "after a no_grad forward")


@checks()
def state_dict_matches_reference_with_uneven_rows(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    _state_dict_check(p, stack_batches(1)[0])


@checks()
def state_dict_matches_reference_with_tied_weights(mesh, impl):
    shard = lambda m: apply_fully_shard(m, FULLY_SHARD[impl], mesh=mesh)
    p = Parity.build(small_gpt, shard, mesh, impl, loss_of=gpt_loss)
    _state_dict_check(p, gpt_batches(1)[0])  # head.weight is a key, as in the reference


@checks()
def manual_unshard_registers_full_plain_parameters(mesh, impl):
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    batches = stack_batches(5)
    p.train(batches[:2])
    fsdp_modules = [*p.model.blocks, p.model]
    for module in fsdp_modules:
        module.unshard()
    ref = dict(p.ref.named_parameters())
    unsharded = dict(p.model.named_parameters())
    still_sharded = [n for n, t in unsharded.items() if isinstance(t, DTensor)]
    assert not still_sharded, f"DTensors after unshard(): {still_sharded}"
    for name, t in unsharded.items():
        assert_close(t.detach(), ref[name].detach(), f"unsharded {name}")
    for module in fsdp_modules:
        module.reshard()
    plain = [n for n, t in p.model.named_parameters() if not isinstance(t, DTensor)]
    assert not plain, f"plain tensors after reshard(): {plain}"

    handle = p.model.blocks[0].unshard(async_op=True)
    handle.wait()
    weight = p.model.blocks[0].lin.weight
    assert not isinstance(weight, DTensor), "blocks.0.lin.weight is a DTensor after unshard(async_op=True).wait()"
    assert_close(weight.detach(), ref["blocks.0.lin.weight"].detach(), "blocks.0.lin.weight after the async unshard")
    p.train(batches[2:])  # the first forward runs on the already unsharded block
    p.assert_params_match()


def _gradient_scale_check(mesh, impl: str, divide_factor: float | None, scale: float) -> None:
    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    if divide_factor is not None:
        for module in [*p.model.blocks, p.model]:
            module.set_gradient_divide_factor(divide_factor)
            if impl == "torch":  # else FSDP2 asks gloo for PREMUL_SUM, which gloo lacks
                module.set_force_sum_reduction_for_comms(True)
    p.forward_backward(stack_batches(1)[0])
    p.assert_grads_match(scale)


@checks()
def gradients_are_averaged_over_ranks_by_default(mesh, impl):
    _gradient_scale_check(mesh, impl, divide_factor=None, scale=1.0)


@checks()
def gradients_are_summed_over_ranks_with_divide_factor_one(mesh, impl):
    _gradient_scale_check(mesh, impl, divide_factor=1.0, scale=mesh.size())


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_sharded_params_match_reference_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
