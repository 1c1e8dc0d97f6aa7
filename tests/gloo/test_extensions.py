"""FSDP2's tensor-subclass all-gather protocol on 2 gloo ranks: a subclass written here
(``extension_tensors.Tagged``), torchao's float8 training weights and its NF4 (QLoRA) weights.

Each check runs on torch's FSDP2 too, to show it checks what FSDP2 does. Every check compares
with an unsharded reference in one process, or (float8, where the reference would need
float8's own all-gather) with FSDP2 in the same run.
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

import shardkit
from extension_tensors import CALLS, OldSignature, Released, Tagged, UserComm
from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Parity, assert_close, mean_over_ranks, stack_batches

checks = Checks()
STEPS = 3


class Tiny(nn.Module):
    """Two blocks whose weights are ``Tagged``; the root holds plain parameters."""

    def __init__(self, kind: type = Tagged) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 12)
        self.blocks = nn.ModuleList([nn.Linear(12, 12), nn.Linear(12, 6)])
        self.out = nn.Linear(6, 3)
        self.kind = kind

    def tag_weights(self) -> None:
        for block in self.blocks:
            block.weight = nn.Parameter(self.kind(block.weight.detach().clone()))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.out(x)


def tagged_parity(mesh: DeviceMesh, impl: str, kind: type = Tagged, **kwargs) -> Parity:
    def shard(model):
        model.tag_weights()  # after the reference's deepcopy: it keeps plain weights
        for block in model.blocks:
            FULLY_SHARD[impl](block, mesh=mesh, **kwargs)
        FULLY_SHARD[impl](model, mesh=mesh, **kwargs)

    return Parity.build(lambda: Tiny(kind), shard, mesh, impl, optimizer=torch.optim.SGD, lr=0.1)


@checks()
def tagged_weights_gather_through_their_hooks_and_train_like_the_reference(mesh, impl):
    CALLS.clear()
    p = tagged_parity(mesh, impl)
    for step, batch in enumerate(stack_batches(STEPS)):
        Tagged.tag = 100 + step  # what the tags carry changes each step: the bytes are fresh
        result = p.step(batch)
        assert_close(result.loss, result.ref_loss, f"loss at step {step}")
    p.assert_params_match()
    # 2 hooked weights, gathered before forward and again before backward, 3 steps; built once
    # each, then refilled in place (out=).
    assert dict(CALLS) == {"pre": 12, "mesh_size": 2, "post": 2, "post_out": 10}, dict(CALLS)


@checks()
def the_older_one_argument_pre_all_gather_still_works(mesh, impl):
    CALLS.clear()
    p = tagged_parity(mesh, impl, OldSignature)
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    assert CALLS["pre_old"] == 12 and CALLS["post"] == 2, dict(CALLS)


@checks()
def outputs_released_after_post_all_gather_when_the_subclass_says_so(mesh, impl):
    """torch 2.15's fsdp_should_release_all_gather_outputs_after_post_all_gather: shardkit frees
    the gathered inputs right after building (on every torch; FSDP2 before 2.15 keeps them),
    and training is unchanged."""
    CALLS.clear()
    p = tagged_parity(mesh, impl, Released)
    if impl == "shardkit":
        sizes = []
        p.model.blocks[0].register_forward_pre_hook(
            lambda m, args: sizes.append([t.untyped_storage().size() for t in p.model.blocks[0]._shardkit().group.params[0].extension.outputs]))
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    if impl == "shardkit":
        assert sizes == [[0, 0]] * STEPS, sizes  # gathered, built, released: before the block computes


def _hsdp_mesh(mesh: DeviceMesh, shape: tuple[int, int]) -> DeviceMesh:
    return DeviceMesh("cpu", torch.arange(mesh.size()).view(shape), mesh_dim_names=("replicate", "shard"))


@checks()
def tagged_weights_on_an_hsdp_mesh_get_the_shard_mesh_and_train_like_the_reference(mesh, impl):
    # FSDP2 calls fsdp_post_all_gather with one output instead of two on a shard dim of size 1.
    for shape in [(1, 2), (2, 1)] if impl == "shardkit" else [(1, 2)]:
        CALLS.clear()
        hsdp = _hsdp_mesh(mesh, shape)
        p = tagged_parity(hsdp, impl)
        p.mesh = mesh  # batches are split over all ranks
        p.train(stack_batches(STEPS))
        p.assert_params_match()
        assert CALLS["mesh_size"] == shape[1] and CALLS["pre"] == 12, (shape, dict(CALLS))


@checks("shardkit")
def a_group_of_hooked_and_plain_params_gathers_once_as_bytes(mesh, impl):
    torch.manual_seed(0)
    model = Tiny()
    model.tag_weights()
    shardkit.fully_shard(model, mesh=mesh)  # one group: 2 hooked weights, 6 plain parameters
    with shardkit.trace() as t:
        model(torch.randn(4, 8)).sum().backward()
    gathers = [e for e in t.collectives() if e.kind == "all_gather"]
    # Each rank sends its padded fp32 rows of every parameter (ceil(rows / 2) of them), and the
    # hooked weights' tags: one int64 each.
    per_rank = sum(-(-p.shape[0] // 2) * p[0].numel() * 4 for p in model.parameters()) + 2 * 8
    assert [(e.dtype, e.numel) for e in gathers] == [(torch.uint8, 2 * per_rank)], [(e.dtype, e.numel) for e in gathers]


# The other extension points: a user's collectives and the all-reduce hook ------------------
@checks()
def custom_collectives_an_all_reduce_hook_and_a_separate_reduce_scatter_group_train_like_the_reference(mesh, impl):
    from gloo_parity import Stack, shard_blocks_then_root

    p = Parity.build(Stack, shard_blocks_then_root(impl, mesh), mesh, impl)
    gather, reduce = UserComm("all_gather"), UserComm("reduce_scatter")
    p.model.blocks[0].set_custom_all_gather(gather)
    p.model.blocks[0].set_custom_reduce_scatter(reduce)
    halved = []
    p.model.blocks[1].set_all_reduce_hook(lambda reduced: halved.append(reduced.mul_(0.5)))
    p.model.blocks[1].set_separate_reduce_scatter_group()
    for step, batch in enumerate(stack_batches(STEPS)):
        result = p.forward_backward(batch)
        assert_close(result.loss, result.ref_loss, f"loss at step {step}")
        for name, param in p.model.named_parameters():  # blocks.1's gradients halved by the hook
            scale = 0.5 if name.startswith("blocks.1.") else 1.0
            ref = dict(p.ref.named_parameters())[name]
            assert_close(param.grad.full_tensor(), ref.grad * scale, f"grad {name} at step {step}")
            ref.grad.mul_(scale)  # the reference takes the same step
        p.optimizer_step()
    p.assert_params_match()
    assert (gather.calls, reduce.calls, len(halved)) == (2 * STEPS, STEPS, STEPS), (gather.calls, reduce.calls, len(halved))


# What the all-reduce hook receives: FSDP2's tensor, on gloo too --------------------------
HOOK_CASES = {  # name: (mesh shape, reduce dtype, force_sum, gradient divide factor)
    "1d-fp32": ((2,), None, False, None),
    "1d-bf16": ((2,), torch.bfloat16, False, None),
    "1d-fp16": ((2,), torch.float16, False, None),
    "1d-fp64": ((2,), torch.float64, False, None),
    "1d-force-sum": ((2,), None, True, None),
    "1d-factor-3": ((2,), None, False, 3.0),
    "1d-fp16-factor-4": ((2,), torch.float16, False, 4.0),
    "hsdp-2x1-fp32": ((2, 1), None, False, None),
    "hsdp-1x2-fp32": ((1, 2), None, False, None),
    "hsdp-2x1-fp16": ((2, 1), torch.float16, False, None),
}


def hooked_reductions(mesh_shape, reduce_dtype, force_sum, factor, fully_shard) -> tuple[list[torch.Tensor], dict]:
    """What the hook of every group receives in one backward (copies, in call order), and the
    gradients after it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("dp",)
    mesh = DeviceMesh("cpu", torch.arange(2).view(mesh_shape), mesh_dim_names=names)
    torch.manual_seed(0)
    model = Tiny()
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    seen: list[torch.Tensor] = []
    for m in (*model.blocks, model):
        m.set_force_sum_reduction_for_comms(force_sum)
        if factor is not None:
            m.set_gradient_divide_factor(factor)
        m.set_all_reduce_hook(lambda reduced: seen.append(reduced.clone()))
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    model(torch.randn(4, 8, generator=g)).sum().backward()
    return seen, {n: p.grad.full_tensor() for n, p in model.named_parameters()}


