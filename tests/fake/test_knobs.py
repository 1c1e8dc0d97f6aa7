"""Every ``FSDPModule.set_*`` method called before the first forward takes effect in that
forward's step, as it would after it (fake process group; what each changes is read off the
trace, the schedule, or the reduction that was asked for)."""

import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import shardkit
from shardkit import FSDPModule, fully_shard
from shardkit.comm import collectives, sim
from shardkit.comm.streams import Handle
from shardkit.eager.lockstep import Lockstep
from shardkit.eager.param_group import Holding
from tests.conftest import TanhStack, fake_world
from tests.gloo.extension_tensors import UserComm


def sharded(mesh, n_blocks: int = 3) -> TanhStack:
    torch.manual_seed(0)
    net = TanhStack(n_blocks, dim=8)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def first_step(net: nn.Module) -> shardkit.Trace:
    with shardkit.trace() as t:
        net(torch.randn(4, 8)).sum().backward()
    return t


def calls(t: shardkit.Trace, kind: str) -> Counter:
    """Collectives of one kind per group."""
    return Counter(e.group for e in t.collectives(kind))


def backward_all_gathers(t: shardkit.Trace) -> list[str]:
    """The groups all-gathered after the forward pass ended."""
    start = next(i for i, e in enumerate(t.events) if e.kind == "phase" and "end_forward" in e.detail)
    return [e.group for e in t.events[start:] if e.kind == "all_gather"]


def test_every_set_method_is_called_here():
    source = open(__file__).read()
    missing = [name for name in dir(FSDPModule) if name.startswith("set_") and f'{name}(' not in source and f'"{name}"' not in source]
    assert not missing


def test_set_requires_gradient_sync_before_the_first_forward():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        net.set_requires_gradient_sync(False)
        t = first_step(net)
    assert not t.collectives("reduce_scatter")
    assert all(p.grad is None for p in net.parameters())  # kept unreduced until sync is back on


def test_set_requires_all_reduce_before_the_first_forward():
    from torch.distributed.device_mesh import DeviceMesh

    with fake_world(4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("replicate", "shard"))
        net = sharded(mesh)
        net.set_requires_all_reduce(False)
        t = first_step(net)
    assert len(t.collectives("reduce_scatter")) == 4 and not t.collectives("all_reduce")


def test_set_reshard_after_forward_before_the_first_forward():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        net.set_reshard_after_forward(False)
        t = first_step(net)
    assert backward_all_gathers(t) == []


def test_set_unshard_in_backward_before_the_first_forward():
    with fake_world(4) as mesh:
        net = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 1))
        for module in (net[0], net):
            fully_shard(module, mesh=mesh)
        net[0].set_unshard_in_backward(False)  # an embedding's backward needs no weights
        with shardkit.trace() as t:
            net(torch.randint(0, 10, (4,))).sum().backward()
    assert calls(t, "all_gather") == {"": 1, "0": 1}  # forward only: nothing gathered for backward
    assert calls(t, "reduce_scatter") == {"": 1, "0": 1}


def test_set_lockstep_before_the_first_forward():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        net.set_lockstep(True)
        first_step(net)
        t = first_step(net)  # a second step: prefetching would gather ahead by now
    assert isinstance(net._shardkit().schedule.collectives, Lockstep)
    lines = [str(e) for e in t.events if e.kind in ("all_gather", "phase") and "finalize" not in e.detail]
    for block in ("blocks.0", "blocks.1", "blocks.2"):  # gathered when its forward starts, not before
        i = lines.index(f"phase {block} pre_forward: IDLE -> FORWARD")
        assert lines[i + 1].startswith(f"all_gather {block} ")


def test_set_reshard_after_backward_before_the_first_forward():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        net.set_reshard_after_backward(False)
        first_step(net)
    assert all(m._shardkit().group.holding is Holding.UNSHARDED for m in (net, *net.blocks))


def test_set_is_last_backward_before_the_first_forward():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        net.set_is_last_backward(False)
        first_step(net)
        assert len(net._shardkit().schedule.orders.post_forward) == 4  # kept for the next microbatch
        net.set_is_last_backward(True)
        first_step(net)
        assert net._shardkit().schedule.orders.post_forward == []


def gathered_after(t: shardkit.Trace, phase: str, n: int) -> list[str]:
    """The groups of the ``n`` all-gathers that follow the phase line ``phase``."""
    lines = [str(e).split(" float32")[0] for e in t.events if e.kind in ("all_gather", "phase")]
    i = lines.index(f"phase {phase}")
    return [line.removeprefix("all_gather ") for line in lines[i + 1 : i + 1 + n]]


