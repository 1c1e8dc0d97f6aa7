"""shardkit.compiled's FSDPModule methods and meshes on the fake process group (world 8): which
methods work, which raise, how a setting changes the compiled graphs (one more graph per new
setting, none when a setting comes back), and HSDP's collectives. (Their numbers on gloo ranks:
tests/gloo/test_compiled_mode.py, tests/gloo/test_four_ranks.py.)"""

from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import shardkit
import shardkit.compiled
from shardkit.compiled import CompiledFSDPModule
from shardkit.core.setup import user_class
from shardkit.eager.module import EagerFSDPModule
from tests.conftest import fake_world
from tests.fake.test_compiled_graphs import Recording, batch, gpt, graph_collectives

WORKING = {"unshard", "reshard", "set_requires_gradient_sync", "set_requires_all_reduce", "set_reshard_after_forward",
           "set_reshard_after_backward", "set_is_last_backward", "set_keep_unsharded_storage", "set_gradient_divide_factor",
           "set_reduce_scatter_divide_factor", "set_force_sum_reduction_for_comms", "set_post_optim_event", "reset_iter_state",
           "_set_unshard_async_op"}
RAISING = {"set_unshard_in_backward": (True,), "set_lockstep": (), "set_manual_backward_finalization": (True,), "finalize_backward": (),
           "set_modules_to_forward_prefetch": ([],), "set_modules_to_backward_prefetch": ([],), "set_all_reduce_hook": (print,),
           "set_custom_all_gather": (None,), "set_custom_reduce_scatter": (None,), "set_reduce_scatter_max_input_buffers": (2,),
           "set_separate_reduce_scatter_group": (), "set_allocate_memory_from_process_group_for_comm": (True,),
           "set_symm_mem_for_comm": (), "set_reduce_scatter_unused_params": (True,), "_get_fsdp_state": ()}


def test_a_compiled_module_is_an_fsdp_module_whose_every_method_is_its_own():
    """isinstance against shardkit's and torch's FSDPModule holds (code that walks a model for FSDP
    modules finds them); the interface declares every public method of torch's FSDPModule, and
    compiled mode implements its own or raises: no method comes from eager mode's implementation."""
    with fake_world(8) as mesh:
        model = gpt(shardkit.compiled.fully_shard, mesh=mesh)
    assert isinstance(model, shardkit.FSDPModule) and isinstance(model, torch.distributed.fsdp.FSDPModule)
    assert not isinstance(model, EagerFSDPModule) and not issubclass(CompiledFSDPModule, EagerFSDPModule)
    torch_methods = {n for n, v in vars(torch.distributed.fsdp.FSDPModule).items() if callable(v) and not n.startswith("__")}
    methods = {n for n, v in vars(shardkit.FSDPModule).items() if callable(v) and not n.startswith("__")} - {"_shardkit", "_register_forward_method"}
    assert torch_methods - {"_apply"} <= methods
    assert methods == WORKING | set(RAISING), methods ^ (WORKING | set(RAISING))
    assert all(n in vars(CompiledFSDPModule) for n in WORKING - {"set_reduce_scatter_divide_factor"})
    assert not any(n in vars(CompiledFSDPModule) for n in RAISING if n not in ("set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch", "_get_fsdp_state"))
    assert type(model.blocks[0]).__name__ == "FSDPBlock" and user_class(type(model.blocks[0])).__name__ == "Block"


def test_without_sync_backward_keeps_the_unsharded_gradient_and_the_next_sync_reduces_it():
    """set_requires_gradient_sync(False): no reduce-scatter, no gradient on the shards, the
    unsharded gradient kept in reduce_dtype (one leaf per bucket); back on: one reduce-scatter
    per group, and the kept gradient is consumed."""
    with fake_world(8) as mesh:
        model = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        model.set_requires_gradient_sync(False)
        for _ in range(2):
            with shardkit.trace() as t:
                model(*batch())[1].backward()
            assert [e.kind for e in t.collectives() if e.kind == "reduce_scatter"] == []
        assert all(p.grad is None for p in model.parameters())
        kept = [leaf for g in shardkit.compiled.module._groups(model, True) for leaf in g._unreduced.values()]
        assert len(kept) == 3 and all(leaf.grad is not None and leaf.grad.shape == leaf.shape for leaf in kept)
        with pytest.raises(RuntimeError, match="kept without sync"):
            model.to(torch.float64)
        model.set_requires_gradient_sync(True)
        with shardkit.trace() as t:
            model(*batch())[1].backward()
        assert len(t.collectives("reduce_scatter")) == 3
        assert all(leaf.grad is None for leaf in kept) and all(p.grad is not None for p in model.parameters())


