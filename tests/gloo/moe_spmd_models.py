"""Models for FSDP2's per-parameter meshes (a small MoE block: experts over an expert-FSDP
mesh, the dense layers over the whole data-parallel mesh) and for full SPMD meshes
(``dp_mesh_dims``: parameters already DTensors on a (dp..., tp) mesh). Used by the fake
process-group tests (placements, collectives) and the 4-rank gloo tests (numerics)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_gather_tensor_autograd, reduce_scatter_tensor_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

D, H, E = 8, 16, 4  # model width, expert hidden width, experts


class Experts(nn.Module):
    """``E`` two-layer experts as batched weights. Plain weights: every expert on every token
    (the reference). Weights that are DTensors split by ``Shard(0)`` over an expert-parallel
    mesh: this rank's experts run on the tokens of its whole ep group (all-gathered), and the
    outputs go back to their ranks summed (reduce-scatter), both with autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, H) * 0.3)
        self.w2 = nn.Parameter(torch.randn(E, H, D) * 0.3)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.w1, self.w2
        if not isinstance(w1, DTensor):
            return _experts(x, gates, w1, w2)
        mesh = w1.device_mesh
        group, ep, rank = mesh.get_group(), mesh.size(), mesh.get_local_rank()
        xs = all_gather_tensor_autograd(x, gather_dim=0, group=group)
        local = E // ep
        gs = all_gather_tensor_autograd(gates, gather_dim=0, group=group)[:, rank * local : (rank + 1) * local]
        ys = _experts(xs, gs, w1.to_local(), w2.to_local())
        return reduce_scatter_tensor_autograd(ys, "sum", scatter_dim=0, group=group)


def _experts(x, gates, w1, w2):
    hidden = torch.einsum("td,edh->teh", x, w1).relu()
    return (torch.einsum("teh,ehd->ted", hidden, w2) * gates[..., None]).sum(1)


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = Experts()
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        gates = F.softmax(self.router(h), dim=-1)
        return self.out(x + self.experts(h, gates))


def moe_block(ep_mesh: DeviceMesh | None = None) -> MoEBlock:
    """The same weights on every rank (seeded); with ``ep_mesh`` the experts split over it."""
    torch.manual_seed(0)
    block = MoEBlock()
    if ep_mesh is not None:
        for name in ("w1", "w2"):
            full = getattr(block.experts, name).detach()
            setattr(block.experts, name, nn.Parameter(distribute_tensor(full, ep_mesh, [Shard(0)], src_data_rank=None)))
    return block


def is_expert(p: nn.Parameter) -> bool:
    return p.dim() == 3


class SpmdBlock(nn.Module):
    """An MLP block whose weights are DTensors on a full (dp dims..., tp) mesh: ``w1``
    column-wise and ``w2`` row-wise over tp, everything replicated over the dp dims. It takes
    and returns this rank's rows of the batch (plain tensors); in between the batch is
    ``Shard(0)`` over the dp dims. ``plain()`` is the same block with plain weights."""

    def __init__(self, mesh: DeviceMesh | None = None, n_dp: int = 1, seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        w1, w2, b = torch.randn(2 * D, D) * 0.3, torch.randn(D, 2 * D) * 0.3, torch.randn(D) * 0.1
        self.mesh, self.n_dp = mesh, n_dp
        if mesh is not None:
            rep = [Replicate()] * n_dp
            w1 = distribute_tensor(w1, mesh, rep + [Shard(0)], src_data_rank=None)
            w2 = distribute_tensor(w2, mesh, rep + [Shard(1)], src_data_rank=None)
            b = distribute_tensor(b, mesh, rep + [Replicate()], src_data_rank=None)
        self.w1, self.w2, self.b = nn.Parameter(w1), nn.Parameter(w2), nn.Parameter(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:
            return x + torch.tanh(x @ self.w1.T) @ self.w2.T + self.b
        rows = [Shard(0)] * self.n_dp
        X = DTensor.from_local(x, self.mesh, rows + [Replicate()])
        y = (torch.tanh(X @ self.w1.T) @ self.w2.T).redistribute(self.mesh, rows + [Replicate()])
        return x + (y + self.b).to_local()


class SpmdStack(nn.Module):
    def __init__(self, mesh: DeviceMesh | None = None, n_dp: int = 1, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SpmdBlock(mesh, n_dp, seed=i) for i in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x
