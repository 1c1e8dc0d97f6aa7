"""Lifecycle cases FSDP2 users meet, on 2 gloo ranks against an unsharded reference: parameters
replaced before the first forward, meta-device init with ``load_state_dict(assign=True)``, a
group whose module is also called on its own (chunked loss), two forwards then one backward
under activation checkpointing, ``.to(dtype)`` after ``fully_shard``, a module replacing its
own parameter's data in forward (HF SwitchTransformers' router), zero-size parameters, evaluation
under ``inference_mode`` or ``no_grad`` before and between steps, a gradient penalty (a backward
with ``create_graph=True``, then one through it).
"""


import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.checkpoint import checkpoint

import shardkit
from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Parity, Stack, assert_close, full, local, mean_over_ranks, stack_batches

checks = Checks()
STEPS = 3
POLICY_MP = {"shardkit": shardkit.MixedPrecisionPolicy, "torch": torch.distributed.fsdp.MixedPrecisionPolicy}


class Tokens(nn.Module):
    """A small LM whose head is left out of forward: the loss calls it per chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 20)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.norm(h)


def chunked_loss(model, batch):
    ids, targets = batch
    h = model(ids)
    losses = [F.cross_entropy(model.head(c).flatten(0, 1), t.flatten(), reduction="sum") for c, t in zip(h.chunk(2, 1), targets.chunk(2, 1))]
    return sum(losses) / targets.numel()


def token_batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, 20, (4, 6), generator=g) for _ in range(2)) for _ in range(n)]


@checks()
def a_group_of_norm_and_head_with_the_head_called_alone_matches_the_reference(mesh, impl):
    def shard(m):
        for block in m.blocks:
            FULLY_SHARD[impl](block, mesh=mesh)
        FULLY_SHARD[impl]([m.norm, m.head], mesh=mesh)
        FULLY_SHARD[impl](m, mesh=mesh)

    for accumulate in (False, True):
        p = Parity.build(Tokens, shard, mesh, impl, loss_of=chunked_loss, optimizer=torch.optim.SGD, lr=0.5)
        for step, (ids, targets) in enumerate(token_batches(STEPS)):
            micro = [(ids[:2], targets[:2]), (ids[2:], targets[2:])] if accumulate else [(ids, targets)]
            for i, batch in enumerate(micro):
                if accumulate:
                    p.model.set_requires_gradient_sync(i == len(micro) - 1)
                result = p.forward_backward(batch, scale=1 / len(micro))
                assert_close(result.loss, result.ref_loss, f"loss at step {step}, microbatch {i}")
            p.assert_grads_match()
            p.optimizer_step()
        p.assert_params_match()


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class Checkpointed(nn.Module):
    def __init__(self, by_function: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Residual() for _ in range(3)])
        self.out = nn.Linear(8, 3)
        self.by_function = by_function

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.by_function else block(x)
        return self.out(x)


def two_forwards_loss(model, batch):
    x, y = batch
    first, second = x.chunk(2, dim=1)  # two inputs of 8 features each
    return F.mse_loss(model(first), y) + F.mse_loss(model(second), y)


@checks()
def two_forwards_then_one_backward_with_nested_groups_and_checkpointing(mesh, impl):
    for how in ("checkpoint()", "checkpoint_wrapper", "fully_shard inside checkpoint"):
        def shard(m):
            if how == "checkpoint_wrapper":
                for i, block in enumerate(m.blocks):
                    m.blocks[i] = checkpoint_wrapper(block)
            for block in m.blocks:
                if how == "fully_shard inside checkpoint":
                    FULLY_SHARD[impl](block.a, mesh=mesh)  # nested: a group inside a checkpointed one
                FULLY_SHARD[impl](block, mesh=mesh)
            FULLY_SHARD[impl](m, mesh=mesh)

        p = Parity.build(lambda: Checkpointed(how != "checkpoint_wrapper"), shard, mesh, impl, loss_of=two_forwards_loss)
        g = torch.Generator().manual_seed(2)
        batches = [(torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)) for _ in range(STEPS)]
        p.train(batches)
        p.assert_params_match()


# Parameters replaced before the first forward ------------------------------------------------
class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 13), nn.Linear(13, 3)])

    def forward(self, x):
        return self.blocks[1](torch.tanh(self.blocks[0](x)))


@checks()
def a_parameter_assigned_after_fully_shard_is_picked_up_at_lazy_init(mesh, impl):
    # FSDP2 takes a DTensor like its own; shardkit also a full tensor, which it shards.
    for kind in ("dtensor", "full") if impl == "shardkit" else ("dtensor",):
        assign_then_train(mesh, impl, kind)


def assign_then_train(mesh, impl: str, kind: str) -> None:
    torch.manual_seed(0)
    ref = Pair()
    with torch.device("meta"):
        model = Pair()
    for block in model.blocks:
        FULLY_SHARD[impl](block, mesh=mesh)
    FULLY_SHARD[impl](model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():  # what an init function would do: one new parameter, the rest copied in place
        new = ref.blocks[0].weight.detach().clone()
        if kind == "dtensor":
            new = distribute_tensor(new, mesh, [Shard(0)])
        model.blocks[0].weight = nn.Parameter(new)
        for name, param in model.named_parameters():
            if name != "blocks.0.weight":
                param.to_local().copy_(local_rows(ref.get_parameter(name), param))
    if kind == "full":  # sharded at lazy init into a new Parameter: build the optimizer after it
        with torch.no_grad():
            model(torch.zeros(1, 8))
    p = Parity(model, ref, mesh, impl, loss_of=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    assert isinstance(model.blocks[0].weight, DTensor)


def local_rows(full_tensor: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """This rank's rows of a full tensor, shaped like ``sharded``'s local tensor."""
    return distribute_tensor(full_tensor.detach(), sharded.device_mesh, sharded.placements, src_data_rank=None).to_local()


@checks()
def meta_init_then_load_state_dict_with_assign_trains(mesh, impl):
    def sharded(device):
        torch.manual_seed(0)
        with torch.device(device):
            m = Pair()
        for block in m.blocks:
            FULLY_SHARD[impl](block, mesh=mesh)
        FULLY_SHARD[impl](m, mesh=mesh)
        return m

    torch.manual_seed(0)
    ref = Pair()
    source = sharded("cpu")  # the same values as ref: a checkpoint, already sharded
    model = sharded("meta")
    model.load_state_dict(source.state_dict(), assign=True)
    p = Parity(model, ref, mesh, impl, loss_of=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    p.train(stack_batches(STEPS))
    p.assert_params_match()


# Dtypes -------------------------------------------------------------------------------------
class Router(nn.Module):
    """HF SwitchTransformers' router: it casts its own classifier to fp32 in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        self.classifier = self.classifier.to(torch.float32)  # sets param.data to an fp32 copy
        return torch.softmax(self.classifier(x.float()), dim=-1)


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.router = Router()

    def forward(self, x):
        return self.router(self.inp(x))


