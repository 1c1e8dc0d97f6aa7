"""The training step the planner profiles: the model in the step's dtype, fed the step's inputs,
scored by its loss, with activation checkpointing where asked for.

Without ``inputs_fn`` the step feeds random token ids (and, for the built-in GPT, targets) of
``seq_len``, else the model's context length, else 128. Without ``loss_fn`` the loss is
the loss the model returns, if it returns one (a scalar, a ``.loss``, a ``(logits, loss)``
pair: the GPT, Hugging Face models given labels); else cross-entropy of the logits against
random targets for the built-in Llama and for a factory fed those default token ids (a
training loop's separate targets), and for a factory fed ``inputs_fn``'s inputs what
``_default_loss`` says: cross-entropy against the last input when that is a tensor of class
indices.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.planner import profile as pp


def profile_step(model, groups, family, batch_size, seq_len, inputs_fn, loss_fn, param_dtype) -> pp.Profile:
    """Run the profile on the model as the step computes: in ``param_dtype`` if set."""
    if param_dtype is not None:
        _cast_params(model, param_dtype)
    config = getattr(model, "config", None)
    seq = seq_len or getattr(config, "block_size", None) or getattr(config, "max_seq", None) or 128
    vocab = getattr(config, "vocab_size", None) or _vocab(model)
    if inputs_fn is None:
        def inputs_fn(b: int, t: int) -> tuple:
            tokens = torch.randint(vocab, (b, t))
            return (tokens, torch.randint(vocab, (b, t))) if family == "gpt" else (tokens,)
        if family is None and loss_fn is None:
            loss_fn = _token_loss(vocab, batch_size, seq)
    loss_fn = loss_fn or (_default_loss if family != "llama" else _token_loss(vocab, batch_size, seq))
    modules = {g.name: (g.module if g.name else model) for g in groups}
    modules.setdefault("", model)
    owners = {p.fqn: g.name for g in groups for p in g.params}
    return pp.run(model, modules, owners, lambda: inputs_fn(batch_size, seq), loss_fn)


def checkpoint_forward(module: nn.Module) -> None:
    """Run ``module``'s forward under non-reentrant activation checkpointing (its hooks stay outside)."""
    from torch.utils.checkpoint import checkpoint

    forward = module.forward
    module.forward = lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters to ``dtype`` as new (fake) parameters; tied ones stay tied."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dtype.is_floating_point:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=p.device), p.requires_grad)
                setattr(module, name, new[id(p)])


def _vocab(model: nn.Module) -> int:
    """The first embedding's size: the vocabulary of a model with no ``config.vocab_size``."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return embeddings[0].num_embeddings if embeddings else 2


def _default_loss(output: Any, inputs: tuple) -> torch.Tensor:
    """The loss without ``loss_fn``, as a training loop would compute it from the output.

    The loss the model returns itself (``_own_loss``) is the loss. Otherwise the output (its
    first element, or its ``.logits``) of shape ``(..., classes)`` is scored by
    ``F.cross_entropy(out.reshape(-1, classes), target.reshape(-1))`` against the last input
    when that is an integer tensor of shape ``(...)`` (token ids or targets): its log-softmax
    and gradient temporaries are the size of the logits. Any other output is reduced by its
    mean, which has no such temporaries: pass ``loss_fn`` if the real loss has them.
    """
    own = _own_loss(output)
    if own is not None:
        return own
    out = _logits(output)
    target = inputs[-1] if inputs else None
    if _class_indices(target) and out.dim() >= 2 and target.shape == out.shape[:-1]:
        return F.cross_entropy(out.reshape(-1, out.size(-1)), target.reshape(-1).long())
    return out.float().mean()


def _own_loss(output: Any) -> torch.Tensor | None:
    """The loss a model returns itself: a scalar output, a scalar ``.loss`` (or ``["loss"]``,
    as Hugging Face outputs carry it), or the scalar of a ``(logits, loss)`` / ``(loss,
    logits)`` pair; None when it returns none."""
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() == 0:
        return loss
    if isinstance(output, (tuple, list)):
        scalars = [o for o in output[:2] if isinstance(o, torch.Tensor) and o.dim() == 0]
        return scalars[0] if scalars else None
    return None


def _logits(output: Any) -> torch.Tensor:
    """The output's logits: the output itself, its first element, or its ``.logits``."""
    if isinstance(output, dict):
        return output["logits"]
    return output[0] if isinstance(output, (tuple, list)) else getattr(output, "logits", output)


def _class_indices(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _token_loss(vocab: int, batch: int, seq: int):
    """Cross-entropy of logits against random targets (a language model's loss), or the loss
    the model returns itself."""
    def loss(output: Any, inputs: tuple) -> torch.Tensor:
        own = _own_loss(output)
        if own is not None:
            return own
        logits = _logits(output)
        targets = torch.randint(vocab, logits.shape[:-1])
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    return loss
