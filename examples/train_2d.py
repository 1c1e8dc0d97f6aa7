"""Train a small Llama-style model with tensor parallel on "tp" and shardkit on "dp".

    torchrun --standalone --nproc-per-node 4 examples/train_2d.py            # 2 x 2 on CPU (gloo)
    torchrun --standalone --nproc-per-node 8 examples/train_2d.py --tp 4     # 2 x 4 on GPUs (nccl)

The recipe, in the order it must be applied to each block (docs/usage.md, "2-D"):
tensor parallel (``parallelize_module`` on ``mesh["tp"]``), then activation checkpointing,
then ``torch.compile``, then ``fully_shard`` on ``mesh["dp"]``; the root last. Each rank of a
tp group sees the same batch; dp groups see different ones. The task (next token = previous
token + 1, modulo the vocabulary) is easy, so the loss falls within a few dozen steps.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from shardkit import fully_shard
from shardkit.models.llama import Llama, LlamaConfig, tp_plan


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks; dp = world // tp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8, help="sequences per dp rank")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing per block")
    parser.add_argument("--compile", action="store_true", help="torch.compile per block")
    return parser.parse_args()


def build(mesh, args) -> Llama:
    torch.manual_seed(0)  # the same full model on every rank
    with torch.device(mesh.device_type):
        model = Llama(LlamaConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, hidden=128))
    for i, block in enumerate(model.layers):
        parallelize_module(block, mesh["tp"], tp_plan())  # 1. tensor parallel
        if args.ac:  # 2. activation checkpointing (non-reentrant)
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            model.layers[i] = block = checkpoint_wrapper(block)
        if args.compile:  # 3. compile
            model.layers[i] = block = torch.compile(block)
        fully_shard(block, mesh=mesh["dp"])  # 4. shard over dp
    fully_shard(model, mesh=mesh["dp"])  # 5. the root: embeddings, final norm, head
    return model


def batch(step: int, dp_rank: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    start = torch.randint(0, 64, (size, 1), generator=g)
    tokens = (start + torch.arange(33)) % 64  # (B, 33): each token is the previous + 1
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def main() -> None:
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the world size {world}")
    mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    model = build(mesh, args)
    rank0 = dist.get_rank() == 0
    if rank0:
        for name, p in list(model.layers[0].named_parameters())[:5]:
            print(f"{name:28s} {tuple(p.shape)} {p.placements} local {tuple(p.to_local().shape)}")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        x, y = batch(step, mesh.get_local_rank("dp"), args.batch, mesh.device_type)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if rank0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:3d} loss {loss.item():.3f}")
    if rank0:
        verdict = "fell" if losses[-1] < losses[0] else "did NOT fall"
        print(f"dp={world // args.tp} tp={args.tp}: loss {losses[0]:.3f} -> {losses[-1]:.3f}, it {verdict}")
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