@checks("shardkit")  # FSDP2 computes every later step with the step-0 weights here
def a_router_casting_its_own_weights_in_forward_uses_each_steps_weights(mesh, impl):
    """Every step's router must compute with that step's weights (bf16-rounded by the
    all-gather, then cast to fp32 by the router), never an earlier step's."""
    torch.manual_seed(0)
    model = Routed()
    used = []
    model.router.register_forward_pre_hook(lambda m, args: used.append(m.classifier.weight.detach().float().clone()))
    MP = POLICY_MP[impl]
    FULLY_SHARD[impl](model.router, mesh=mesh, mp_policy=MP(param_dtype=torch.bfloat16))
    FULLY_SHARD[impl](model, mesh=mesh, mp_policy=MP(param_dtype=torch.bfloat16))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for step, (x, _) in enumerate(stack_batches(STEPS)):
        current = full(model.router.classifier.weight).to(torch.bfloat16).float()
        loss = model(local((x,), mesh)[0]).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(used[-1], current, atol=0, rtol=0, msg=lambda m: f"router weights at step {step}: {m}")


@checks()
def to_float32_after_fully_shard_keeps_the_mixed_precision_policy(mesh, impl):
    from gloo_parity import stack_loss

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = Stack()
        MP = POLICY_MP[impl]
        for block in model.blocks:
            FULLY_SHARD[impl](block, mesh=mesh, mp_policy=MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        FULLY_SHARD[impl](model, mesh=mesh, mp_policy=MP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        seen = []
        model.blocks[0].lin.register_forward_hook(lambda m, i, o: seen.append((m.weight.dtype, o.dtype)))
        model.to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in stack_batches(2):
            x, y = local(batch, mesh)
            stack_loss(model, (x.to(dtype), y.to(dtype))).backward()
            opt.step()
            opt.zero_grad()
        assert seen == [(torch.bfloat16, torch.bfloat16)] * 2, (dtype, seen)
        assert {p.dtype for p in model.parameters()} == {dtype}, dtype


# Zero-size parameters -------------------------------------------------------------------------
class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)
        self.rows, self.cols, self.flat = (nn.Parameter(torch.zeros(s)) for s in [(0, 5), (5, 0), (0,)])

    def forward(self, x):
        return self.lin(x) + self.rows.sum() + self.cols.sum() + self.flat.sum()


@checks("shardkit")  # FSDP2 fails on them: "_chunk_cat expects non-empty tensor"
def parameters_with_a_zero_size_dim_train(mesh, impl):
    p = Parity.build(WithEmpty, lambda m: FULLY_SHARD[impl](m, mesh=mesh), mesh, impl)
    p.train(stack_batches(STEPS))
    p.assert_params_match()
    shapes = {name: tuple(q.shape) for name, q in p.model.named_parameters()}
    assert [shapes[n] for n in ("rows", "cols", "flat")] == [(0, 5), (5, 0), (0,)], shapes


# What FSDP2 refuses and shardkit computes correctly --------------------------------------------
class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 6)
        self.lin.weight = nn.Parameter(torch.randn(8, 6).t())  # (6, 8), strides (1, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x)))


