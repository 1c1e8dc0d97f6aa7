"""A small Llama-style transformer for 2-D (tensor parallel + shardkit) tests and examples.

RMSNorm, rotary position embeddings (a non-persistent ``inv_freq`` buffer), attention with
separate q/k/v/o projections, a SwiGLU MLP, an untied output head. Attention infers its head
count from the projection's output, so the same code runs whole or with its heads split by
tensor parallel. ``tp_plan()`` is the usual Megatron plan for ``parallelize_module``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LlamaConfig:
    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    hidden: int = 64  # SwiGLU width
    max_seq: int = 32
    n_kv_heads: int | None = None  # grouped-query attention: fewer key/value heads (None: n_heads)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x (B, T, H, D) by position."""
    t = torch.arange(x.shape[1], device=x.device, dtype=inv_freq.dtype)
    angles = torch.outer(t, inv_freq)  # (T, D/2)
    # in x's dtype: under mixed precision the fp32 buffer must not promote q and k to fp32
    cos, sin = (f(angles)[None, :, None, :].to(x.dtype) for f in (torch.cos, torch.sin))
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = c.dim // c.n_heads
        kv_dim = (c.n_kv_heads or c.n_heads) * self.head_dim
        self.wq = nn.Linear(c.dim, c.dim, bias=False)
        self.wk, self.wv = nn.Linear(c.dim, kv_dim, bias=False), nn.Linear(c.dim, kv_dim, bias=False)
        self.wo = nn.Linear(c.dim, c.dim, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: all of them, or this rank's share under tensor parallel
        q, k, v = (w(x).view(B, T, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, self.inv_freq), rotate(k, self.inv_freq)
        if k.shape[2] != q.shape[2]:  # grouped-query attention: each key/value head serves several query heads
            k, v = (t.repeat_interleave(q.shape[2] // t.shape[2], dim=2) for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(c.dim), Attention(c)
        self.ffn_norm, self.feed_forward = RMSNorm(c.dim), FeedForward(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim)
        self.output = nn.Linear(c.dim, c.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # (B, T, vocab)


def tp_plan() -> dict:
    """Column-parallel in, row-parallel out, per block (``parallelize_module(block, tp_mesh, tp_plan())``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }


def sequence_parallel_plans() -> tuple[dict, dict]:
    """torchtitan's plans with sequence parallel, ``(root plan, block plan)``: the norms
    ``SequenceParallel`` (their weights replicated over tp, their gradients partial sums),
    activations split along the sequence between blocks, the logits whole on every tp rank.
    ``parallelize_module(model, tp_mesh, root)`` and ``parallelize_module(block, tp_mesh, block_plan)``
    for each block; the sequence length must divide by the tp size."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    gathered = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    block = {
        "attention_norm": SequenceParallel(),
        "attention": gathered,
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": gathered,
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    return root, block