def test_set_modules_to_forward_prefetch_before_the_first_forward():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        net.blocks[0].set_modules_to_forward_prefetch([net.blocks[1], net.blocks[2]])
        t = first_step(net)
    assert gathered_after(t, "blocks.0 pre_forward: IDLE -> FORWARD", 3) == ["blocks.0", "blocks.1", "blocks.2"]


def test_set_modules_to_backward_prefetch_before_the_first_forward():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        net.blocks[2].set_modules_to_backward_prefetch([net.blocks[1], net.blocks[0]])
        t = first_step(net)
    assert gathered_after(t, "blocks.2 pre_backward: IDLE -> PRE_BACKWARD", 2) == ["blocks.1", "blocks.0"]


def divide_factors(net: nn.Module, monkeypatch) -> dict[str, float]:
    asked = {}
    reduce_scatter = collectives.reduce_scatter

    def recording(bucket, grads, comm, name, how):
        asked[name] = how.divide_by
        return reduce_scatter(bucket, grads, comm, name, how)

    monkeypatch.setattr(collectives, "reduce_scatter", recording)
    first_step(net)
    return asked


@pytest.mark.parametrize("method", ["set_gradient_divide_factor", "set_reduce_scatter_divide_factor"])
def test_set_gradient_divide_factor_before_the_first_forward(method, monkeypatch):
    with fake_world(4) as mesh:
        net = sharded(mesh)
        getattr(net.blocks[0], method)(2.0)
        factors = divide_factors(net, monkeypatch)
    assert factors == {"blocks.2": 4, "blocks.1": 4, "blocks.0": 2.0, "": 4}


def test_set_post_optim_event_before_the_first_forward():
    with fake_world(4) as mesh, sim.checking() as checker:
        net = sharded(mesh)
        event = checker.Event()
        event.record()
        net.set_post_optim_event(event)
        first_step(net)
        with_event = checker.edges
        first_step(net)
        without = checker.edges - with_event
    assert net._shardkit().shared.options.post_optim_event is None  # waited for once, then dropped
    assert with_event == without + 1  # the all-gather stream waited for the event


def test_set_reduce_scatter_unused_params_is_accepted_before_the_first_forward():
    """It asks for what shardkit always does (zeros for unused parameters): accepted, and
    the step is the same."""
    with fake_world(4) as mesh:
        plain = [str(e) for e in first_step(sharded(mesh)).events]
        net = sharded(mesh)
        net.set_reduce_scatter_unused_params(True)
        assert [str(e) for e in first_step(net).events] == plain


def test_set_force_sum_reduction_for_comms_before_the_first_forward(mesh8, monkeypatch):
    net = sharded(mesh8)
    for module in net.modules():
        if isinstance(module, FSDPModule):  # not recursive, as FSDP2
            module.set_force_sum_reduction_for_comms(True)
    ops, divisors = reduce_ops_and_divisions(net, monkeypatch, first_step)
    assert (ops, divisors) == ({torch.distributed.ReduceOp.SUM}, {8})


