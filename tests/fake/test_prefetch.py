"""Prefetch schedules on a fake process group: which all-gather is issued before which compute."""

import torch
import torch.nn as nn
from expecttest import assert_expected_inline

import shardkit
from shardkit import fully_shard
from shardkit.comm.streams import Handle
from shardkit.eager.param_group import Holding
from tests.conftest import TanhStack, fake_world


def Net(n_blocks: int = 4) -> TanhStack:
    return TanhStack(n_blocks, dim=8)


def sharded(mesh, n_blocks: int = 4) -> TanhStack:
    torch.manual_seed(0)
    net = Net(n_blocks)
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def schedule(t: shardkit.Trace) -> str:
    """Hooks as they fire ("> pre_forward blocks.0"), collectives as they are issued, and
    "got" where a group's all-gather is waited for and its parameters registered."""
    lines = []
    for e in t.events:
        name = e.group or "<root>"
        if e.kind == "phase":
            event = e.detail.split(":")[0]
            if event != "finalize":
                lines.append(f"> {event} {name}")
        elif e.kind == "unshard":
            lines.append(f"    got {name}")
        elif e.kind in ("all_gather", "reduce_scatter"):
            lines.append(f"    {e.kind} {name}")
    return "\n".join(lines)


def step(net: TanhStack) -> shardkit.Trace:
    with shardkit.trace() as t:
        net(torch.randn(2, 8)).sum().backward()
    return t


def test_four_block_schedule_prefetches_the_next_group_in_both_directions():
    with fake_world(8, 0) as mesh:
        net = sharded(mesh)
        step(net)  # the first forward records the order the second one prefetches in
        t = step(net)
    assert_expected_inline(schedule(t), """\
> start_forward <root>
    all_gather <root>
    got <root>
    all_gather blocks.0
> pre_forward blocks.0
    got blocks.0
    all_gather blocks.1
> post_forward blocks.0
> pre_forward blocks.1
    got blocks.1
    all_gather blocks.2
> post_forward blocks.1
> pre_forward blocks.2
    got blocks.2
    all_gather blocks.3
> post_forward blocks.2
> pre_forward blocks.3
    got blocks.3
> post_forward blocks.3
> end_forward <root>
> pre_backward <root>
    all_gather blocks.3
> pre_backward blocks.3
    got blocks.3
    all_gather blocks.2
> post_backward blocks.3
    reduce_scatter blocks.3
> pre_backward blocks.2
    got blocks.2
    all_gather blocks.1
> post_backward blocks.2
    reduce_scatter blocks.2
> pre_backward blocks.1
    got blocks.1
    all_gather blocks.0
> post_backward blocks.1
    reduce_scatter blocks.1
> pre_backward blocks.0
    got blocks.0
> post_backward blocks.0
    reduce_scatter blocks.0
> post_backward <root>
    reduce_scatter <root>""")


def gathered_blocks(net: TanhStack) -> list[int]:
    """Blocks whose all-gather is issued or whose unsharded data is held."""
    return [i for i, b in enumerate(net.blocks) if b._shardkit().group.holding is not Holding.SHARDED]


def test_at_most_two_block_all_gathers_in_flight_and_none_after_the_step():
    with fake_world(4, 0) as mesh:
        net = sharded(mesh, n_blocks=6)
        seen = []
        for block in net.blocks:
            block.register_forward_pre_hook(lambda *_: seen.append(len(gathered_blocks(net))))
            block.register_full_backward_pre_hook(lambda *_: seen.append(len(gathered_blocks(net))))
        for _ in range(3):
            step(net)
            assert gathered_blocks(net) == []
    assert max(seen) == 2 and len(seen) == 3 * 12


