"""``python -m shardkit``: tools that run outside training.

    python -m shardkit plan llama --world 64 --dim 8192 ...   predict memory and communication per rank
    python -m shardkit timeline <folder>                      merge a SHARDKIT_TRACE=<folder> run into one Perfetto file
"""

from __future__ import annotations

import argparse
import json
import sys

DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp16": "float16", "float16": "float16"}
PRESETS = {  # config fields of the built-in families
    "llama-70b": ("llama", dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden=28672, vocab_size=128256, max_seq=4096)),
    "llama-8b": ("llama", dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, hidden=14336, vocab_size=128256, max_seq=4096)),
    "gpt2-small": ("gpt", dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardkit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    _plan_parser(commands.add_parser("plan", help="predict memory and communication per rank, without GPUs"))
    timeline = commands.add_parser("timeline", help="merge per-rank traces into one Perfetto/Chrome timeline")
    timeline.add_argument("folder", help="the folder a SHARDKIT_TRACE=<folder> run wrote rank<r>.json files into")
    timeline.add_argument("-o", "--out", default=None, help="output file (default: <folder>/timeline.json)")
    args = parser.parse_args(argv)
    if args.command == "timeline":
        from shardkit.comm import timeline as tl

        path = tl.merge(args.folder, args.out)
        print(f"wrote {path}: open it at https://ui.perfetto.dev")
        return 0
    return _plan(args)


def _plan_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help=f"a built-in family (gpt, llama), a preset ({', '.join(PRESETS)}), or module:function")
    p.add_argument("--world", type=int, default=8, help="data-parallel (shard) ranks")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (a mesh dim after the data-parallel ones)")
    p.add_argument("--replicate", type=int, default=1, help="HSDP replicas (a mesh dim before --world's; with --tp, a 3-D mesh)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default=None, help="MixedPrecisionPolicy.param_dtype")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), default=None, help="MixedPrecisionPolicy.reduce_dtype")
    p.add_argument("--reshard-after-forward", default="true", help="true, false, or an int dividing --world (blocks)")
    p.add_argument("--prefetch", type=int, default=1, help="all-gathers issued ahead (the runtime's default: 1)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd", "sgd-nomomentum"])
    p.add_argument("--foreach", action="store_true", help="the optimizer's multi-tensor path (the CUDA default)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing per block (recomputed in backward)")
    p.add_argument("--bandwidth", type=float, default=50.0, help="GB/s per rank, for the communication time")
    p.add_argument("--budget-gib", type=float, default=None, help="fit this memory per rank: pick reshard_after_forward and prefetch")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a model config field or factory argument (repeatable), e.g. --set n_layers=4")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")


def _plan(args: argparse.Namespace) -> int:
    import torch

    import shardkit

    model, sizes = PRESETS.get(args.model, (args.model, {}))
    sizes = {**sizes, **dict(_key_value(kv) for kv in args.set)}
    shape, names = (args.world,), ("dp",)
    if args.tp > 1 and args.replicate > 1:  # HSDP x TP: the 3-D mesh
        shape, names = (args.replicate, args.world, args.tp), ("replicate", "shard", "tp")
    elif args.tp > 1:
        shape, names = (args.world, args.tp), ("dp", "tp")
    elif args.replicate > 1:
        shape, names = (args.replicate, args.world), ("replicate", "shard")
    raf = {"true": True, "false": False}.get(args.reshard_after_forward.lower())
    dtype = lambda name: getattr(torch, DTYPES[name]) if name else None  # noqa: E731
    plan = shardkit.plan(
        model, shape, mesh_dim_names=names, batch_size=args.batch_size, seq_len=args.seq_len,
        param_dtype=dtype(args.param_dtype), reduce_dtype=dtype(args.reduce_dtype),
        reshard_after_forward=raf if raf is not None else int(args.reshard_after_forward),
        prefetch=args.prefetch, optimizer=args.optimizer, foreach=args.foreach, activation_checkpointing=args.ac, bandwidth_gbps=args.bandwidth,
        budget=int(args.budget_gib * 1024**3) if args.budget_gib else None, **sizes,
    )
    if args.json:
        print(json.dumps(plan.to_json(), indent=2, default=str))
    else:
        from rich.console import Console

        Console().print(plan.table())
    return 0


def _key_value(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    for cast in (int, float):
        try:
            return key, cast(value)
        except ValueError:
            pass
    return key, {"true": True, "false": False}.get(value.lower(), value)


if __name__ == "__main__":
    sys.exit(main())
