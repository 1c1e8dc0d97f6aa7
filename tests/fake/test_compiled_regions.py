"""Compiled mode's repeated blocks as nested compile regions (shardkit/compiled/region.py), on the
fake process group (world 8): which groups become regions, one subgraph called once per block
(forward and backward), the block's collectives inside it with eager's bytes, no recompilation,
the trace, and peak memory.
"""

import contextlib
from collections import Counter

import pytest
import torch
from torch._dynamo.utils import counters

import shardkit
import shardkit.compiled
from shardkit.compiled import region
from shardkit.models.gpt import GPT, GPTConfig, apply_fully_shard
from tests.conftest import fake_world
from tests.fake.test_compiled_graphs import WORLD, Recording, graph_collectives

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=16, vocab_size=65)
REGIONS_FROM = 4  # here, for short compiles (the default is 8): these 4 blocks are regions


@pytest.fixture(autouse=True)
def _restore():
    """Regions turn inductor's buffer reuse and in-place buffers off, globally (region._no_buffer_reuse)."""
    from torch._inductor import config

    reuse, inplace, regions_from = config.allow_buffer_reuse, config.inplace_buffers, region.REGIONS_FROM
    region.REGIONS_FROM = REGIONS_FROM
    yield
    config.allow_buffer_reuse, config.inplace_buffers, region.REGIONS_FROM = reuse, inplace, regions_from


def gpt(fully_shard, config=CONFIG, edit=lambda model: None, **kwargs) -> GPT:
    torch.manual_seed(0)
    model = GPT(config)
    edit(model)
    return apply_fully_shard(model, fully_shard, **kwargs)


def batch():
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size), generator=torch.Generator().manual_seed(0))
    return x, x


def calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph each invoke_subgraph of ``gm`` calls, in graph order."""
    return [n.args[0].target for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]


def collectives(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """(kind, bytes) of the graph's collectives, a region's counted once per call of it."""
    inside = [found for sub in calls(gm) for found in graph_collectives(getattr(gm, sub))]
    return graph_collectives(gm) + inside


def step(model):
    _, loss = model(*batch())
    loss.backward()


def test_repeated_blocks_compile_once_with_eager_modes_collectives_and_trace():
    """REGIONS_FROM (here 4) blocks of one structure: each block is one call of ONE forward subgraph and
    ONE backward subgraph, which hold the block's all-gather (backward: the all-gather again,
    reshard_after_forward, and the reduce-scatter); the root gathers in the outer graph. The
    collectives and their bytes are eager shardkit's, and three more steps compile nothing.
    The trace records a region's collectives around its call (the trace op is not inside the
    region): the same records as eager shardkit, forward's all-gathers and backward's
    reduce-scatters, each done after it was issued."""
    from tests.fake.test_compiled_graphs import eager_trace
    import tests.fake.test_compiled_graphs as graphs

    with fake_world(WORLD) as mesh, _config(graphs, CONFIG):
        torch._dynamo.reset()
        counters.clear()
        recording = Recording()
        model = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        assert [g.region for g in (b._shardkit_state for b in model.blocks)] == [True] * CONFIG.n_layer
        assert not model._shardkit_state.region  # the root is never a region
        compiled = torch.compile(model, fullgraph=True, backend=recording)
        step(compiled)
        eager_forward, eager_backward = eager_trace(mesh)
        for _ in range(2):
            step(compiled)
        with shardkit.trace() as traced:
            step(compiled)
        with shardkit.trace() as eager:
            step(gpt(shardkit.fully_shard, mesh=mesh))
    assert recording.dynamo_graphs == 1 and [len(recording.graphs[k]) for k in ("forward", "backward")] == [1, 1]
    assert not counters["graph_break"], dict(counters["graph_break"])
    forward, backward = recording.graphs["forward"][0], recording.graphs["backward"][0]
    assert len(calls(forward)) == len(calls(backward)) == CONFIG.n_layer
    assert len(set(calls(forward))) == len(set(calls(backward))) == 1
    block = getattr(forward, calls(forward)[0])
    assert [kind for kind, _ in graph_collectives(block)] == ["all_gather"]
    assert Counter(k for k, _ in graph_collectives(getattr(backward, calls(backward)[0]))) == {"all_gather": 1, "reduce_scatter": 1}
    assert Counter(collectives(forward)) == Counter(eager_forward)
    assert Counter(collectives(backward)) == Counter(eager_backward)

    describe = lambda e: (e.kind, e.group, e.dtype, e.numel, e.world, e.mesh_dim)  # noqa: E731
    recomputed = Counter({describe(e) for e in eager.collectives("all_gather") if e.group != ""})
    expected = Counter(describe(e) for e in eager.collectives()) - recomputed
    assert Counter(describe(e) for e in traced.collectives()) == expected
    assert all(e.done_ns >= e.t for e in traced.collectives())
    order = [(e.kind, e.group) for e in traced.collectives()]
    blocks = [f"blocks.{i}" for i in range(CONFIG.n_layer)]
    assert [g for k, g in order if k == "all_gather" and g != ""] == blocks
    assert [g for k, g in order if k == "reduce_scatter" and g != ""] == blocks[::-1]


@contextlib.contextmanager
def _config(module, config):
    before = module.CONFIG
    module.CONFIG = config
    try:
        yield
    finally:
        module.CONFIG = before


def test_fewer_blocks_than_regions_from_are_traced_inline():
    few = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=65)
    with fake_world(WORLD) as mesh:
        model = gpt(shardkit.compiled.fully_shard, config=few, mesh=mesh)
        assert not any(b._shardkit_state.region for b in model.blocks)
        region.REGIONS_FROM = 2
        model = gpt(shardkit.compiled.fully_shard, config=few, mesh=mesh)
        assert all(b._shardkit_state.region for b in model.blocks)


def test_blocks_that_differ_get_a_subgraph_of_their_own():
    """Blocks with another n_head (a plain attribute: the same parameters, other code) are
    another structure. REGIONS_FROM=2, five blocks: blocks 0 and 1 with 4 heads, block 2 alone
    with 8, blocks 3 and 4 as made (2): each structure of two blocks has its subgraph (2 calls
    and 2), and block 2, alone of its structure, is traced inline."""
    region.REGIONS_FROM = 2
    heads = [4, 4, 8, 2, 2]

    def edit(model):
        for block, n_head in zip(model.blocks, heads):
            block.attn.n_head = n_head

    with fake_world(WORLD) as mesh:
        torch._dynamo.reset()
        recording = Recording()
        model = gpt(shardkit.compiled.fully_shard, config=GPTConfig(**{**vars(CONFIG), "n_layer": len(heads)}), edit=edit, mesh=mesh)
        assert [b._shardkit_state.region for b in model.blocks] == [True, True, False, True, True]
        step(torch.compile(model, fullgraph=True, backend=recording))
    forward = recording.graphs["forward"][0]
    assert sorted(Counter(calls(forward)).values()) == [2, 2], calls(forward)
    assert calls(forward)[0] == calls(forward)[1] != calls(forward)[2] == calls(forward)[3], calls(forward)


def test_peak_memory_with_regions_is_at_most_eager_shardkits():
    """The region recomputes its all-gather in backward (reshard_after_forward): its unsharded
    parameters are not saved across the region's boundary."""
    from tests.fake.test_compiled_graphs import peak_mib
    import tests.fake.test_compiled_graphs as graphs

    two = GPTConfig(**{**vars(CONFIG), "n_layer": 2})  # (two blocks as regions: shorter compiles)
    region.REGIONS_FROM = 2
    with fake_world(WORLD) as mesh, _config(graphs, two):
        compiled = peak_mib(mesh, "compiled", True)
        assert graphs.gpt(shardkit.compiled.fully_shard, mesh=mesh).blocks[0]._shardkit_state.region
        eager = peak_mib(mesh, "eager", True)
        region.REGIONS_FROM = 3
        inline = peak_mib(mesh, "compiled", True)
    assert compiled <= eager, (compiled, eager)
    assert compiled <= inline * 1.05, (compiled, inline)


def test_the_region_key_tells_apart_what_changes_the_code():
    """(No compile.) Two blocks share a region only if the key says so: the same structure and
    call give one id; another plain attribute (n_head), another parameter shape, another
    setting (divide factor, sync), other input shapes or grad mode each give another."""
    from shardkit.compiled.gather import Settings, gather_inputs

    def key(block, settings=None, shape=(2, 16, 32), grad=True):
        group = block._shardkit_state
        settings = settings or Settings.of(group)
        shards, kept = gather_inputs(group, settings)
        with torch.set_grad_enabled(grad):
            return region._key(block, *region._flat(settings, shards, kept, (torch.zeros(shape, requires_grad=True),)))

    def wider(model):
        model.blocks[1].attn.n_head = 4

    with fake_world(WORLD) as mesh:
        model = gpt(shardkit.compiled.fully_shard, edit=wider, mesh=mesh)
        a, b, c = model.blocks[0], model.blocks[1], model.blocks[2]
        assert region.structure(a) == region.structure(c) != region.structure(b)
        base = Settings.of(a._shardkit_state)
        assert key(a) == key(c) == key(a)
        others = [key(b), key(a, base._replace(divide_by=3.0)), key(a, base._replace(sync=False)),
                  key(a, base._replace(reshard=False)), key(a, shape=(2, 8, 32)), key(a, grad=False)]
        assert len({key(a), *others}) == 1 + len(others)
        other_config = GPTConfig(n_layer=2, n_embd=64, n_head=2, block_size=16, vocab_size=65)
        assert region.structure(gpt(shardkit.compiled.fully_shard, config=other_config, mesh=mesh).blocks[0]) != region.structure(a)


