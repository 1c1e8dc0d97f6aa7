"""shardkit.compiled with ``reshard_after_forward=R`` (an int) on the fake process group (world 8):
forward all-gathers each group in two steps and keeps 1/R of it, backward gathers it again
among R consecutive ranks only. The graphs (aot_eager, AOTAutograd's min-cut partitioner),
what forward saves for backward, peak memory, the errors; the numbers on 4 gloo ranks:
tests/gloo/test_four_ranks_compiled.py."""

import warnings
from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import shardkit
import shardkit.compiled
from tests.conftest import fake_world
from tests.fake.test_compiled_graphs import WORLD, Recording, batch, compiled_step, eager_trace, gpt, peak_mib


def gathers(gm: torch.fx.GraphModule) -> list[tuple[int, int]]:
    """(ranks, output elements) of each all-gather of a graph, in graph order."""
    return [(n.args[1], n.meta["val"].numel()) for n in gm.graph.nodes if n.op == "call_function" and "all_gather_into_tensor" in str(n.target)]


def saved_numels(gm: torch.fx.GraphModule) -> list[int]:
    """The elements of each tensor the forward graph returns (its outputs and what it saves for backward)."""
    (outputs,) = [n.args[0] for n in gm.graph.nodes if n.op == "output"]
    return [o.meta["val"].numel() for o in outputs if isinstance(o, torch.fx.Node) and isinstance(o.meta.get("val"), torch.Tensor)]


@pytest.mark.parametrize("R", [2, 4])
def test_forward_gathers_in_two_steps_keeps_one_rth_and_backward_gathers_among_r_ranks(R):
    """Per group (the root too: apply_fully_shard gives it the setting), forward gathers 1/R of
    the group from the WORLD / R ranks equal modulo R, then all of it from R consecutive ranks;
    it saves the 1/R for backward (never the whole), and backward gathers again among R ranks.
    Over the wire that is eager's bytes; the trace names both steps."""
    with fake_world(WORLD) as mesh:
        with shardkit.trace() as t:
            recording = compiled_step(mesh, reshard_after_forward=R)
        eager_forward, _ = eager_trace(mesh, reshard_after_forward=R)
    whole = [nbytes // 4 for _, nbytes in eager_forward]  # fp32 elements per group: root, blocks.0, blocks.1
    assert gathers(recording.graphs["forward"][0]) == [step for n in whole for step in ((WORLD // R, n // R), (R, n))]
    assert Counter(gathers(recording.graphs["backward"][0])) == Counter((R, n) for n in whole)
    saved = saved_numels(recording.graphs["forward"][0])
    assert all(n // R in saved for n in whole) and not any(n in saved for n in whole), (whole, sorted(saved))
    steps = [(e.group, e.world, e.mesh_dim, e.numel) for e in t.collectives("all_gather")]
    assert steps == [(g, w, dim, numel) for g, n in zip(("", "blocks.0", "blocks.1"), whole)
                     for w, dim, numel in ((WORLD // R, f"dim0%{R}", n // R), (R, f"dim0/{R}", n))], steps


def test_hsdp_gathers_in_two_steps_within_each_replica():
    """A (replicate 2, shard 4) mesh with R=2: both steps run among the shard ranks of one
    replica (2 each), the reduce-scatter over the 4, the all-reduce over the 2 replicas."""
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        torch._dynamo.reset()
        recording = Recording()
        model = torch.compile(gpt(shardkit.compiled.fully_shard, mesh=mesh, reshard_after_forward=2), fullgraph=True, backend=recording)
        with shardkit.trace() as t:
            model(*batch())[1].backward()
        group = model.blocks[0]._shardkit_state
        pgs = {mesh.get_group(1).group_name, group.post_forward.across.pg_name, group.post_forward.within.pg_name}
        ranks = [torch.distributed.get_process_group_ranks(torch.distributed.distributed_c10d._resolve_process_group(c.pg_name)) for c in group.post_forward]
    assert len(pgs) == 3 and ranks == [[0, 2], [0, 1]]  # rank 0: across its replica's (0, 1, 2, 3), ranks equal modulo 2; then its pair
    assert [(e.world, e.mesh_dim) for e in t.collectives("all_gather")] == [(2, "shard%2"), (2, "shard/2")] * 3
    assert [(e.world, e.mesh_dim) for e in t.collectives("reduce_scatter")] == [(4, "shard")] * 3
    assert [(e.world, e.mesh_dim) for e in t.collectives("all_reduce")] == [(2, "replicate")] * 3
    assert [r for r, _ in gathers(recording.graphs["backward"][0])] == [2] * 3


def test_peak_memory_lies_between_resharding_and_keeping_and_at_most_eagers():
    """Keeping 1/2 of each group after forward costs more than keeping nothing and less than
    keeping it all; not more than eager shardkit with the same setting."""
    with fake_world(WORLD) as mesh:
        peaks = {(mode, reshard): peak_mib(mesh, mode, reshard) for mode, reshard in
                 (("compiled", True), ("compiled", 2), ("compiled", False), ("eager", 2))}
    assert peaks["compiled", True] < peaks["compiled", 2] < peaks["compiled", False], peaks
    assert peaks["compiled", 2] <= peaks["eager", 2], peaks


def test_set_reshard_after_forward_replaces_the_int_and_an_int_of_1_or_the_world_is_a_bool():
    with fake_world(WORLD) as mesh:
        model = gpt(shardkit.compiled.fully_shard, mesh=mesh, reshard_after_forward=2)
        assert model.blocks[0]._shardkit_state.two_step
        model.set_reshard_after_forward(True)  # as eager mode: a bool replaces the int
        assert not any(b._shardkit_state.two_step for b in model.blocks)  # (its meshes stay, for a backward pending)
        assert [w for w, _ in gathers(compiled_step_of(model).graphs["forward"][0])] == [WORLD] * 3
        with pytest.warns(UserWarning, match="reshard_after_forward=1"):
            one = shardkit.compiled.fully_shard(torch.nn.Linear(8, 8), mesh=mesh, reshard_after_forward=1)
        whole = shardkit.compiled.fully_shard(torch.nn.Linear(8, 8), mesh=mesh, reshard_after_forward=WORLD)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert (one._shardkit_state.options.reshard_after_forward, one._shardkit_state.post_forward) == (False, None)
        assert (whole._shardkit_state.options.reshard_after_forward, whole._shardkit_state.post_forward) == (True, None)


def compiled_step_of(model) -> Recording:
    torch._dynamo.reset()
    recording = Recording()
    torch.compile(model, fullgraph=True, backend=recording)(*batch())[1].backward()
    return recording


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(reshard_after_forward=3), ValueError, "it should be a factor of 8, not 3"),
    (dict(reshard_after_forward=2.0), ValueError, "None, a bool, or an int"),
    (dict(reshard_after_forward=2, dp_mesh_dims=True), NotImplementedError, "not yet supported with SPMD mesh"),
])
def test_an_int_that_cannot_be_used_raises_as_in_eager_mode(kwargs, error, match):
    with fake_world(WORLD) as mesh:
        if kwargs.pop("dp_mesh_dims", False):
            mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
            kwargs["dp_mesh_dims"] = shardkit.DataParallelMeshDims(shard="dp")
        for fully_shard in (shardkit.fully_shard, shardkit.compiled.fully_shard):
            with pytest.raises(error, match=match):
                fully_shard(torch.nn.Linear(8, 8), mesh=mesh, **kwargs)
