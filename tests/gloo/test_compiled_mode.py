"""shardkit.compiled on 2 gloo ranks: the demo GPT trained against the unsharded model and
against eager shardkit, compiled (fullgraph, aot_eager); mixed precision; checkpoints across
the two modes. (Peak memory: tests/fake/test_compiled_graphs.py; blocks as compile regions:
test_compiled_mode_regions.py; weights tied across calls and checkpoints across the modes:
test_compiled_mode_tied.py; inductor: test_compiled_mode_inductor.py; unused parameters:
test_compiled_mode_unused.py.) (The mode run without torch.compile is
in the fuzzer's call sequences, tests/fuzz, against the unsharded model.)

aot_eager runs AOTAutograd's graphs (with the min-cut partitioner inductor uses) op by op, so
compiled and eager runs of the same step give the same bits.
"""

import pytest
import torch

from compiled_parity import STEPS, assert_same_bits, shard, train
from gloo_harness import Checks, run_worker
from gloo_parity import Parity, gpt_batches, gpt_loss, one_block_gpt, small_gpt
from shardkit.core.policies import MixedPrecisionPolicy

checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)


@checks("shardkit", sim=False)
def gpt_trains_like_the_unsharded_model_and_eager_shardkit(mesh, impl):
    """Compiled as one graph (the mode run eagerly is the fuzzer's: tests/fuzz, Spec.compiled_mode)."""
    eager, eager_losses = train(mesh, "eager")
    for backend in ("aot_eager",):
        compiled, losses = train(mesh, "compiled", backend)
        assert [torch.equal(c, e) for c, e in zip(losses, eager_losses)] == [True] * STEPS, (backend, losses, eager_losses)
        compiled.assert_params_match()  # against the unsharded model
        assert_same_bits(compiled, eager, f"{backend} against eager shardkit")


