"""Models users bring, from transformers, on 2 gloo ranks: each decoder or encoder layer, then the
root, sharded by torch's FSDP2, by shardkit and by shardkit's compiled mode (run without
torch.compile), side by side in each rank from the same weights; three AdamW steps on each
rank's half of the batch. shardkit's gradients and parameters are FSDP2's bits; compiled mode's
are within float rounding (it sums, then divides); the loss is the unsharded model's on the whole
batch. The architectures differ where FSDP has to: GPT-2's Conv1D layers, BERT's pooler that a
masked-LM loss never uses (no gradient), T5's embedding shared by the encoder, the decoder and
the head, biases in the attention (Qwen2, OPT, GPT-NeoX), Gemma's scaled embedding, Phi-3's fused
projections, Falcon's parallel attention. (Llama and Mixtral compiled whole:
test_compiled_mode.py; transformers' checkpoints: test_pretrained.py.)"""

import copy

import pytest
import torch

from gloo_harness import Checks, run_worker
from gloo_parity import full, local, mean_over_ranks

checks = Checks()
VOCAB, STEPS = 64, 3


def models() -> dict:
    import transformers as hf

    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=32)
    return {
        "gpt2": (lambda: hf.GPT2LMHeadModel(hf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32)), lambda m: m.transformer.h),
        "bert": (lambda: hf.BertForMaskedLM(hf.BertConfig(**common)), lambda m: m.bert.encoder.layer),
        "t5": (lambda: hf.T5ForConditionalGeneration(hf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                                   decoder_start_token_id=0, pad_token_id=0)),
               lambda m: [*m.encoder.block, *m.decoder.block]),
        "qwen2": (lambda: hf.Qwen2ForCausalLM(hf.Qwen2Config(**common, num_key_value_heads=2)), lambda m: m.model.layers),
        "gemma": (lambda: hf.GemmaForCausalLM(hf.GemmaConfig(**common, num_key_value_heads=2, head_dim=8)), lambda m: m.model.layers),
        "opt": (lambda: hf.OPTForCausalLM(hf.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                                                       max_position_embeddings=32, word_embed_proj_dim=32)), lambda m: m.model.decoder.layers),
        "phi3": (lambda: hf.Phi3ForCausalLM(hf.Phi3Config(**common, num_key_value_heads=2, pad_token_id=0)), lambda m: m.model.layers),
        "gpt_neox": (lambda: hf.GPTNeoXForCausalLM(hf.GPTNeoXConfig(**common)), lambda m: m.gpt_neox.layers),
        "falcon": (lambda: hf.FalconForCausalLM(hf.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
                   lambda m: m.transformer.h),
    }


def _without_dropout(model: torch.nn.Module) -> torch.nn.Module:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(getattr(m, "dropout", None), float):  # OPT's and others' functional dropout
            m.dropout = 0.0
    return model


@checks("shardkit", sim=False)
def transformers_architectures_train_with_fsdp2s_numbers(mesh, impl):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import shardkit
    import shardkit.compiled

    for name, (build, layers) in models().items():
        torch.manual_seed(0)
        ref = _without_dropout(build())
        sides = {}
        for side, fully_shard in (("fsdp2", torch_fully_shard), ("shardkit", shardkit.fully_shard), ("compiled", shardkit.compiled.fully_shard)):
            model = copy.deepcopy(ref)
            for layer in layers(model):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            sides[side] = (model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        ref_optimizer = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        generator = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            ids = torch.randint(1, VOCAB, (4, 8), generator=generator)
            whole = ref(input_ids=ids, labels=ids).loss
            whole.backward()
            for side, (model, optimizer) in sides.items():
                (mine,) = local((ids,), mesh)
                loss = model(input_ids=mine, labels=mine).loss
                loss.backward()
                torch.testing.assert_close(mean_over_ranks(loss, mesh), whole, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}, {side}, step {step}: loss {m}")
            grads = {side: {n: full(p.grad) for n, p in model.named_parameters()} for side, (model, _) in sides.items()}
            assert {n for n, g in grads["fsdp2"].items() if g is None} == {n for n, g in grads["shardkit"].items() if g is None} \
                == {n for n, g in grads["compiled"].items() if g is None}, (name, step)  # BERT's pooler: None in all three
            for n, g in grads["fsdp2"].items():
                if g is not None:
                    assert torch.equal(grads["shardkit"][n], g), (name, step, n, (grads["shardkit"][n] - g).abs().max())
                    torch.testing.assert_close(grads["compiled"][n], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=lambda m: f"{name}, {n}: {m}")
            for _, optimizer in [*sides.values(), (ref, ref_optimizer)]:
                optimizer.step()
                optimizer.zero_grad()
        params = {side: {n: p.full_tensor() for n, p in model.named_parameters()} for side, (model, _) in sides.items()}
        assert all(torch.equal(params["shardkit"][n], p) for n, p in params["fsdp2"].items()), name
        for n, p in params["fsdp2"].items():
            torch.testing.assert_close(params["compiled"][n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}, {n}: {m}")


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_third_party_models_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