def test_aot_traces_a_regions_body_for_its_schema_once_whatever_the_block_count(monkeypatch):
    """AOTAutograd asks invoke_subgraph's schema at every region call, and torch traces the
    subgraph again for it (materialize_as_graph): once per block, most of a region's compile.
    region._schema_once_per_subgraph keeps it: as many traces for 3 blocks as for 2 (3: the
    forward and the joint's two; without it, 3 more per block: 8 and 11)."""
    from torch._higher_order_ops import utils as hop_utils

    traced = [0]
    plain = hop_utils.materialize_as_graph

    def counting(*args, **kwargs):
        traced[0] += 1
        return plain(*args, **kwargs)

    monkeypatch.setattr(hop_utils, "materialize_as_graph", counting)
    found = {}
    region.REGIONS_FROM = 2
    with fake_world(WORLD) as mesh:
        for layers in (2, 3):
            torch._dynamo.reset()
            traced[0] = 0
            recording = Recording()
            model = gpt(shardkit.compiled.fully_shard, config=GPTConfig(**{**vars(CONFIG), "n_layer": layers}), mesh=mesh)
            assert all(b._shardkit_state.region for b in model.blocks)
            step(torch.compile(model, fullgraph=True, backend=recording))
            assert len(set(calls(recording.graphs["forward"][0]))) == 1
            found[layers] = traced[0]
    assert found[3] == found[2] <= 4, found


def test_a_kept_schema_is_recomputed_when_the_subgraph_or_its_operands_change():
    """The schema kept per subgraph is the one torch computes: an in-place op added to the graph
    (an input written), other operand shapes, or two operands that alias give a new one."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    region._schema_once_per_subgraph()

    def body(x, y):
        return (x * y,)

    gm = torch.fx.symbolic_trace(body)
    x, y = torch.randn(3), torch.randn(3)
    first = invoke_subgraph.gen_schema(gm, "s", x, y)
    assert invoke_subgraph.gen_schema(gm, "s", x, y) is first and not any(a.is_write for a in first.arguments)
    assert invoke_subgraph.gen_schema(gm, "s", torch.randn(4), torch.randn(4)) is not first
    assert invoke_subgraph.gen_schema(gm, "s", x, x) is not first
    placeholder = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(placeholder):
        gm.graph.call_function(torch.ops.aten.add_.Tensor, (placeholder, 1))
    gm.recompile()
    written = invoke_subgraph.gen_schema(gm, "s", x, y)
    assert [a.is_write for a in written.arguments if a.name.startswith("arg")] == [True, False], written


class _KwBlock(torch.nn.Module):
    """A block its model calls with keyword arguments: a constant, a tensor or None, a tuple of tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x, *, scale=1.0, extra=None, pair=(), cache=None):
        y = self.lin(self.norm(x)) * scale
        if extra is not None:
            y = y + extra
        for t in pair:
            y = y * t
        if cache is not None:  # an object the block writes to: no region may take it
            cache.seen.append(y.shape)
        return x + y


class _Cache:
    def __init__(self) -> None:
        self.seen: list = []


class _KwModel(torch.nn.Module):
    def __init__(self, blocks: int = 4) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 16)
        self.blocks = torch.nn.ModuleList(_KwBlock() for _ in range(blocks))

    def forward(self, x, cache=None):
        h = first = self.inp(x)
        for i, block in enumerate(self.blocks):  # (``first`` requires grad: its gradient comes back through the regions' backward)
            h = block(h, scale=0.5, extra=first if i % 2 else None, pair=(x.sigmoid(), first.cos()), cache=cache)
        return h.square().mean()