def test_unshard_returns_a_handle_with_async_op_as_fsdp2():
    with fake_world(8) as mesh:
        model = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        assert model.unshard() is None
        handle = model.unshard(async_op=True)
        handle.wait()
        model.reshard()


@pytest.mark.parametrize("method", sorted(RAISING))
def test_what_compiled_mode_cannot_do_raises_naming_the_method(method):
    with fake_world(8) as mesh:
        model = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        with pytest.raises(NotImplementedError, match=f"{method}.*use shardkit.fully_shard"):
            getattr(model, method)(*RAISING[method])


def test_not_resharding_after_backward_keeps_the_gathered_rows_until_the_shards_change():
    """set_reshard_after_backward(False) (recursive): a forward after a backward all-gathers
    nothing (one more graph, then no recompilation); an optimizer step, load_state_dict and
    reshard() on each module drop what was kept, and the next forward gathers again with
    the first graph; True frees it at the next backward."""
    with fake_world(8) as mesh:
        torch._dynamo.reset()
        recording = Recording()
        sharded = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        model = torch.compile(sharded, fullgraph=True, backend=recording)
        optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
        groups = shardkit.compiled.module._groups(sharded, True)

        def step() -> tuple[int, int]:
            """(forward all-gathers, dynamo graphs so far)"""
            with shardkit.trace() as t:
                loss = model(*batch())[1]
            loss.backward()
            return len(t.collectives("all_gather")), recording.dynamo_graphs

        sharded.set_reshard_after_backward(False)
        assert [step() for _ in range(3)] == [(3, 1), (0, 2), (0, 2)]
        optimizer.step()
        assert [step() for _ in range(2)] == [(3, 2), (0, 2)]
        for m in sharded.modules():
            if isinstance(m, CompiledFSDPModule):
                m.reshard()
        assert step() == (3, 2)
        sharded.load_state_dict(sharded.state_dict())
        assert step() == (3, 2)
        assert step() == (0, 2)
        sharded.set_reshard_after_backward(True)
        assert step()[0] == 0 and all(leaf.grad is None for g in groups for leaf in g._kept.values())
        assert step()[0] == 3


def test_an_optimizer_step_drops_what_was_kept_whichever_mode_hooked_the_steps_first(monkeypatch):
    """The staleness hook (shardkit/core/steps.py) must see the DTensors a group holds: the swap of
    each shard for its local tensor during the step (shardkit/optim/local_step.py) is undone by a
    post-step hook, so the staleness hook must come after it even when the first model sharded in
    the process is a compiled one told to keep and an eager one follows. (Process-wide hooks:
    reset here so that this order is built whatever ran before.) Run without torch.compile."""
    from torch.optim import optimizer as torch_optimizer

    from shardkit.core import steps
    from shardkit.optim import local_step

    monkeypatch.setattr(torch_optimizer, "_global_optimizer_pre_hooks", type(torch_optimizer._global_optimizer_pre_hooks)())
    monkeypatch.setattr(torch_optimizer, "_global_optimizer_post_hooks", type(torch_optimizer._global_optimizer_post_hooks)())
    monkeypatch.setattr(steps, "_installed", False)
    monkeypatch.setattr(local_step, "_installed", False)
    with fake_world(8) as mesh:
        sharded = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        sharded.set_reshard_after_backward(False)
        gpt(shardkit.fully_shard, mesh=mesh)  # eager mode installs its swap after compiled mode's hook
        optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
        sharded(*batch())[1].backward()
        groups = shardkit.compiled.module._groups(sharded, True)
        assert all(leaf.grad is not None for g in groups for leaf in g._kept.values()) and groups
        optimizer.step()
        assert all(leaf.grad is None for g in groups for leaf in g._kept.values())