@checks("shardkit", sim=False)
def on_gloo_the_reduce_scatter_is_an_all_to_all_and_a_sum(mesh, impl):
    """gloo's reduce-scatter is slow: each group's gradients travel in one functional
    all_to_all_single (a reduce-scatter's bytes) and are summed here, as eager mode does; the
    gradients are the unsharded model's."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name.startswith("_c10d_functional::") and name != "_c10d_functional::wait_tensor":
                self.ops[name.split("::")[1]] += 1
            return func(*args, **(kwargs or {}))

    p = Parity.build(small_gpt, shard("compiled", mesh), mesh, "compiled", loss_of=gpt_loss)
    with Seen() as seen:
        p.forward_backward(gpt_batches(1)[0])
    groups = 1 + len(p.model.blocks)
    assert seen.ops["all_to_all_single"] == groups and seen.ops["all_gather_into_tensor"] >= groups, seen.ops
    assert set(seen.ops) == {"all_gather_into_tensor", "all_to_all_single"}, seen.ops  # no reduce_scatter_tensor
    p.assert_grads_match()


@checks("shardkit", sim=False)
def fsdp_module_settings_match_eager_shardkit_bit_for_bit(mesh, impl):
    """set_gradient_divide_factor and set_reshard_after_forward, called on the modules as an
    FSDP2 user would (after fully_shard, before compiling): the same bits as eager shardkit
    with the same calls."""
    import shardkit.core.module

    def configure(model):
        for m in model.modules():
            if isinstance(m, shardkit.core.module.FSDPModule):
                m.set_gradient_divide_factor(3.0)
        model.set_reshard_after_forward(False)
        return model

    runs = {}
    for mode, backend in (("eager", None), ("compiled", "aot_eager")):
        torch._dynamo.reset()
        p = Parity.build(small_gpt, lambda model: (shard(mode, mesh)(model), configure(model)), mesh, "compiled", loss_of=gpt_loss)
        if backend is not None:
            p.model = torch.compile(p.model, backend=backend, fullgraph=True)
        for batch in gpt_batches(STEPS):
            p.forward_backward(batch)
            p.optimizer_step()
        runs[mode] = p
    assert_same_bits(runs["compiled"], runs["eager"], "divide factor 3, no reshard")


@checks("shardkit", sim=False)
def mixed_precision_and_accumulation_without_sync_match_eager_shardkit_bit_for_bit(mesh, impl):
    """bf16 parameters with fp32 reduction: a plain step (one batch), then two microbatches with
    set_requires_gradient_sync(False) and one with it on: the same losses and bits as eager
    shardkit (the same casts; the kept unsharded gradients summed in reduce_dtype, added before
    the one reduce-scatter), gradients in the shards' fp32. (In fp32, the summed gradients
    against the unsharded model's: test_compiled_mode_kept.py, and without torch.compile the
    fuzzer's call sequences.) One block: the settings are per group."""
    for policy in (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),):
        runs, losses = {}, {}
        for mode, backend in (("eager", None), ("compiled", "aot_eager")):
            torch._dynamo.reset()
            p = Parity.build(one_block_gpt, shard(mode, mesh, mp_policy=policy), mesh, "compiled", loss_of=gpt_loss)
            run = p.model if backend is None else torch.compile(p.model, backend=backend, fullgraph=True)
            sharded, p.model, losses[mode] = p.model, run, []
            for step, microbatches in enumerate((1, 3)):
                for i, batch in enumerate(gpt_batches(microbatches, seed=10 + step)):
                    sharded.set_requires_gradient_sync(i == microbatches - 1)
                    losses[mode].append(p.forward_backward(batch).loss)
                    if i < microbatches - 1:
                        assert all(q.grad is None for q in sharded.parameters())  # nothing reduced yet
                assert all(q.grad.dtype == q.dtype for q in sharded.parameters())  # fp32 grads of fp32 shards
                p.optimizer_step()
            runs[mode] = p
        what = f"{policy.param_dtype}: plain steps and accumulation without sync"
        assert [torch.equal(c, e) for c, e in zip(losses["compiled"], losses["eager"])] == [True] * 4, (what, losses)
        assert_same_bits(runs["compiled"], runs["eager"], what)


@checks("shardkit", sim=False)
def frozen_parameters_beside_trainable_ones_match_eager_shardkit_bit_for_bit(mesh, impl):
    """The block's attention frozen (as LoRA freezes a base): its group reduce-scatters only the
    trainable parameters (gather.Cut), frozen ones keep ``grad=None``. Two steps, two microbatches
    without sync and one with it, then the attention unfrozen (a new graph) and one more step:
    the same losses and bits as eager shardkit, and the unsharded model's parameters."""
    def frozen_gpt():
        model = one_block_gpt()
        model.blocks[0].attn.requires_grad_(False)
        return model

    runs, losses = {}, {}
    for mode, backend in (("eager", None), ("compiled", "aot_eager")):
        torch._dynamo.reset()
        p = Parity.build(frozen_gpt, shard(mode, mesh), mesh, "compiled", loss_of=gpt_loss)
        sharded = p.model
        if backend is not None:
            p.model = torch.compile(p.model, backend=backend, fullgraph=True)
        losses[mode] = [step.loss for step in p.train(gpt_batches(2))]
        for i, batch in enumerate(gpt_batches(3, seed=20)):
            sharded.set_requires_gradient_sync(i == 2)
            losses[mode].append(p.forward_backward(batch).loss)
        p.assert_grads_match()
        p.optimizer_step()
        for model in (sharded, p.ref):
            model.blocks[0].attn.requires_grad_(True)
        losses[mode] += [step.loss for step in p.train(gpt_batches(1, seed=30))]
        p.assert_params_match()
        runs[mode] = p
    assert [torch.equal(c, e) for c, e in zip(losses["compiled"], losses["eager"])] == [True] * 6, losses
    assert_same_bits(runs["compiled"], runs["eager"], "frozen attention, then unfrozen")