@checks("shardkit")
def the_all_reduce_hook_receives_fsdp2s_tensor_for_every_reduce_dtype_mesh_and_knob(mesh, impl):
    for case, args in HOOK_CASES.items():
        mesh_shape, reduce_dtype, force_sum, factor = args
        ours, our_grads = hooked_reductions(*args, FULLY_SHARD["shardkit"])
        scale = 1.0
        if factor is not None and reduce_dtype in (None, torch.bfloat16) and not force_sum:
            # FSDP2 divides by a factor inside the reduce-scatter (ReduceOp.PREMUL_SUM), which
            # gloo refuses: its tensor is then its average over the 2 ranks, times 2 / factor.
            theirs, their_grads = hooked_reductions(mesh_shape, reduce_dtype, force_sum, None, FULLY_SHARD["torch"])
            scale = 2 / factor
        else:
            theirs, their_grads = hooked_reductions(*args, FULLY_SHARD["torch"])
        assert len(ours) == len(theirs) == 3, (case, len(ours), len(theirs))
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), (case, i, a.dtype, a.shape, b.dtype, b.shape)
            torch.testing.assert_close(a, b * scale, msg=lambda m: f"{case}: hook call {i}: {m}")
        for name, grad in our_grads.items():
            torch.testing.assert_close(grad, their_grads[name] * scale, msg=lambda m: f"{case}: grad {name}: {m}")