@pytest.mark.parametrize("method", ["set_allocate_memory_from_process_group_for_comm", "set_symm_mem_for_comm"])
def test_set_allocator_knobs_warn_once_that_they_have_no_effect_and_change_nothing(method):
    from shardkit.core import module

    module._warned.clear()
    with fake_world(4) as mesh:
        plain = [str(e) for e in first_step(sharded(mesh)).events]
        net = sharded(mesh)
        args = (True,) if "allocate" in method else ()
        with pytest.warns(UserWarning, match="has no effect"):
            getattr(net, method)(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: not again
            getattr(net.blocks[0], method)(*args)
        assert [str(e) for e in first_step(net).events] == plain


def test_set_all_reduce_hook_before_the_first_forward_sees_each_reduced_chunk_once():
    seen = []
    with fake_world(4) as mesh:
        net = sharded(mesh)

        def hook(reduced):
            seen.append(reduced.numel())
            reduced.zero_()  # edits in place reach .grad

        net.blocks[1].set_all_reduce_hook(hook)
        first_step(net)
    assert seen == [18]  # blocks.1's 8x8 weight and 8 biases over 4 ranks, no presence column
    assert all(p.grad.to_local().abs().sum() == 0 for p in net.blocks[1].parameters())
    assert all(p.grad.to_local().abs().sum() > 0 for p in net.blocks[0].parameters())


def test_set_custom_all_gather_and_reduce_scatter_before_the_first_forward():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        gather, reduce = UserComm("all_gather"), UserComm("reduce_scatter")
        net.blocks[0].set_custom_all_gather(gather)
        net.blocks[0].set_custom_reduce_scatter(reduce)
        t = first_step(net)
        with pytest.raises(TypeError, match="allocate"):
            net.set_custom_all_gather(lambda *a: None)
    # blocks.0: gathered in forward and backward, reduced once; 18 elements per rank
    assert (gather.calls, gather.allocated) == (2, [(4 * 18,), (4 * 18,)])
    assert (reduce.calls, reduce.allocated) == (1, [(4 * 20,), (20,)])  # and a presence element per parameter
    assert calls(t, "all_gather")["blocks.0"] == 2 and calls(t, "reduce_scatter")["blocks.0"] == 1


def test_set_separate_reduce_scatter_group_before_the_first_forward():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        net.blocks[0].set_separate_reduce_scatter_group()
        t = first_step(net)
        group = net.blocks[0]._shardkit().group
        separate, default = group.parts[0].plan.separate.process_group, group.parts[0].plan.comm.process_group
        assert separate is not default and torch.distributed.get_process_group_ranks(separate) == [0, 1, 2, 3]
        assert net.blocks[1]._shardkit().group.parts[0].plan.separate is None  # not recursive to siblings
    assert calls(t, "reduce_scatter") == Counter({"blocks.2": 1, "blocks.1": 1, "blocks.0": 1, "": 1})


@pytest.mark.parametrize("limit", [1, 3])
def test_set_reduce_scatter_max_input_buffers_bounds_the_reductions_in_flight(limit, monkeypatch):
    monkeypatch.setattr(Handle, "poll", lambda self: False)  # none completes early
    with fake_world(4) as mesh:
        net = sharded(mesh, n_blocks=4)
        net.set_reduce_scatter_max_input_buffers(limit)
        t = first_step(net)
        with pytest.raises(TypeError):
            net.set_reduce_scatter_max_input_buffers(True)
        with pytest.raises(ValueError):
            net.set_reduce_scatter_max_input_buffers(0)
    in_flight, most = 0, 0
    for e in t.events:
        if e.kind == "reduce_scatter":
            in_flight += 1
            most = max(most, in_flight)
        elif e.kind == "wait" and e.detail == "reduce_scatter":
            in_flight -= 1
    assert most == limit + 1  # the limit, and the one just issued before the oldest is finished


def test_set_lockstep_after_the_first_forward_switches_the_schedule_between_steps():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        first_step(net)
        net.set_lockstep(True)
        assert isinstance(net._shardkit().schedule.collectives, Lockstep)
        locked = first_step(net)
        net.set_lockstep(False)
        assert type(net._shardkit().schedule).__name__ == "Schedule"
        free = first_step(net)
        loss = net(torch.randn(4, 8)).sum()
        net.set_lockstep(True)  # between forward and backward: the hooks find the new schedule
        with shardkit.trace() as t:
            loss.backward()
    assert len(locked.collectives("all_gather")) == len(free.collectives("all_gather")) == 7
    assert calls(locked, "all_gather") == calls(free, "all_gather")
    assert calls(t, "reduce_scatter") == {"": 1, "blocks.0": 1, "blocks.1": 1, "blocks.2": 1}


def test_set_lockstep_on_hsdp_issues_the_same_collectives_whenever_reduce_scatters_complete(monkeypatch):
    """A (2, 1) HSDP mesh: the replicate dim spans the world, so torch gives it the default
    group, where the lockstep tokens go too. An HSDP all-reduce starts once its reduce-scatter
    is done: if that landed before the next token on one rank and after it on another, the two
    would meet a different collective (make fuzz: lockstep-hsdp-hang.json hung). The order seen
    on the default group must not depend on when the reduce-scatters complete."""
    import shardkit.eager.lockstep as lockstep_module
    from shardkit.comm import streams

    order: list[str] = []
    all_reduce, token = torch.distributed.all_reduce, lockstep_module._all_gather_single
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: (order.append("all_reduce"), all_reduce(*a, **k))[1])
    monkeypatch.setattr(lockstep_module, "_all_gather_single", lambda *a, **k: (order.append("token"), token(*a, **k))[1])
    poll = streams.Streams.poll
    seen = {}
    for complete in (True, False):  # every reduce-scatter done when asked, or none until waited for
        monkeypatch.setattr(streams.Streams, "poll", poll if complete else lambda self, handle: False)
        with fake_world(2):
            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
            assert mesh.get_group(0) is torch.distributed.group.WORLD
            net = sharded(mesh)
            net.set_lockstep(True)
            order.clear()
            first_step(net)
            first_step(net)
            seen[complete] = list(order)
    assert seen[True].count("all_reduce") == 8  # 4 groups, 2 steps
    assert seen[True] == seen[False]


