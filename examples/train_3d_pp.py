"""Train a small Llama-style model on three mesh dimensions: pipeline stages on "pp", shardkit
on "dp", tensor parallel on "tp".

    torchrun --standalone --nproc-per-node 8 examples/train_3d_pp.py                  # pp 2 x dp 2 x tp 2; CPU: gloo, GPUs: nccl
    torchrun --standalone --nproc-per-node 8 examples/train_3d_pp.py --impl fsdp2     # the same with torch's FSDP2
    torchrun --standalone --nproc-per-node 8 examples/train_3d_pp.py --impl shardkit,fsdp2   # both in turn, to compare
    torchrun --standalone --nproc-per-node 16 examples/train_3d_pp.py --tp 4          # pp 2 x dp 2 x tp 4

On CPU set OMP_NUM_THREADS=1 (8 gloo ranks). With ``--impl shardkit,fsdp2`` each rank trains
the same model from the same weights on the same batches twice, with shardkit's ``fully_shard``
then torch's; the two loss curves agree to the printed 4 decimals.

The mesh is ``init_device_mesh(device, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))``
(dp = world // (pp * tp)). The Llama's layers are split into ``pp`` contiguous stages: the first
stage also holds the token embedding, the last the final norm and the output head. Each rank
builds only its stage's module, in this order:

1. tensor parallel on each block: ``parallelize_module(block, mesh["tp"], tp_plan())``;
2. ``fully_shard(block, mesh=mesh["dp"])`` per block (a block's weights end up
   ``(_StridedShard(dim=0, sf=tp), Shard(dim=0))`` on the (dp, tp) mesh for a colwise weight);
3. ``fully_shard(stage_module, mesh=mesh["dp"])``: the stage's root (embedding, or norm and head);
4. ``PipelineStage(stage_module, stage_index, num_stages, device, group=mesh["pp"].get_group())``
   and the schedule (here ``Schedule1F1B`` with 4 microbatches and a cross-entropy ``loss_fn``,
   which the last stage runs).

With several stages per rank (``ScheduleInterleaved1F1B`` and friends), shard every stage module
the same way, then call ``share_comm_ctx(stage_modules)`` before building the schedule.

TP stays inside the transformer blocks (``tp_plan()`` is per block: colwise q/k/v and w1/w3,
rowwise wo and w2, whose outputs are replicated plain tensors), so the activations crossing
stage boundaries are plain ``torch.Tensor``s of shape (microbatch, seq, dim), as pipelining
needs. Each rank of a tp group sees the same batch, dp groups different ones; the stages of one
pipeline share their dp rank's batch (the first stage is given the inputs, the last the targets).
The task (next token = previous token + 1, modulo the vocabulary) is easy, so the loss falls in
a few steps. The rank holding the last stage with dp=0, tp=0 prints the losses (the mean of the
microbatch losses of its dp rank's batch).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import parallelize_module

from shardkit.models.llama import Llama, LlamaConfig, tp_plan
from train_2d import batch  # the same easy task: each token is the previous + 1 (vocabulary 64, 32 tokens)

VOCAB, SEQ = 64, 32
IMPLS = ("shardkit", "fsdp2")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (one per pp rank)")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks; dp = world // (pp * tp)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks, split evenly over the stages")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8, help="sequences per dp rank (split into the microbatches)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--impl", default="shardkit",
                        help="whose fully_shard: shardkit, fsdp2 (torch.distributed.fsdp's), or both in turn "
                             "(shardkit,fsdp2: the same training from the same weights, one after the other)")
    args = parser.parse_args()
    args.impls = args.impl.split(",")
    if not args.impls or any(i not in IMPLS for i in args.impls):
        parser.error(f"--impl: a comma-separated list of {', '.join(IMPLS)}")
    return args


def implementation(impl: str):
    """The fully_shard of an implementation."""
    if impl == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        from shardkit import fully_shard
    return fully_shard


class StageModule(nn.Module):
    """One pipeline stage of the Llama: [embedding] + some blocks + [final norm + output head].

    Its input is the token ids (first stage) or the hidden states (B, T, dim) of the stage
    before; its output the hidden states, or the logits (B, T, vocab) on the last stage."""

    def __init__(self, model: Llama, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def build_stage(mesh, args, fully_shard) -> tuple[StageModule, int]:
    """This rank's stage module, tensor-parallel and sharded; and its stage index."""
    stage, n_stages = mesh.get_local_rank("pp"), args.pp
    torch.manual_seed(0)  # the same full model on every rank: each keeps its stage's part
    model = Llama(LlamaConfig(vocab_size=VOCAB, dim=64, n_layers=args.layers, n_heads=4, hidden=128, max_seq=SEQ))
    per = args.layers // n_stages
    module = StageModule(model, range(stage * per, (stage + 1) * per), first=stage == 0, last=stage == n_stages - 1)
    del model
    module.to(mesh.device_type)
    for block in module.layers:
        parallelize_module(block, mesh["tp"], tp_plan())  # 1. tensor parallel, inside the block
        fully_shard(block, mesh=mesh["dp"])  # 2. shard each block over dp
    fully_shard(module, mesh=mesh["dp"])  # 3. the stage's root: embedding, or final norm and head
    return module, stage


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def train(impl: str, mesh, device: torch.device, args) -> None:
    """Builds this rank's stage with ``impl``'s fully_shard and trains it for ``args.steps`` steps."""
    module, stage = build_stage(mesh, args, implementation(impl))
    first, last = stage == 0, stage == args.pp - 1
    dp, dp_rank, tp_rank = mesh.size(1), mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    reporter = last and dp_rank == 0 and tp_rank == 0
    if dist.get_rank() == 0:
        for name, p in list(module.layers[0].named_parameters())[:3]:
            print(f"[{impl}] {name} placements: {p.placements} shape {tuple(p.shape)} local {tuple(p.to_local().shape)}")

    pipe = PipelineStage(module, stage, args.pp, device, group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, n_microbatches=args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=args.lr)
    losses = []
    for step in range(args.steps):
        x, y = batch(step, dp_rank, args.batch, device)  # every stage of the pipeline draws its dp rank's batch
        microbatch_losses: list[torch.Tensor] = []
        inputs = (x,) if first else ()  # only the first stage takes the inputs,
        targets = {"target": y, "losses": microbatch_losses} if last else {}  # only the last the targets
        schedule.step(*inputs, **targets)
        opt.step()
        opt.zero_grad()
        if last:
            losses.append(torch.stack(microbatch_losses).mean().item())
            if reporter:
                print(f"[{impl}] step {step:3d} loss {losses[-1]:.4f}", flush=True)
    if reporter:
        verdict = "fell" if losses[-1] < losses[0] else "did NOT fall"
        print(f"[{impl}] losses: {' '.join(f'{v:.4f}' for v in losses)}")
        print(f"[{impl}] pp={args.pp} dp={dp} tp={args.tp}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, it {verdict}", flush=True)


def main() -> None:
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    if world % (args.pp * args.tp):
        raise SystemExit(f"--pp {args.pp} x --tp {args.tp} does not divide the world size {world}")
    if args.layers % args.pp:
        raise SystemExit(f"--layers {args.layers} is not a multiple of --pp {args.pp}")
    dp = world // (args.pp * args.tp)
    mesh = init_device_mesh(device.type, (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
    for impl in args.impls:
        train(impl, mesh, device, args)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