def test_explicit_prefetch_lists_replace_the_implicit_order():
    with fake_world(4, 0) as mesh:
        net = sharded(mesh)
        b = net.blocks
        b[0].set_modules_to_forward_prefetch([b[1], b[2]])
        b[1].set_modules_to_forward_prefetch([])  # b[2] already came with b[0]
        b[2].set_modules_to_forward_prefetch([])
        b[3].set_modules_to_backward_prefetch([b[2], b[1]])
        for blk in b[:3]:
            blk.set_modules_to_backward_prefetch([])
        step(net)
        t = step(net)
    lines = schedule(t).splitlines()
    forward = lines[: lines.index("> end_forward <root>")]
    backward = lines[len(forward):]
    assert forward[forward.index("> pre_forward blocks.0") :][:4] == [
        "> pre_forward blocks.0", "    got blocks.0", "    all_gather blocks.1", "    all_gather blocks.2"]
    # blocks.2 prefetches nothing, so blocks.3 is gathered on demand, in its own pre-forward
    assert forward[forward.index("> pre_forward blocks.3") :][:2] == ["> pre_forward blocks.3", "    all_gather blocks.3"]
    assert backward[backward.index("> pre_backward blocks.3") :][:4] == [
        "> pre_backward blocks.3", "    got blocks.3", "    all_gather blocks.2", "    all_gather blocks.1"]
    assert backward.count("    all_gather blocks.0") == 1  # gathered on demand at its own pre-backward


def test_a_forward_that_skips_a_block_frees_the_prefetched_group():
    with fake_world(4, 0) as mesh:
        net = sharded(mesh)
        step(net)
        skipped = net.blocks[1]
        net.blocks[1] = nn.Identity()  # the recorded order says blocks.1 comes next: prefetched, not run
        with shardkit.trace() as t:
            net(torch.randn(2, 8)).sum().backward()
        net.blocks[1] = skipped
        assert gathered_blocks(net) == []
        assert "    all_gather blocks.1" in schedule(t)
        step(net)  # and the next step runs normally
        assert gathered_blocks(net) == []


def reductions() -> str:
    """In a second step: when each reduce-scatter is issued and when it is finished (waited
    for, handed to .grad)."""
    with fake_world(4, 0) as mesh:
        net = sharded(mesh)
        step(net)
        t = step(net)
    keep = [e for e in t.events if e.kind == "reduce_scatter" or e.kind == "wait" and e.detail == "reduce_scatter"]
    return "\n".join(str(e) for e in keep)


def test_reduce_scatters_finish_once_done_at_the_next_post_backward():
    assert_expected_inline(reductions(), """\
reduce_scatter blocks.3 float32 numel=80 world=4 mesh=dim0
reduce_scatter blocks.2 float32 numel=80 world=4 mesh=dim0
wait reduce_scatter blocks.3
reduce_scatter blocks.1 float32 numel=80 world=4 mesh=dim0
wait reduce_scatter blocks.2
reduce_scatter blocks.0 float32 numel=80 world=4 mesh=dim0
wait reduce_scatter blocks.1
reduce_scatter <root> float32 numel=124 world=4 mesh=dim0
wait reduce_scatter blocks.0
wait reduce_scatter <root>""")


def test_reduce_scatters_that_do_not_complete_finish_oldest_first_two_in_flight(monkeypatch):
    monkeypatch.setattr(Handle, "poll", lambda self: False)  # a network slower than the compute
    assert_expected_inline(reductions(), """\
reduce_scatter blocks.3 float32 numel=80 world=4 mesh=dim0
reduce_scatter blocks.2 float32 numel=80 world=4 mesh=dim0
reduce_scatter blocks.1 float32 numel=80 world=4 mesh=dim0
wait reduce_scatter blocks.3
reduce_scatter blocks.0 float32 numel=80 world=4 mesh=dim0
wait reduce_scatter blocks.2
reduce_scatter <root> float32 numel=124 world=4 mesh=dim0
wait reduce_scatter blocks.1
wait reduce_scatter blocks.0
wait reduce_scatter <root>""")
