"""torch.compile AFTER fully_shard, on 2 gloo ranks: what dynamo compiles, where it breaks.

``torch.compile(model)`` on a sharded model and ``torch.compile(block)`` on an already
sharded block both compile each block's forward (one dynamo graph, shared by the identical
blocks) and, through AOTAutograd, its backward; the hooks run eagerly between the compiled
graphs. Dynamo's only graph breaks are at the hooks (shardkit's are
``torch.compiler.disable``d; FSDP2's call ``torch._dynamo.disable``). A root that calls its
blocks in a ``for`` loop runs its own code (``inp``, ``out``) eagerly: a graph break inside a
loop makes dynamo skip that frame (torch/_dynamo/symbolic_convert.py, "graph break in
loop"), so only the frames below it (each block's ``forward``) are compiled. The same root
with its blocks called one by one also compiles its own code, around each hook. Blocks that
are torch.nn built-ins (nn.Sequential, nn.TransformerEncoderLayer) compile only because
shardkit's FSDP subclass keeps its base's ``__module__`` (see the last check).

The counting backend is aot_eager with counting compilers: the graphs dynamo captures, the
forward and backward graphs AOTAutograd compiles, and how often each compiled graph runs.
Losses and gradients are checked every step against the non-sharded reference (``Parity``),
and the losses against the same sharded model run eagerly. Every check also runs with
torch's FSDP2 (``-torch`` items): the same counts in torch 2.13, 2.14 and 2.15, except that FSDP2
compiles nothing of torch.nn built-in blocks.
"""

import pytest
import torch
import torch.nn as nn
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._dynamo.utils import counters

import shardkit.eager.hooks
from gloo_harness import Checks, run_worker
from gloo_parity import FULLY_SHARD, Parity

checks = Checks(compiling=True)  # torch.compile: ranks compile each graph apart (gloo_harness.COMPILING_CHECK_TIMEOUT_S)
STEPS = 3
BLOCKS = 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Stack(nn.Module):
    """The usual root: its own layers around a loop over the blocks (GPT, nn.Sequential)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class BuiltinBlocks(Stack):
    """Blocks that are torch.nn built-ins (an nn.Sequential each), under the same root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(BLOCKS))