@checks("shardkit")  # FSDP2: NotImplementedError, "FSDP does not support non-contiguous parameters yet"
def a_non_contiguous_parameter_trains_like_the_reference(mesh, impl):
    p = Parity.build(Transposed, lambda m: FULLY_SHARD[impl](m, mesh=mesh), mesh, impl, loss_of=lambda m, b: F.mse_loss(m(b[0]), b[1]))
    p.train(stack_batches(STEPS))
    p.assert_params_match()


@checks("shardkit")  # FSDP2: AssertionError, "Please init the 2D mesh for HSDP with mesh_dim_names specified"
def a_2d_mesh_without_dim_names_is_hsdp(mesh, impl):
    from torch.distributed.device_mesh import DeviceMesh

    for shape in [(2, 1), (1, 2)]:
        hsdp = DeviceMesh("cpu", torch.arange(mesh.size()).view(shape))
        p = Parity.build(Pair, lambda m: FULLY_SHARD[impl](m, mesh=hsdp), mesh, impl, loss_of=lambda m, b: F.mse_loss(m(b[0]), b[1]))
        p.train(stack_batches(STEPS))
        p.assert_params_match()
        assert p.model.blocks[0].weight.placements[0].is_replicate(), shape


def blocks_then_root(impl: str, mesh, reshard_after_forward: bool):
    """Shard each of a Stack's blocks with ``reshard_after_forward``, then the root."""
    def shard(m):
        for block in m.blocks:
            FULLY_SHARD[impl](block, mesh=mesh, reshard_after_forward=reshard_after_forward)
        FULLY_SHARD[impl](m, mesh=mesh)

    return shard