# torchao float8 training ------------------------------------------------------------------
def float8_model() -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 64, bias=False), nn.LayerNorm(64), nn.Linear(64, 32, bias=False)) for _ in range(2)]
    model = nn.Sequential(*blocks)
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return model


def float8_losses(mesh: DeviceMesh, fully_shard, **kwargs) -> list[torch.Tensor]:
    return float8_training(mesh, fully_shard, **kwargs)[1]


def float8_training(mesh: DeviceMesh, fully_shard, backend: str | None = None, **kwargs) -> tuple[nn.Module, list[torch.Tensor]]:
    """The float8 model sharded per block and at the root (``kwargs`` to each call), compiled
    whole with ``backend`` if one is given, STEPS AdamW steps: the model and its losses."""
    model = float8_model()
    for block in model:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    run = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randn(16, 32, generator=g).chunk(mesh.size())[mesh.get_local_rank()]
        loss = run(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(loss.detach(), mesh))
    return model, losses


@checks("shardkit")
def torchao_float8_weights_gather_one_byte_per_element_and_match_fsdp2(mesh, impl):
    with shardkit.trace() as t:
        ours = float8_losses(mesh, shardkit.fully_shard)
    theirs = float8_losses(mesh, FULLY_SHARD["torch"])
    for step, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=f"loss at step {step}")
    # Per block: 2 float8 weights of 32*64 elements (1 byte each) and the LayerNorm's 2*64 fp32
    # (4 bytes): 4096 + 512 bytes, as one uint8 all-gather.
    block_gathers = {e.numel for e in t.collectives() if e.kind == "all_gather" and e.group != "<root>"}
    assert block_gathers == {2 * 32 * 64 + 2 * 64 * 4}, block_gathers


# torchao NF4 (QLoRA) --------------------------------------------------------------------------
class LoRALinear(nn.Module):
    """A frozen NF4 base weight and a trainable bf16 low-rank adapter."""

    def __init__(self, dim: int = 256, rank: int = 4) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        base = torch.randn(dim, dim, dtype=torch.bfloat16) / dim**0.5
        self.weight = nn.Parameter(to_nf4(base), requires_grad=False)
        self.a = nn.Linear(dim, rank, bias=False, dtype=torch.bfloat16)
        self.b = nn.Linear(rank, dim, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight) + self.b(self.a(x))


class QLoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([LoRALinear(), LoRALinear()])

    def forward(self, x):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def qlora_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x).float(), y)


@checks()
def torchao_nf4_qlora_trains_like_the_unsharded_reference(mesh, impl):
    def shard(model):
        for block in model.blocks:
            FULLY_SHARD[impl](block, mesh=mesh)
        FULLY_SHARD[impl](model, mesh=mesh)

    p = Parity.build(QLoRA, shard, mesh, impl, loss_of=qlora_loss, optimizer=torch.optim.SGD, lr=0.5)
    p.ref_initial = {n: q.detach().float().clone() for n, q in p.ref.named_parameters() if q.requires_grad}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 256, generator=g).bfloat16(), torch.randn(8, 256, generator=g)) for _ in range(STEPS)]
    bf16 = dict(atol=2e-2, rtol=2e-2)  # the halves' bf16 gradients are rounded before they are summed
    for step, batch in enumerate(batches):
        result = p.forward_backward(batch)
        torch.testing.assert_close(result.loss, result.ref_loss, **bf16, msg=lambda m: f"loss at step {step}: {m}")
        p.optimizer_step()
    refs = dict(p.ref.named_parameters())
    trained = {name: param for name, param in p.model.named_parameters() if param.requires_grad}
    assert sorted(trained) == [f"blocks.{i}.{ab}.weight" for i in (0, 1) for ab in "ab"], sorted(trained)
    for name, param in trained.items():
        moved = (refs[name].detach().float() - p.ref_initial[name]).abs().max()
        assert moved > 1e-3, f"{name} did not train: {moved}"
        torch.testing.assert_close(param.full_tensor().float(), refs[name].detach().float(), **bf16, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_all_gather_extensions_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