def test_a_new_setting_compiles_one_more_graph_and_a_setting_seen_before_none():
    """set_reshard_after_forward(False) on the root (recursive): backward keeps forward's
    unsharded parameters (no all-gather in the new backward graph); True: every group,
    the root too, gathers again; back to False reuses its graphs; set_gradient_divide_factor
    compiles one more."""
    with fake_world(8) as mesh:
        torch._dynamo.reset()
        recording = Recording()
        sharded = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        model = torch.compile(sharded, fullgraph=True, backend=recording)

        def step() -> tuple[int, Counter]:
            before = len(recording.graphs["backward"])
            model(*batch())[1].backward()
            new = recording.graphs["backward"][before:]
            return recording.dynamo_graphs, Counter(kind for gm in new for kind, _ in graph_collectives(gm))

        assert step() == (1, Counter(all_gather=2, reduce_scatter=3))
        sharded.set_reshard_after_forward(False)
        assert {g.options.reshard_after_forward for g in shardkit.compiled.module._groups(sharded, True)} == {False}
        assert step() == (2, Counter(reduce_scatter=3))
        assert step() == (2, Counter())  # steady state: no recompilation
        sharded.set_reshard_after_forward(True)  # the root too, now (its default, None, keeps)
        assert step() == (3, Counter(all_gather=3, reduce_scatter=3))
        sharded.set_reshard_after_forward(False)
        assert step() == (3, Counter())  # the second graphs again
        sharded.blocks[0].set_gradient_divide_factor(4.0)
        assert step()[0] == 4
        with pytest.raises(ValueError, match="positive factor"):
            sharded.set_gradient_divide_factor(0)


def test_hsdp_gathers_over_shard_and_all_reduces_over_replicate_as_eager():
    """A (replicate 2, shard 4) mesh: each group all-gathers over the 4 shard ranks, and its
    gradient is reduce-scattered over them, then all-reduced over the 2 replicas; the
    all-gathers move eager shardkit's bytes."""
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        torch._dynamo.reset()
        recording = Recording()
        model = torch.compile(gpt(shardkit.compiled.fully_shard, mesh=mesh), fullgraph=True, backend=recording)
        with shardkit.trace() as compiled:
            model(*batch())[1].backward()
        eager_model = gpt(shardkit.fully_shard, mesh=mesh)
        with shardkit.trace() as eager:  # forward only: compiled mode's trace leaves out the all-gathers backward recomputes
            loss = eager_model(*batch())[1]
        loss.backward()
        replicate_group = mesh.get_group(0).group_name
    backward = recording.graphs["backward"][0].graph
    reduces = [n for n in backward.nodes if n.op == "call_function" and "all_reduce" in str(n.target)]
    assert len(reduces) == 3 and {n.args[2] for n in reduces} == {replicate_group}
    describe = lambda e: (e.kind, e.group, e.nbytes, e.world, e.mesh_dim)  # noqa: E731
    assert Counter(map(describe, compiled.collectives("all_gather"))) == Counter(map(describe, eager.collectives("all_gather")))
    assert {e.world for e in compiled.collectives("all_gather")} == {4}
    assert [(e.kind, e.world, e.mesh_dim) for e in compiled.collectives("all_reduce")] == [("all_reduce", 2, "replicate")] * 3


def test_hsdp_without_the_all_reduce_keeps_the_sums_for_the_next_backward():
    """set_requires_all_reduce(False) on a (replicate 2, shard 4) mesh: the backward graph
    reduce-scatters each group and all-reduces none, the sharded parameters get no gradient and
    each bucket's partial leaf holds this rank's rows; back to True, the next backward graph
    all-reduces each group once and takes the kept sums (one more graph each way, then none)."""
    with fake_world(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        torch._dynamo.reset()
        recording = Recording()
        sharded = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        model = torch.compile(sharded, fullgraph=True, backend=recording)
        groups = shardkit.compiled.module._groups(sharded, True)

        def step() -> Counter:
            before = len(recording.graphs["backward"])
            model(*batch())[1].backward()
            return Counter(kind for gm in recording.graphs["backward"][before:] for kind, _ in _collectives(gm))

        sharded.set_requires_all_reduce(False)
        assert step() == Counter(all_gather=2, reduce_scatter=3)
        assert all(p.grad is None for p in sharded.parameters())
        leaves = [g._partial[b] for g in groups for b in range(len(g.buckets))]
        assert [leaf.grad.shape[0] for leaf in leaves] == [g.buckets[b].reduced_numel for g in groups for b in range(len(g.buckets))]  # rows, counts
        assert step() == Counter()  # the same graph again: the sums add up in the leaves
        sharded.set_requires_all_reduce(True)
        assert step() == Counter(all_gather=2, reduce_scatter=3, all_reduce=3)
        assert all(leaf.grad is None for leaf in leaves) and all(p.grad is not None for p in sharded.parameters())
        assert step() == Counter(all_gather=2, reduce_scatter=3, all_reduce=3)  # nothing kept: the first graph's kind
        assert recording.dynamo_graphs == 3


def _collectives(gm) -> list[tuple[str, int]]:
    kinds = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}
    return [(kinds[n.target.__name__.split(".")[0]], 0) for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] in kinds]


