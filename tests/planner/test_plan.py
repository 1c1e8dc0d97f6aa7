"""The planner: hand-computed numbers, the runtime's own collectives (fake process group),
budget mode and apply_plan, the printed table, the CLI, and the 70B time bound."""

import io
import json
import subprocess
import sys
import time

import pytest
import torch
from expecttest import assert_expected_inline
from rich import box
from rich.console import Console
from torch.distributed.device_mesh import init_device_mesh

import shardkit
from shardkit import MixedPrecisionPolicy, fully_shard
from shardkit.planner.simulate import persistent_state, simulate
from shardkit.core.setup import state_of
from tests.conftest import TanhStack, fake_world

DIM = 8


def stack(n_blocks: int = 2, dim: int = DIM) -> TanhStack:
    return TanhStack(n_blocks, dim)


def plan_stack(world, n_blocks=2, dim=DIM, batch_size=4, **kwargs) -> shardkit.Plan:
    return shardkit.plan(lambda: stack(n_blocks, dim), world, inputs_fn=lambda b, t: (torch.randn(b, dim),),
                         loss_fn=lambda out, inputs: out.sum(), batch_size=batch_size, **kwargs)


def test_hand_computed_table_for_a_two_block_stack_at_world_4():
    # blocks.i: Linear(8, 8): weight 8 rows -> 2 per rank (16 elements), bias 2: 18 per rank.
    # root: inp weight 16 + bias 2, out weight (1, 8): 1 padded row (8), out bias 1: 27 per rank.
    p = plan_stack(4)
    m = p.memory
    assert [g.name for g in p.groups] == ["blocks.0", "blocks.1", ""]
    assert m.params == (18 + 18 + 27) * 4
    assert m.grads == (18 + 18 + 27) * 4
    # Rank 0 holds the out row: AdamW keeps two fp32 states of the real rows, plus a step per parameter.
    assert m.optimizer == 2 * (18 + 18 + 27) * 4 + 8 * 4
    assert persistent_state(p.groups, "adamw", rank=3)[2] == 2 * (18 + 18 + 18) * 4 + 8 * 4
    assert [g.unsharded_bytes() for g in p.groups] == [72 * 4, 72 * 4, 108 * 4]
    ag, rs, ar = (p.comm[k] for k in ("all_gather", "reduce_scatter", "all_reduce"))
    # Forward gathers all three groups; backward the two blocks again (the root stays unsharded).
    assert (ag.calls, ag.nbytes, ag.wire_bytes) == (5, (72 + 72 + 108 + 72 + 72) * 4, (72 + 72 + 108 + 72 + 72) * 3)
    # Reduce-scatter inputs carry one grad-presence column per parameter.
    assert (rs.calls, rs.nbytes) == (3, (4 * (18 + 2) * 2 + 4 * (27 + 4)) * 4)
    assert ar.calls == 0
    assert p.total_params == 3 * 72 + 9


def test_uneven_world_pads_every_rank_to_the_same_shard():
    p = plan_stack(3)  # 8 rows over 3 ranks: 3, 3, 2 rows, every padded shard 3 rows
    blocks0 = p.groups[0]
    assert [q.shard_numel for q in blocks0.params] == [24, 3]
    assert [q.local_numel(2) for q in blocks0.params] == [16, 2]
    assert p.memory.params == (27 + 27 + (24 + 3 + 8 + 1)) * 4


def runtime_summary(mesh, n_blocks=2, mp=None, raf=True, steps=2):
    """Calls and bytes per collective kind for one step of the real runtime (fake process group)."""
    torch.manual_seed(0)
    net = stack(n_blocks)
    kwargs = {"mp_policy": mp} if mp is not None else {}
    for block in net.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=raf, **kwargs)
    fully_shard(net, mesh=mesh, **kwargs)
    for _ in range(steps - 1):
        net(torch.randn(4, DIM)).sum().backward()
    with shardkit.trace() as t:
        net(torch.randn(4, DIM)).sum().backward()
    return {k: (s.calls, s.nbytes) for k, s in t.summary().items()}


def planned(p: shardkit.Plan) -> dict:
    return {k: (s.calls, s.nbytes) for k, s in p.comm.items()}