def reduce_ops_and_divisions(net: nn.Module, monkeypatch, build_step) -> tuple[set, set]:
    """The ReduceOps the reduce-scatters were issued with, and the divisors applied after them."""
    ops, divisors = set(), set()
    original = collectives._reduce_scatter_single

    def recording(output, input, op, **kwargs):
        ops.add(op)
        return original(output, input, op=op, **kwargs)

    monkeypatch.setattr(collectives, "_reduce_scatter_single", recording)
    real_finish = collectives.Reduction.finish

    def finish(pending, keep=True):
        divisors.add(pending.divide_by)
        return real_finish(pending, keep)

    monkeypatch.setattr(collectives.Reduction, "finish", finish)
    build_step(net)
    return ops, divisors


def test_fp32_over_one_dim_averages_in_the_collective_and_divides_nothing_after(mesh8, monkeypatch):
    ops, divisors = reduce_ops_and_divisions(sharded(mesh8), monkeypatch, first_step)
    assert (ops, divisors) == ({torch.distributed.ReduceOp.AVG}, {1})


def test_a_user_divide_factor_sums_and_divides_after(mesh8, monkeypatch):
    net = sharded(mesh8)
    for module in net.modules():
        if isinstance(module, FSDPModule):  # each group's own setting
            module.set_gradient_divide_factor(4.0)
    ops, divisors = reduce_ops_and_divisions(net, monkeypatch, first_step)
    assert (ops, divisors) == ({torch.distributed.ReduceOp.SUM}, {4.0})


def test_set_manual_backward_finalization_and_finalize_backward():
    """torch 2.15's pipelining: microbatch backwards with gradient sync off, then
    finalize_backward(async_op=True) issues one reduction per group; wait() finishes them."""
    with fake_world(4) as mesh:
        net = sharded(mesh)
        net.set_manual_backward_finalization(True)
        net.set_requires_gradient_sync(False)
        with shardkit.trace() as t:
            for _ in range(2):
                net(torch.randn(4, 8)).sum().backward()
            assert not t.collectives("reduce_scatter") and all(p.grad is None for p in net.parameters())
            net.set_requires_gradient_sync(True)
            handle = net.finalize_backward(async_op=True)
            assert calls(t, "reduce_scatter") == Counter({"": 1, "blocks.0": 1, "blocks.1": 1, "blocks.2": 1})
            handle.wait()
        assert all(p.grad is not None for p in net.parameters())
        assert net.finalize_backward() is None  # nothing left: no reduction
        assert len(t.collectives("reduce_scatter")) == 4
        with pytest.raises(RuntimeError, match="must be called on the root"):
            net.blocks[0].set_manual_backward_finalization(True)
        net.set_manual_backward_finalization(False)


def test_set_keep_unsharded_storage_is_accepted_and_said_to_do_nothing():
    with fake_world(4) as mesh:
        net = sharded(mesh)
        with pytest.warns(UserWarning, match="set_keep_unsharded_storage has no effect"):
            net.set_keep_unsharded_storage(True)
        t = first_step(net)
    assert calls(t, "reduce_scatter") == Counter({"": 1, "blocks.0": 1, "blocks.1": 1, "blocks.2": 1})


def test_param_dtype_override_fn_keeps_chosen_parameters_in_their_dtype():
    """torch 2.15's MixedPrecisionPolicy field: the blocks' biases stay float32 while the rest
    computes in bfloat16."""
    with fake_world(4) as mesh:
        torch.manual_seed(0)
        net = TanhStack(2, dim=8)
        keep = {id(b[0].bias) for b in net.blocks}
        mp = shardkit.MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: p.dtype if id(p) in keep else None)
        for block in net.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        group = net.blocks[0]._shardkit().group
        assert [p.param_dtype for p in group.params] == [torch.bfloat16, torch.float32]
        with pytest.raises(ValueError, match="param_dtype_override_fn returned torch.float16 for 'weight' of Linear"):
            fully_shard(net.inp, mesh=mesh, mp_policy=shardkit.MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16))