def _kw_model(fully_shard, mesh):
    torch.manual_seed(0)
    model = _KwModel()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def test_blocks_called_with_keyword_arguments_run_as_regions_and_match_eager():
    """A block called with keyword arguments (a constant, a tensor or None, a tuple of tensors,
    tensors that require grad among them) runs as a region: one subgraph per distinct call (here two: ``extra`` a tensor or None),
    each called by two of the four blocks, in one graph. World 1, so the numbers mean something:
    the loss and every gradient equal eager shardkit's bit for bit (aot_eager). Called with an
    object the block writes to (a cache), the blocks run inline instead: no subgraph, and the
    cache sees every block's write."""
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    with fake_world(1) as mesh:
        eager = _kw_model(shardkit.fully_shard, mesh)
        eager_loss = eager(x)
        eager_loss.backward()
        torch._dynamo.reset()
        counters.clear()
        recording = Recording()
        model = _kw_model(shardkit.compiled.fully_shard, mesh)
        assert all(b._shardkit_state.region for b in model.blocks)
        compiled = torch.compile(model, fullgraph=True, backend=recording)
        loss = compiled(x)
        loss.backward()
        assert recording.dynamo_graphs == 1
        subgraphs = calls(recording.graphs["forward"][0])
        assert len(subgraphs) == 4 and len(set(subgraphs)) == 2 and subgraphs[0] == subgraphs[2] and subgraphs[1] == subgraphs[3], subgraphs
        assert torch.equal(loss, eager_loss)
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), name

        torch._dynamo.reset()
        recording, cache = Recording(), _Cache()
        torch.compile(model, fullgraph=True, backend=recording)(x, cache).backward()
        assert not calls(recording.graphs["forward"][0]) and len(cache.seen) == 4


def test_with_inductor_blocks_taking_a_second_tensor_get_eager_modes_gradients():
    """Inductor, world 1, the four blocks as regions, each also taking the first layer's output
    (which requires grad): every gradient within float rounding of eager shardkit's, two steps.
    Inductor writing a kernel's output in place into an input's buffer that a region still
    reads gave gradients 0.1 off here, with no error (region._no_buffer_reuse turns that off)."""
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    with fake_world(1) as mesh:
        eager = _kw_model(shardkit.fully_shard, mesh)
        eager(x).backward()
        torch._dynamo.reset()
        model = _kw_model(shardkit.compiled.fully_shard, mesh)
        assert all(b._shardkit_state.region for b in model.blocks)
        compiled = torch.compile(model, fullgraph=True)
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            compiled(x).backward()
        for (name, a), b in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad.full_tensor(), b.grad.full_tensor(), rtol=1e-4, atol=1e-6, msg=name)


def test_the_region_key_tells_apart_keyword_arguments():
    """(No compile.) A keyword argument's value, a tensor's shape, None against a tensor and
    a tuple's length each give another region id; the same call gives the same id."""
    from shardkit.compiled.gather import Settings, gather_inputs

    with fake_world(WORLD) as mesh:
        model = _kw_model(shardkit.compiled.fully_shard, mesh)
        block = model.blocks[0]
        group = block._shardkit_state
        settings = Settings.of(group)
        shards, kept = gather_inputs(group, settings)
        x = torch.zeros(2, 8, 16)

        def key(**kwargs):
            return region._key(block, *region._flat(settings, shards, kept, (x,)), **kwargs)

        base = key(scale=0.5, extra=x, pair=(x, x))
        assert base == key(scale=0.5, extra=x, pair=(x, x))
        others = [key(scale=1.0, extra=x, pair=(x, x)), key(scale=0.5, extra=None, pair=(x, x)), key(scale=0.5, extra=torch.zeros(2, 4, 16), pair=(x, x)),
                  key(scale=0.5, extra=x, pair=(x,)), key(scale=0.5, extra=x, pair=[x, x]), key(scale=0.5, extra=x)]
        assert len({base, *others}) == 1 + len(others)
        assert region.callable_with((x,), {"scale": 0.5, "pair": (x, None), "opts": {"a": 1}})
        assert not region.callable_with((x,), {"cache": _Cache()}) and not region.callable_with((_Cache(),), {})


def test_a_batch_of_another_length_compiles_again_with_the_blocks_inline():
    """A second sequence length makes dynamo compile the model again with a symbolic length
    (automatic dynamic shapes). A region's key is a constant that cannot hold a symbolic size
    (region.allowed_here): that graph runs the blocks inline. Before, the compile failed
    ("reuse_hash_fn must be fully traceable"). World 1: each step's gradients equal eager
    shardkit's bit for bit; lengths 16, 8, 12 give two graphs, regions in the first only."""
    region.REGIONS_FROM = 2
    few = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=65)
    with fake_world(1) as mesh:
        eager = gpt(shardkit.fully_shard, config=few, mesh=mesh)
        torch._dynamo.reset()
        recording = Recording()
        model = gpt(shardkit.compiled.fully_shard, config=few, mesh=mesh)
        compiled = torch.compile(model, fullgraph=True, backend=recording)
        for length in (16, 8, 12):
            x = torch.randint(0, few.vocab_size, (2, length), generator=torch.Generator().manual_seed(length))
            for m in (eager, compiled):
                m(x, x)[1].backward()
            for (name, a), b in zip(model.named_parameters(), eager.parameters()):
                assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), (length, name)
                a.grad, b.grad = None, None
    assert recording.dynamo_graphs == 2
    assert [len(calls(gm)) for gm in recording.graphs["forward"]] == [2, 0]