@pytest.mark.parametrize("world", [2, 3, 8, 64])
def test_planned_collectives_equal_the_runtime_trace(world):
    with fake_world(world) as mesh:
        assert planned(plan_stack(world, n_blocks=3)) == runtime_summary(mesh, n_blocks=3)


def test_planned_collectives_with_mixed_precision_and_partial_reshard():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with fake_world(8) as mesh:
        measured = runtime_summary(mesh, n_blocks=3, mp=mp, raf=2)
    p = plan_stack(8, n_blocks=3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, reshard_after_forward=2)
    assert planned(p) == measured
    assert measured["all_gather"][0] == 3 + 1 + 3  # forward, then backward among pairs


def test_planned_collectives_for_hsdp():
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        measured = runtime_summary(mesh, n_blocks=3)
    p = plan_stack((2, 4), n_blocks=3, mesh_dim_names=("replicate", "shard"))
    assert planned(p) == measured
    assert measured["all_reduce"][0] == 4


def test_planned_collectives_and_parameters_for_hsdp_with_tensor_parallel():
    """The 3-D mesh (replicate, shard, tp): a Llama with tensor-parallel blocks, planned without a
    process group, against the runtime on the fake one (shardkit's collectives; TP's own are not counted)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from shardkit.models.llama import Llama, LlamaConfig, tp_plan

    config = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, hidden=64, max_seq=32)
    p = shardkit.plan("llama", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"), batch_size=2, seq_len=8, **vars(config))
    with fake_world(8, 5):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
        torch.manual_seed(0)
        model = Llama(config)
        for block in model.layers:
            parallelize_module(block, mesh["tp"], tp_plan())
            fully_shard(block, mesh=mesh["replicate", "shard"])
        fully_shard(model, mesh=mesh["replicate", "shard"])
        model(torch.randint(0, 64, (2, 8))).sum().backward()
        with shardkit.trace() as t:
            model(torch.randint(0, 64, (2, 8))).sum().backward()
        measured = {k: (s.calls, s.nbytes) for k, s in t.summary().items()}
        held = sum(q.to_local().numel() * q.element_size() for q in model.parameters())
    assert planned(p) == measured
    assert measured["all_reduce"][0] == 3  # one per group, over the replicas
    assert p.memory.params == held


def test_budget_mode_trades_memory_for_communication():
    low = plan_stack(4, n_blocks=4, prefetch=0).memory.peak
    roomy = plan_stack(4, n_blocks=4, budget=10 * low)
    assert roomy.prefetch == 2
    assert all(g.reshard_after_forward is False for g in roomy.groups if g.name)
    assert roomy.comm["all_gather"].calls == 5  # no backward all-gathers left
    assert roomy.memory.peak <= 10 * low

    tight = plan_stack(4, n_blocks=4, budget=low)
    assert tight.memory.peak <= low
    assert tight.prefetch == 0
    assert "fits" in tight.notes[0]

    too_small = plan_stack(4, n_blocks=4, budget=low - 1)
    assert too_small.notes[0].startswith("does not fit")


def test_budget_mode_keeps_the_last_blocks_first_and_fits_every_budget():
    # Parameters dominate (dim 64, one sample). Between the smallest and the largest peak, a
    # larger budget never costs more all-gathers, the blocks kept unsharded are always the
    # last ones (backward needs them first), and the chosen plan fits.
    smallest = plan_stack(4, n_blocks=4, dim=64, batch_size=1, prefetch=0).memory.peak
    largest = plan_stack(4, n_blocks=4, dim=64, batch_size=1, prefetch=2, reshard_after_forward=False).memory.peak
    calls, kept_counts = [], []
    for i in range(9):
        budget = smallest + (largest - smallest) * i // 8
        q = plan_stack(4, n_blocks=4, dim=64, batch_size=1, budget=budget)
        kept = [g.name for g in q.groups if g.reshard_after_forward is False]
        assert kept == [f"blocks.{j}" for j in range(4 - len(kept), 4)]
        assert q.memory.peak <= budget
        assert q.memory.peak == simulate(q.groups, q._profile, q.prefetch, "adamw", False).peak
        calls.append(q.comm["all_gather"].calls)
        kept_counts.append(len(kept))
    assert calls == sorted(calls, reverse=True)
    assert calls[0] > calls[-1] == 5  # the largest budget keeps every block: no backward all-gathers
    assert kept_counts[0] < 4 == kept_counts[-1]


def test_apply_plan_shards_as_planned_and_the_trace_agrees():
    p = plan_stack(4, n_blocks=4, budget=10**9)
    with fake_world(4) as mesh:
        torch.manual_seed(0)
        net = shardkit.apply_plan(stack(4), p, mesh=mesh)
        for block in net.blocks:
            assert state_of(block).options.reshard_after_forward is False
        assert state_of(net.blocks[0]).options.forward_prefetch == [state_of(net.blocks[i]) for i in (1, 2)]
        assert state_of(net.blocks[3]).options.backward_prefetch == [state_of(net.blocks[i]) for i in (2, 1)]
        net(torch.randn(4, DIM)).sum().backward()
        with shardkit.trace() as t:
            net(torch.randn(4, DIM)).sum().backward()
    assert {k: (s.calls, s.nbytes) for k, s in t.summary().items()} == planned(p)


def test_printed_plan():
    p = plan_stack(4)
    console = Console(file=io.StringIO(), width=100, color_system=None)
    table = p.table()
    table.box = box.ASCII  # expecttest pins ASCII only
    console.print(table)
    printed = "\n".join(line.rstrip() for line in console.file.getvalue().splitlines())
    assert_expected_inline(printed, """\
                          shardkit plan: 225 parameters on dp=4, per rank
