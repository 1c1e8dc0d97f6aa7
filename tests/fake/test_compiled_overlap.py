"""shardkit.compiled's overlap as inductor compiles it (the default backend), on the fake
process group (world 8): where the generated forward and backward code issues each collective
and waits for it. (The rule on hand-written graphs: tests/unit/test_overlap_order.py; the
numbers it computes, on gloo ranks: tests/gloo/test_compiled_mode.py.)"""

import re

import pytest
import torch
from torch._inductor.utils import get_code

import shardkit.compiled
from tests.conftest import fake_world
from tests.fake.test_compiled_graphs import batch, gpt

CALL = re.compile(r"(buf\d+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)\.default\(")
WAIT = re.compile(r"torch\.ops\._c10d_functional\.wait_tensor\.default\((buf\d+)\)")
COMPUTE = re.compile(r"^\s*(extern_kernels\.\w+|cpp_fused_\w+)\(")


def events(code: str) -> list[tuple[str, str]]:
    """The generated code's calls in order: (kind, buffer) of each collective and wait, and
    ("compute", "") for each kernel (an extern kernel such as a matmul, or a fused C++ one)."""
    body = code[code.index("def call(") :]
    found = []
    for line in body.splitlines():
        if m := CALL.search(line):
            found.append((m.group(2), m.group(1)))
        elif m := WAIT.search(line):
            found.append(("wait", m.group(1)))
        elif COMPUTE.match(line):
            found.append(("compute", ""))
    return found


def spans(found: list[tuple[str, str]], kind: str) -> list[tuple[int, int]]:
    """(issued at, waited at) of each ``kind`` collective, in issue order."""
    issued = {buf: at for at, (k, buf) in enumerate(found) if k == kind}
    waited = {buf: at for at, (k, buf) in enumerate(found) if k == "wait" and buf in issued}
    assert set(waited) == set(issued), f"a {kind} is never waited for"
    return sorted((issued[b], waited[b]) for b in issued)


def computes_between(found, start: int, end: int) -> int:
    return sum(k == "compute" for k, _ in found[start:end])


def in_flight(found, spans_: list[tuple[int, int]]) -> int:
    """The most collectives issued and not yet waited for while a kernel runs. (Between two
    kernels the count may be higher: from torch 2.14 on, inductor's ``simple_overlap`` pass,
    run after shardkit's, issues a collective before the previous one's wait when no kernel
    lies between them, a swap it checks does not raise peak memory.)"""
    computes = [at for at, (k, _) in enumerate(found) if k == "compute"]
    return max(sum(s < at < e for s, e in spans_) for at in computes)


def test_inductor_overlaps_each_groups_collectives_with_the_neighbouring_groups_compute():
    forward, backward = compiled_events()
    # forward: the root's, then each block's all-gather; each after the first is issued once
    # the previous one has arrived and arrives during that group's compute (one in flight, two
    # groups unsharded: the one computing, the one arriving)
    gathers = spans(forward, "all_gather_into_tensor")
    assert len(gathers) == 3 and not spans_of(forward, "reduce_scatter_tensor")
    assert all(computes_between(forward, s, e) > 0 for s, e in gathers[1:]), forward
    assert in_flight(forward, gathers) == 1
    # backward: each block re-gathers (the root keeps its parameters: reshard_after_forward is
    # False for it) during the previous block's compute; each reduce-scatter but the last is
    # waited for only after the next group's compute, by the time the next one is issued
    gathers, scatters = spans(backward, "all_gather_into_tensor"), spans(backward, "reduce_scatter_tensor")
    assert len(gathers) == 2 and len(scatters) == 3
    assert computes_between(backward, *gathers[1]) > 0, backward
    assert all(computes_between(backward, s, e) > 0 for s, e in scatters[:-1]), backward
    assert in_flight(backward, gathers) == 1 and in_flight(backward, scatters) == 1, backward


def spans_of(found, kind: str) -> list:
    return [f for f in found if f[0] == kind]


def test_in_two_steps_each_blocks_gather_overlaps_the_previous_groups_compute():
    """reshard_after_forward=2 (every group, the root too): forward gathers each group in two
    steps (shardkit/compiled/gather.py). The blocks' second steps, and blocks.1's first, run
    during the previous group's compute; the root's, the first thing the step needs, and
    blocks.0's first (issued with them) have nothing to hide behind (but a copy-in that torch
    2.14's ``simple_overlap`` may move in). Backward gathers in
    one step (among 2 ranks), overlapped as without the setting."""
    forward, backward = compiled_events(reshard_after_forward=2)
    gathers = spans(forward, "all_gather_into_tensor")
    assert len(gathers) == 6
    assert all(computes_between(forward, s, e) > 0 for s, e in gathers[3:]), forward
    assert in_flight(forward, gathers) <= 2
    gathers, scatters = spans(backward, "all_gather_into_tensor"), spans(backward, "reduce_scatter_tensor")
    assert len(gathers) == 3 and len(scatters) == 3
    assert all(computes_between(backward, s, e) > 0 for s, e in gathers[1:] + scatters[:-1]), backward
    assert in_flight(backward, gathers) == 1 and in_flight(backward, scatters) == 1, backward


def compiled_events(**kwargs) -> tuple[list, list]:
    """The forward's and the backward's events of one inductor-compiled step of the GPT: the
    code inductor generates for both graphs at the first forward (the backward's lowered then
    too), and no more. Its C++ kernels are not compiled (most of a compile on CPU; their code
    is not what is checked) and nothing runs: the forward returns nothing, which the runtime
    wrapper refuses (a TypeError, or an AssertionError where no wrapper of subclass inputs
    comes first), after the code is generated."""

    def first_forward():
        with pytest.raises((TypeError, AssertionError)):
            model(*batch())

    with fake_world(8) as mesh, torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
        model = torch.compile(gpt(shardkit.compiled.fully_shard, mesh=mesh, **kwargs), fullgraph=True)
        codes = [code for code in get_code(first_forward) if "def call(" in code]  # (get_code resets dynamo first)
    assert len(codes) == 2, f"{len(codes)} wrappers generated, not a forward and a backward"
    forward, backward = (events(code) for code in codes)
    return forward, backward