@checks("shardkit", sim=False)
def transformers_models_compile_as_one_graph_and_train_like_the_unsharded_model(mesh, impl):
    """Models users bring, from transformers, one decoder layer each: LlamaForCausalLM
    (grouped-query attention, rotary embeddings, the embedding tied to the head) and
    MixtralForCausalLM (a mixture of 4 experts, 2 per token: routing that depends on the data,
    experts some rank's tokens skip). Each decoder layer then the root sharded in compiled mode
    and compiled whole (fullgraph, aot_eager): one graph, and 3 AdamW steps with the unsharded
    model's losses and gradients. (Eager mode with transformers' checkpoints: test_pretrained.py.)"""
    import transformers
    from torch._dynamo.utils import counters

    import shardkit.compiled

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    models = {"llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, tie_word_embeddings=True)),
              "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))}

    def sharded(model):
        for layer in model.model.layers:
            shardkit.compiled.fully_shard(layer, mesh=mesh)
        shardkit.compiled.fully_shard(model, mesh=mesh)

    for name, build in models.items():
        torch._dynamo.reset()
        counters.clear()
        p = Parity.build(build, sharded, mesh, "compiled", loss_of=lambda model, batch: model(input_ids=batch[0], labels=batch[1]).loss)
        p.model = torch.compile(p.model, backend="aot_eager", fullgraph=True)
        p.train(gpt_batches(STEPS))
        p.assert_params_match()
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], (name, dict(counters["stats"]), dict(counters["graph_break"]))


@checks("shardkit", sim=False)
def hook_based_spectral_and_weight_norm_train_as_fsdp2(mesh, impl):
    """``nn.utils.spectral_norm`` and ``nn.utils.weight_norm`` (the hook-based forms, still in
    GAN and vocoder code) compute the weight in a forward pre-hook, from the parameters: each
    normed layer sharded as a group, then the root, compiled whole (fullgraph, aot_eager), 3 SGD
    steps on each rank's half of the batch give FSDP2's losses and parameters bit for bit (and
    the unsharded model's).
    (Compiled mode gathered after the hooks and failed with "got mixed torch.Tensor and DTensor".)"""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit.compiled
    from gloo_parity import full, local, mean_over_ranks

    def normed() -> torch.nn.Sequential:  # (built anew each time: a hook-based weight_norm cannot be deep-copied)
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.utils.spectral_norm(torch.nn.Linear(8, 8)), torch.nn.Tanh(), torch.nn.utils.weight_norm(torch.nn.Linear(8, 4)))

    ref = normed()
    sides = {}
    for side, fully_shard in (("fsdp2", torch_fully_shard), ("compiled", shardkit.compiled.fully_shard)):
        model = normed()
        fully_shard(model[0], mesh=mesh)
        fully_shard(model[2], mesh=mesh)
        fully_shard(model, mesh=mesh)
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if side == "compiled" else model
        sides[side] = (model, run, torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(1)
    for step in range(3):
        batch = torch.randn(4, 8)
        whole = ref(batch).pow(2).mean()
        whole.backward()
        losses = {}
        for side, (model, run, opt) in sides.items():
            loss = run(*local((batch,), mesh)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[side] = mean_over_ranks(loss, mesh)
        optimizer.step()
        optimizer.zero_grad()
        assert torch.equal(losses["compiled"], losses["fsdp2"]), (step, losses)
        torch.testing.assert_close(losses["fsdp2"], whole.detach(), rtol=1e-5, atol=1e-6)
    params = {side: {n: full(p) for n, p in model.named_parameters()} for side, (model, _, _) in sides.items()}
    assert all(torch.equal(params["compiled"][n], p) for n, p in params["fsdp2"].items()), params
    for n, p in ref.named_parameters():  # the unsharded model's, on the whole batch
        torch.testing.assert_close(params["fsdp2"][n], p.detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compiled_mode_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
