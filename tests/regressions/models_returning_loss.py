"""Factories for ``shardkit.plan("tests.regressions.models_returning_loss:NAME", ...)``: small
language models that compute their own loss, as Hugging Face models given labels do."""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM = 32, 16


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return x + torch.relu(self.lin(x))


class _LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def logits_and_loss(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, -2), idx.roll(-1, 1).flatten())


class ScalarLoss(_LM):
    def forward(self, idx):
        return self.logits_and_loss(idx)[1]


@dataclass
class Output:  # a Hugging Face ModelOutput's shape: .loss and .logits
    loss: torch.Tensor
    logits: torch.Tensor


class LossAttribute(_LM):
    def forward(self, idx):
        logits, loss = self.logits_and_loss(idx)
        return Output(loss, logits)


class LossFirst(_LM):  # Hugging Face with return_dict=False: (loss, logits)
    def forward(self, idx):
        logits, loss = self.logits_and_loss(idx)
        return loss, logits


def scalar():
    return ScalarLoss()


def loss_attribute():
    return LossAttribute()


def loss_first():
    return LossFirst()


def logits_only():  # for comparison: the planner's own loss on the logits
    return _LM()