# Evaluation under inference_mode / no_grad ---------------------------------------------------------
@checks("shardkit")  # FSDP2: inference_mode first fails the training forward; no_grad gives wrong steps
def evaluation_under_inference_mode_or_no_grad_before_and_between_steps_matches_the_reference(mesh, impl):
    """A validation pass before training (Lightning's sanity check runs under inference_mode),
    the optimizer made after it, and one between steps. FSDP2 (2.13) fails the first training
    forward after an inference_mode one ("Inplace update to inference tensor outside
    InferenceMode"); after a no_grad one its root still holds the unsharded parameters, so an
    optimizer made then steps those, and training goes on to other numbers with no error."""
    for mode in (torch.inference_mode, torch.no_grad):
        for reshard_after_forward in (True, False):
            p = Parity.build(Stack, blocks_then_root(impl, mesh, reshard_after_forward), mesh, impl)
            probe = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
            for i, batch in enumerate(stack_batches(STEPS)):
                with mode():
                    out, ref_out = p.model(probe), p.ref(probe)
                assert_close(out, ref_out, f"{mode.__name__}, reshard_after_forward={reshard_after_forward}: evaluation before step {i}")
                if i == 0:
                    p.__post_init__()  # the optimizers, made after the first evaluation
                result = p.step(batch)
                assert_close(result.loss, result.ref_loss, f"{mode.__name__}, reshard_after_forward={reshard_after_forward}: loss at step {i}")
            p.assert_params_match()


# A gradient penalty: a backward with create_graph=True, then one through it ------------------------
@checks("shardkit")  # FSDP2 (2.13): the second backward fails, "setStorage: ... out of bounds for storage of size 0"
def a_gradient_penalty_through_a_create_graph_backward_matches_the_reference(mesh, impl):
    """WGAN-GP's and R1's penalty: the gradient of the output with respect to the input, taken
    with create_graph=True, squared into the loss, then one backward through both. The graph
    that first backward makes reads the unsharded parameters in the second, so it leaves them
    unsharded; the second reduces and reshards as usual. With the plain loss added, and alone
    every other step between plain steps (as GAN training alternates), both
    reshard_after_forward values, 4 AdamW steps: the reference's gradients (None where its are:
    the penalty does not reach the output's bias) and parameters, and every parameter sharded
    again after each step's backward. And loss.backward(create_graph=True) with no backward
    through it: the parameters it left unsharded are not used stale after the optimizer step
    (the next forward's loss is the reference's)."""
    world = mesh.size()
    for reshard_after_forward in (True, False):
        p = Parity.build(Stack, blocks_then_root(impl, mesh, reshard_after_forward), mesh, impl)
        for i, batch in enumerate(stack_batches(3)):
            losses = []
            for model, (x, y) in ((p.model, local(batch, mesh)), (p.ref, batch)):
                losses.append(F.mse_loss(model(x), y))
                losses[-1].backward(create_graph=True)
            assert_close(mean_over_ranks(losses[0], mesh), losses[1].detach(), f"nothing through create_graph, reshard_after_forward={reshard_after_forward}: loss at step {i}")
            p.assert_grads_match()
            p.optimizer_step()
        p.assert_params_match()
    for variant in ("with the loss", "alone"):
        for reshard_after_forward in (True, False):
            p = Parity.build(Stack, blocks_then_root(impl, mesh, reshard_after_forward), mesh, impl)
            what = f"penalty {variant}, reshard_after_forward={reshard_after_forward}"
            for i, batch in enumerate(stack_batches(4)):
                penalized = variant == "with the loss" or i % 2 == 0
                for model, (x, y), share in ((p.model, local(batch, mesh), 1), (p.ref, batch, world)):
                    x = x.clone().requires_grad_(penalized)
                    out = model(x)
                    loss = F.mse_loss(out, y)
                    if penalized:  # each rank's rows' share of the penalty: the reference's is the sum over all rows
                        grad_x, = torch.autograd.grad(out.sum(), x, create_graph=True)
                        penalty = grad_x.pow(2).sum() / share
                        loss = penalty if variant == "alone" else loss + penalty
                    loss.backward()
                assert all(isinstance(q, DTensor) for q in p.model.parameters()), f"{what}: unsharded after step {i}'s backward"
                try:
                    p.assert_grads_match()
                except AssertionError as e:
                    raise AssertionError(f"{what}, step {i}: {e}") from None
                p.optimizer_step()
            p.assert_params_match()


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_lifecycle_cases_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