class Unrolled(Stack):
    """The same model, its blocks called one by one: no loop around the hooks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        x = self.blocks[2](x)
        return self.out(x)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


class Counting:
    """A dynamo backend: aot_eager, counting dynamo's graphs (their ops), the forward and
    backward graphs AOTAutograd compiles, and the runs of each compiled graph."""

    def __init__(self) -> None:
        self.graphs: list[list[str]] = []
        self.compiled = {"forward": 0, "backward": 0}
        self.runs = {"forward": 0, "backward": 0}

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        ops = [n.target for n in gm.graph.nodes if n.op.startswith("call")]
        self.graphs.append([getattr(op, "__name__", str(op)) for op in ops])
        return aot_eager(gm, example_inputs, fw_compiler=self._compiler("forward"), bw_compiler=self._compiler("backward"))

    def _compiler(self, kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: list):
            self.compiled[kind] += 1
            run = boxed_nop(gm, example_inputs)

            def counted(args):
                self.runs[kind] += 1
                return run(args)

            counted._boxed_call = True
            return counted

        return compile_graph


# FSDP2's hooks are wrappers calling torch._dynamo.disable(hook, recursive=True, reason="skipping
# FSDP hooks")(...) (fsdp/_fully_shard/_fsdp_common.py, _dynamo_disable; the same in torch 2.13 to
# 2.15). Dynamo's text for that call changed, so each known wording is listed, every part of one
# required: torch 2.13 skips ``disable`` itself as a function of a skipped file (gb0007); torch
# 2.14 and 2.15 break at the call (gb0376) and show its arguments, FSDP2's reason among them.
FSDP2_HOOK_BREAKS = (
    ("Attempted to call function marked as skipped", "the function `disable` in file",
     "qualname: disable"),  # torch 2.13
    ("Call to `torch._dynamo.disable()`", "'skipping FSDP hooks'"),  # torch 2.14, 2.15
)


def hook_signatures(impl: str) -> list[tuple[str, ...]]:
    """How dynamo names the hook it stops at, in its graph-break reason: one tuple of texts
    per wording, all of which the reason holds."""
    if impl == "shardkit":  # the torch.compiler.disable'd hooks themselves
        return [(repr(f),) for f in (shardkit.eager.hooks.pre_forward, shardkit.eager.hooks.post_forward)]
    return list(FSDP2_HOOK_BREAKS)


def graph_break_reasons() -> list[str]:
    """Every graph break and frame skip dynamo recorded since ``counters.clear()``."""
    return [reason for kind in ("graph_break", "unimplemented") for reason in counters[kind]]


def is_hook_break(reason: str, impl: str) -> bool:
    first = reason.split("*** While handling this graph break")[0]  # a loop skip names its cause first
    return any(all(part in first for part in sig) for sig in hook_signatures(impl))


def assert_breaks_only_at_hooks(impl: str) -> list[str]:
    reasons = graph_break_reasons()
    assert reasons, "dynamo met no hook: was anything compiled?"
    for reason in reasons:
        assert is_hook_break(reason, impl), f"a graph break not at a hook:\n{reason}"
    return reasons


def train(mesh, impl: str, make_model, compile_where: str | None) -> tuple[Counting, list]:
    """Shard blocks then root; compile the model or each sharded block (or nothing); train
    STEPS steps, checking losses and gradients against the reference at each."""
    backend = Counting()

    def shard(model):
        for i, block in enumerate(model.blocks):
            FULLY_SHARD[impl](block, mesh=mesh)
            if compile_where == "blocks":
                model.blocks[i] = torch.compile(block, backend=backend)
        FULLY_SHARD[impl](model, mesh=mesh)

    p = Parity.build(make_model, shard, mesh, impl)
    if compile_where == "model":
        p.model = torch.compile(p.model, backend=backend)
    passes = p.train(batches(STEPS))
    p.assert_params_match()
    return backend, passes


def train_compiled_and_eager(mesh, impl: str, make_model, compile_where: str) -> Counting:
    torch._dynamo.reset()
    counters.clear()
    backend, compiled = train(mesh, impl, make_model, compile_where)
    _, eager = train(mesh, impl, make_model, None)
    for i, (c, e) in enumerate(zip(compiled, eager)):  # aot_eager runs the same kernels: bitwise
        assert torch.equal(c.loss, e.loss), f"step {i}: compiled loss {c.loss} != eager loss {e.loss}"
    return backend


def assert_each_block_compiled(backend: Counting) -> None:
    # One graph: Block.forward, reused by the three identical blocks (same code, guards pass).
    assert backend.graphs == [["linear", "tanh"]], f"dynamo's graphs {backend.graphs}, expected the blocks' forward"
    assert backend.compiled == {"forward": 1, "backward": 1}, backend.compiled
    # ... and every block's forward and backward ran it, every step
    assert backend.runs == {"forward": BLOCKS * STEPS, "backward": BLOCKS * STEPS}, backend.runs


@checks(sim=False)  # dynamo does not trace under the simulated streams' dispatch mode
def compile_model_after_fully_shard_compiles_each_block(mesh, impl):
    backend = train_compiled_and_eager(mesh, impl, Stack, "model")
    assert_each_block_compiled(backend)
    reasons = assert_breaks_only_at_hooks(impl)
    # The root's own layers (inp, out) ran eagerly: the hook's graph break sits inside the
    # root's loop over its blocks, and dynamo skips a frame with a graph break in a loop.
    code = Stack.forward.__code__
    skipped = f"frame skipped: forward ({code.co_filename} line {code.co_firstlineno})"
    assert any("graph break in loop" in r and skipped in r for r in reasons), reasons


@checks(sim=False)
def compile_sharded_blocks_compiles_each_block(mesh, impl):
    backend = train_compiled_and_eager(mesh, impl, Stack, "blocks")
    assert_each_block_compiled(backend)
    # No graph break at all: dynamo does not trace nn.Module.__call__ (torch/nn is in its skip
    # files), so the compiled block runs its hooks eagerly and dynamo starts at Block.forward.
    assert graph_break_reasons() == [], graph_break_reasons()


@checks(sim=False)
def compile_model_without_loop_breaks_only_at_the_hooks(mesh, impl):
    backend = train_compiled_and_eager(mesh, impl, Unrolled, "model")
    # The root up to the first block's hook (inp), the block, the root after the last one
    # (out); the resumes between two blocks hold no op, so dynamo compiles no graph for them.
    assert backend.graphs == [["linear"], ["linear", "tanh"], ["linear"]], backend.graphs
    assert backend.compiled == {"forward": 3, "backward": 3}, backend.compiled
    assert backend.runs == {"forward": (BLOCKS + 2) * STEPS, "backward": (BLOCKS + 2) * STEPS}, backend.runs
    reasons = assert_breaks_only_at_hooks(impl)
    code = Unrolled.forward.__code__
    assert not any(f"forward ({code.co_filename} line {code.co_firstlineno})" in r for r in reasons), reasons


@checks(sim=False)
def compile_model_compiles_torch_nn_builtin_blocks(mesh, impl):
    """Dynamo skips torch/nn's files as frames of their own, except the forward of a torch.nn
    module with hooks whose type(module).__module__ starts with "torch.nn." (trace_rules.py,
    check_verbose). shardkit's FSDP subclass keeps its base's __module__; FSDP2's lives in
    torch.distributed.fsdp, so with FSDP2 nothing of these blocks is compiled (torch 2.13 to 2.15)."""
    backend = train_compiled_and_eager(mesh, impl, BuiltinBlocks, "model")
    if impl == "torch":  # pins FSDP2 (torch 2.13 to 2.15): its hooks run, nothing of the blocks compiles
        assert backend.graphs == [] and backend.runs == {"forward": 0, "backward": 0}, (backend.graphs, backend.runs)
        return
    assert_each_block_compiled(backend)
    assert_breaks_only_at_hooks(impl)


def test_hook_signatures_match_fsdp2_hooks_and_nothing_else():
    """In this process, no ranks: a call like FSDP2's hook wrapper is a hook break in this
    torch, and other graph breaks (one asked for, an unsupported call) are not."""

    def fsdp2_like(x):
        return torch._dynamo.disable(torch.tanh, recursive=True, reason="skipping FSDP hooks")(x)

    def reasons_of(fn) -> list[str]:
        torch._dynamo.reset()
        counters.clear()
        torch.compile(lambda x: fn(x * 2) + 1, backend="eager")(torch.ones(2))
        return graph_break_reasons()

    try:
        hook = reasons_of(fsdp2_like)
        assert hook and any(is_hook_break(r, "torch") for r in hook), hook
        for other in (lambda x: (torch._dynamo.graph_break(), x)[1], lambda x: x + x.sum().item()):
            found = reasons_of(other)
            assert found and not any(is_hook_break(r, "torch") or is_hook_break(r, "shardkit") for r in found), found
    finally:
        torch._dynamo.reset()
        counters.clear()


@pytest.mark.parametrize("case", checks.cases(), ids=str)
def test_compile_after_fully_shard_on_two_ranks(gloo_outcomes, case):
    gloo_outcomes.assert_passed(case)


if __name__ == "__main__":
    run_worker(checks)