def test_register_fsdp_forward_method_gathers_around_the_method():
    """A method other than forward reads the gathered parameters while it runs (the trace shows
    the group's all-gather), as eager mode's hooks do."""

    class Scorer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(x)

        def score(self, x):
            return self.lin.weight.shape, self.lin(x).sum()

    with fake_world(8) as mesh:
        model = shardkit.compiled.fully_shard(Scorer(), mesh=mesh)
        shardkit.register_fsdp_forward_method(model, "score")
        with shardkit.trace() as t:
            shape, _ = model.score(torch.randn(2, 8))
    assert shape == (8, 8)  # unsharded while the method runs (the shard is (1, 8))
    assert [e.kind for e in t.collectives()] == ["all_gather"]


# The reduction's ops: one rule (core/reduction.reduce_ops) for both modes ------------------------
_F16 = shardkit.MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
_BF16 = shardkit.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
_KNOBS = {"default": {}, "divide_by_the_shard_ranks": {"set_gradient_divide_factor": 4.0}, "divide_by_3": {"set_gradient_divide_factor": 3.0},
          "divide_by_all_ranks": {"set_gradient_divide_factor": 8.0}, "force_sum": {"set_force_sum_reduction_for_comms": True}}


def _reductions(fully_shard, mesh, policy, knobs) -> list[tuple]:
    """(kind, op, dtype, elements, ranks) of each reduction of one forward and backward."""
    model = gpt(fully_shard, mesh=mesh, **({"mp_policy": policy} if policy is not None else {}))
    for module in model.modules():
        if isinstance(module, shardkit.FSDPModule):
            for method, value in knobs.items():
                getattr(module, method)(value)
    with shardkit.trace() as t:
        model(*batch())[1].backward()
    return [(e.kind, e.op, e.dtype, e.numel, e.world) for e in t.collectives() if e.kind in ("reduce_scatter", "all_reduce")]


@pytest.mark.parametrize("knobs", list(_KNOBS), ids=str)
@pytest.mark.parametrize("policy", [None, _BF16, _F16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_compiled_mode_reduces_with_eager_modes_ops(hsdp, policy, knobs):
    """On the fake process group (which averages, as NCCL): each reduction of compiled mode has
    eager mode's op (AVG in fp32/bf16 divided by the ranks, or by a factor equal to the shard
    ranks; SUM in fp16, with another factor, or with force-sum) over the same elements and ranks."""
    with fake_world(8) as mesh:
        if hsdp:
            mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        elif "shard_ranks" in knobs:
            knobs = "divide_by_all_ranks"  # (a 1-D mesh's shard dim is all its ranks)
        eager = _reductions(shardkit.fully_shard, mesh, policy, _KNOBS[knobs])
        compiled = _reductions(shardkit.compiled.fully_shard, mesh, policy, _KNOBS[knobs])
    assert compiled == eager and eager
    averages = policy is not _F16 and knobs in ("default", "divide_by_the_shard_ranks") + (() if hsdp else ("divide_by_all_ranks",))
    assert {op for kind, op, *_ in eager if kind == "reduce_scatter"} == {"avg" if averages else "sum"}


def test_the_compiled_graphs_collectives_take_the_traced_ops():
    """The backward graph's reduce-scatters and all-reduces take the op its trace records: AVG
    by default on the fake process group, SUM with force-sum, in the graph, not only in the trace."""
    def graph_ops(force_sum: bool) -> list[str]:
        torch._dynamo.reset()
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        model = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        for module in model.modules():
            if isinstance(module, shardkit.FSDPModule):
                module.set_force_sum_reduction_for_comms(force_sum)
        recording = Recording()
        with shardkit.trace() as t:
            torch.compile(model, fullgraph=True, backend=recording)(*batch())[1].backward()
        ops = [node.args[1] for gm in recording.graphs["backward"] for node in gm.graph.nodes
               if node.op == "call_function" and getattr(node.target, "__name__", "").split(".")[0] in ("reduce_scatter_tensor", "all_reduce")]
        assert ops == [e.op for e in t.collectives() if e.kind in ("reduce_scatter", "all_reduce")]
        return ops

    with fake_world(8):
        assert set(graph_ops(False)) == {"avg"} and set(graph_ops(True)) == {"sum"}