+--------------------------------------------------------------------------------------------------+
| what                                                     |                              per rank |
|----------------------------------------------------------+---------------------------------------|
| sharded parameters                                       |                                 252 B |
| sharded gradients                                        |                                 252 B |
| optimizer state                                          |                                 536 B |
| grad-presence columns                                    |                                  32 B |
| persistent                                               |                              1.05 KiB |
| max unsharded parameters                                 |                                1008 B |
| max gradient buffers (unsharded grads + reduce-scatter   |                              2.02 KiB |
| buffers)                                                 |                                       |
| max activations and temporaries                          |                                 936 B |
| peak (in backward <root>)                                |                              3.62 KiB |
|   at the peak: parameters                                |                                 252 B |
|   at the peak: optimizer state                           |                                 536 B |
|   at the peak: grad-presence columns                     |                                  32 B |
|   at the peak: unsharded parameters                      |                                 432 B |
|   at the peak: gradient buffers                          |                              2.02 KiB |
|   at the peak: activations and temporaries               |                                 392 B |
| all-gather per step                                      |     5 calls, 1.55 KiB (1.16 KiB sent) |
| reduce-scatter per step                                  |        3 calls, 1.11 KiB (852 B sent) |
| communication time per step                              |                                0.0 ms |
| reshard_after_forward                                    | True: 2 groups (blocks.0 .. blocks.1) |
+--------------------------------------------------------------------------------------------------+
               prefetch depth 1; communication time at 50 GB/s if nothing overlapped""")


def test_cli_json_and_table():
    out = subprocess.run([sys.executable, "-m", "shardkit", "plan", "gpt", "--world", "4", "--set", "n_layer=2",
                          "--set", "n_embd=64", "--set", "n_head=2", "--batch-size", "2", "--json"],
                         capture_output=True, text=True, check=True).stdout
    doc = json.loads(out)
    assert doc["mesh_shape"] == [4]
    assert [g["name"] for g in doc["groups"]] == ["blocks.0", "blocks.1", "<root>"]
    assert doc["comm_per_step"]["all_gather"]["calls"] == 5
    assert doc["memory_bytes"]["peak"] > doc["memory_bytes"]["persistent"]


def test_llama_70b_at_world_64_plans_within_30_seconds():
    start = time.perf_counter()
    p = shardkit.plan("llama", 64, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden=28672,
                      vocab_size=128256, max_seq=4096, seq_len=4096, param_dtype=torch.bfloat16,
                      reduce_dtype=torch.float32)
    elapsed = time.perf_counter() - start
    assert elapsed < 30, f"planning took {elapsed:.1f} s"
    assert 70.5e9 < p.total_params < 70.6e9
    # 1/64 of the parameters, fp32: the shards, their gradients and AdamW's two states.
    per_rank = p.total_params / 64 * 4
    assert p.memory.params == pytest.approx(per_rank, rel=1e-3)
    assert p.memory.optimizer == pytest.approx(2 * per_rank, rel=1e-3)
    assert p.comm["all_gather"].calls == 80 * 2 + 1
