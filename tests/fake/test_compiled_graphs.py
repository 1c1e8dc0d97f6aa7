"""shardkit.compiled on the fake process group (world 8): the graphs torch.compile makes of a
sharded GPT, their collectives against eager shardkit's trace, placements, and errors.

The compiler is aot_eager with recording compilers (AOTAutograd's min-cut partitioner, as
inductor uses): what dynamo and AOTAutograd produce is what is checked, not inductor's code.
"""

import contextlib
from collections import Counter

import pytest
import torch
import torch.nn as nn
from functorch.compile import min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.backends.debugging import boxed_nop
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor, Shard

import shardkit
import shardkit.compiled
from tests.conftest import fake_world
from shardkit.models.gpt import GPT, GPTConfig, apply_fully_shard
from shardkit.memtrack import MemTracker
from shardkit.core.policies import CPUOffloadPolicy, MixedPrecisionPolicy

WORLD = 8
CONFIG = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16, vocab_size=65)  # 3 groups: 2 blocks, root
COLLECTIVES = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}


class Recording:
    """aot_eager that keeps the forward and backward graphs: their collectives, by kind, with
    the bytes each moves over the wire (the output of an all-gather, the input of a reduce-scatter)."""

    def __init__(self) -> None:
        self.graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
        self.dynamo_graphs = 0
        self.backend = aot_autograd(fw_compiler=self._keep("forward"), bw_compiler=self._keep("backward"), partition_fn=min_cut_rematerialization_partition)

    def __call__(self, gm, example_inputs):
        self.dynamo_graphs += 1
        return self.backend(gm, example_inputs)

    def _keep(self, kind: str):
        def compile_graph(gm, example_inputs):
            self.graphs[kind].append(gm)
            return boxed_nop(gm, example_inputs)

        return compile_graph

    def collectives(self, kind: str) -> list[tuple[str, int]]:
        """(kind, bytes) of each collective of the ``kind`` graphs, in graph order."""
        return [found for gm in self.graphs[kind] for found in graph_collectives(gm)]


def graph_collectives(gm: torch.fx.GraphModule) -> list[tuple[str, int]]:
    """(kind, bytes) of each all-gather and reduce-scatter of one graph, in graph order."""
    found = []
    for node in gm.graph.nodes:
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op == "call_function" and name in COLLECTIVES:
            tensor = node.meta["val"] if name == "all_gather_into_tensor" else node.args[0].meta["val"]
            found.append((COLLECTIVES[name], tensor.numel() * tensor.element_size()))
    return found


def gpt(fully_shard, **kwargs) -> GPT:
    torch.manual_seed(0)
    return apply_fully_shard(GPT(CONFIG), fully_shard, **kwargs)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size), generator=torch.Generator().manual_seed(0))
    return x, x


def compiled_step(mesh, **kwargs) -> Recording:
    torch._dynamo.reset()
    counters.clear()
    recording = Recording()
    model = torch.compile(gpt(shardkit.compiled.fully_shard, mesh=mesh, **kwargs), fullgraph=True, backend=recording)
    _, loss = model(*batch())
    loss.backward()
    return recording


def eager_trace(mesh, **kwargs) -> tuple[list, list]:
    """Eager shardkit's collectives of one step, (kind, bytes) each, forward and backward (a
    reduce-scatter with its grad-presence column, one element per parameter and rank, which
    compiled mode carries too: shardkit/compiled/unused.py)."""
    model = gpt(shardkit.fully_shard, mesh=mesh, **kwargs)
    with shardkit.trace() as t:
        _, loss = model(*batch())
    forward = [(e.kind, e.nbytes) for e in t.collectives()]
    with shardkit.trace() as t:
        loss.backward()
    return forward, [(e.kind, e.nbytes) for e in t.collectives()]


@pytest.mark.parametrize("reshard, gathered_again", [(None, 2), (True, 3)])
def test_collectives_and_their_bytes_equal_eager_shardkits(reshard, gathered_again):
    """One all-gather per group in forward; in backward one reduce-scatter per group and the
    all-gathers of the groups that resharded after forward (by default every group but the
    root, as in eager). The same bytes as eager shardkit's trace: the same padded shards."""
    kwargs = {} if reshard is None else dict(reshard_after_forward=reshard)
    with fake_world(WORLD) as mesh:
        recording = compiled_step(mesh, **kwargs)
        eager_forward, eager_backward = eager_trace(mesh, **kwargs)
    # fullgraph=True: one dynamo graph, one forward and one backward graph, no graph break
    assert recording.dynamo_graphs == 1 and [len(recording.graphs[k]) for k in ("forward", "backward")] == [1, 1]
    assert not counters["graph_break"], dict(counters["graph_break"])
    forward, backward = recording.collectives("forward"), recording.collectives("backward")
    assert Counter(forward) == Counter(eager_forward)
    assert Counter(backward) == Counter(eager_backward)
    assert len(forward) == 3 and Counter(k for k, _ in backward) == {"reduce_scatter": 3, **({"all_gather": gathered_again} if gathered_again else {})}


def _graph_of(rank: int) -> tuple[list, list]:
    """The forward and backward graphs' inputs (shapes) and ops, in order, on fake rank ``rank``."""
    with fake_world(WORLD, rank=rank) as mesh:
        recording = compiled_step(mesh)
    graphs = [recording.graphs[k][0].graph for k in ("forward", "backward")]
    return ([[tuple(n.meta["val"].shape) for n in g.nodes if n.op == "placeholder" and "val" in n.meta] for g in graphs],
            [[str(n.target) for n in g.nodes if n.op == "call_function"] for g in graphs])


def test_every_rank_compiles_the_same_graphs_from_its_padded_shards():
    """The graph takes each parameter's padded shard (CompiledGroup.make_leaves), so a rank
    with padding rows (rank 7: 2 of the embedding's 9 rows a rank are real) makes no zeros and
    no concatenation of its own: the same inputs and ops as rank 0's, and the same padded
    shard's bytes in its all-gather (the gradient's real rows reach .grad: test_a_weight_tied_... and
    the gloo checks of 13-row blocks, tests/gloo/test_compiled_mode_graph_breaks.py)."""
    (inputs0, ops0), (inputs7, ops7) = _graph_of(0), _graph_of(WORLD - 1)
    assert inputs7 == inputs0 and ops7 == ops0
    assert (9, CONFIG.n_embd) in inputs7[0]  # the embedding's padded shard: 65 rows, 9 a rank


def test_mixed_precision_gathers_bf16_and_reduces_fp32_as_eager():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with fake_world(WORLD) as mesh:
        recording = compiled_step(mesh, mp_policy=policy)
        eager_forward, eager_backward = eager_trace(mesh, mp_policy=policy)
    assert Counter(recording.collectives("forward")) == Counter(eager_forward)
    assert Counter(recording.collectives("backward")) == Counter(eager_backward)
    gathers = [n for n in recording.graphs["forward"][0].graph.nodes if "all_gather_into_tensor" in str(n.target)]
    assert {n.meta["val"].dtype for n in gathers} == {torch.bfloat16}  # cast before the all-gather


def test_parameters_and_state_dict_are_eager_modes():
    with fake_world(WORLD) as mesh:
        compiled, eager = gpt(shardkit.compiled.fully_shard, mesh=mesh), gpt(shardkit.fully_shard, mesh=mesh)
        for (name, p), (eager_name, q) in zip(compiled.state_dict().items(), eager.state_dict().items()):
            assert name == eager_name
            assert isinstance(p, DTensor) and p.placements == q.placements == (Shard(0),)
            assert p.shape == q.shape and p._local_tensor.shape == q._local_tensor.shape
            assert torch.equal(p._local_tensor, q._local_tensor), name
        assert isinstance(compiled.blocks[0], shardkit.compiled.CompiledFSDPModule)
        assert not isinstance(compiled.blocks[0].attn.qkv, shardkit.compiled.CompiledFSDPModule)
        assert type(compiled.blocks[0].attn.qkv).__name__ == "Linear"  # a submodule keeps its name


@pytest.mark.parametrize("kwargs, what", [
    (dict(offload_policy=CPUOffloadPolicy()), "CPU offload"),
    (dict(shard_placement_fn=lambda p: Shard(1)), "shard_placement_fn"),
])
def test_options_this_mode_does_not_take_raise(kwargs, what):
    with fake_world(WORLD) as mesh:
        with pytest.raises(NotImplementedError, match=f"does not take {what}.*shardkit.fully_shard"):
            shardkit.compiled.fully_shard(nn.Linear(8, 8), mesh=mesh, **kwargs)


def test_one_mode_per_model():
    with fake_world(WORLD) as mesh:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        shardkit.fully_shard(model[0], mesh=mesh)
        with pytest.raises(ValueError, match="Linear was sharded by shardkit.fully_shard \\(eager\\); use one mode"):
            shardkit.compiled.fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match="already applied"):
            shardkit.compiled.fully_shard(model[0], mesh=mesh)


def test_a_weight_tied_across_calls_is_gathered_by_both_in_a_bucket_of_its_own():
    """The head in a call of its own, its weight the token embedding's (the root's call comes
    later): the root gathers and reduce-scatters it in a second bucket, reduced with the
    head's settings (gloo numerics: tests/gloo/test_compiled_mode_tied.py); still one graph each way.
    Tied to an eager-mode call, or sharded over another mesh: a clear error."""
    def tied(fully_shard, mesh, head_mesh=None):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**CONFIG.__dict__, "tie_weights": True}))
        for block in model.blocks:
            shardkit.compiled.fully_shard(block, mesh=mesh)
        fully_shard(model.head, mesh=head_mesh or mesh)
        return model

    with fake_world(WORLD) as mesh:
        torch._dynamo.reset()
        model = tied(shardkit.compiled.fully_shard, mesh)
        shardkit.compiled.fully_shard(model, mesh=mesh)
        root, head = model._shardkit_state, model.head._shardkit_state
        assert model.head.weight is model.tok_emb.weight and isinstance(model.head.weight, DTensor)
        assert [(b.indices, b.owner) for b in root.buckets] == [([0, 1, 2], None), ([3], head)]
        recording = Recording()
        _, loss = torch.compile(model, fullgraph=True, backend=recording)(*batch())
        loss.backward()
        assert [len(recording.graphs[k]) for k in ("forward", "backward")] == [1, 1]
        emb = model.tok_emb.weight
        emb_bytes = WORLD * emb.to_local().numel() * emb.element_size()  # its padded shards (65 rows: 9 a rank)
        rs_bytes = emb_bytes + WORLD * emb.element_size()  # and its grad-presence column
        # The head's and the root's all-gathers of the one shard are the same op on the same
        # input: AOTAutograd's CSE may keep one (torch 2.13 does). Each reduce-scatters it.
        forward, backward = Counter(recording.collectives("forward")), Counter(recording.collectives("backward"))
        assert forward[("all_gather", emb_bytes)] in (1, 2) and sum(forward.values()) == 3 + forward[("all_gather", emb_bytes)], forward
        assert backward[("reduce_scatter", rs_bytes)] == 2 and Counter(k for k, _ in recording.collectives("backward"))["reduce_scatter"] == 5, backward
        assert emb.grad is not None and emb.grad.placements == emb.placements
        from shardkit.compiled.gather import Settings

        model.head.set_gradient_divide_factor(3.0)
        model.head.set_requires_gradient_sync(False)
        own, tied_bucket = Settings.of(root).per_bucket(root)  # the tied weight's bucket takes the head's settings
        assert (own.divide_by, own.sync, tied_bucket.divide_by, tied_bucket.sync) == (WORLD, True, 3.0, False)

        model = tied(shardkit.fully_shard, mesh)
        with pytest.raises(ValueError, match="Linear was sharded by shardkit.fully_shard \\(eager\\); use one mode"):
            shardkit.compiled.fully_shard(model, mesh=mesh)
        from torch.distributed.device_mesh import init_device_mesh

        model = tied(shardkit.compiled.fully_shard, mesh, head_mesh=init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard")))
        with pytest.raises(ValueError, match="'weight' of Embedding is tied to one of Linear, sharded over another mesh"):
            shardkit.compiled.fully_shard(model, mesh=mesh)


def test_the_trace_and_timeline_show_the_compiled_graphs_collectives_as_eager_modes():
    """The compiled graph runs a trace op where each collective is issued and done: the trace
    holds the same collectives (kind, group, dtype, elements, ranks) as eager shardkit's, each
    with its completion, and the timeline draws them. All but the all-gathers the partitioner
    recomputes in backward: it does not recompute an effectful op (the trace op) with them."""
    from shardkit.comm import timeline

    with fake_world(WORLD) as mesh:
        torch._dynamo.reset()
        model = torch.compile(gpt(shardkit.compiled.fully_shard, mesh=mesh), fullgraph=True, backend=Recording())
        model(*batch())[1].backward()  # compiled outside the trace: the records come from the graphs' runs
        with shardkit.trace() as compiled:
            model(*batch())[1].backward()
        eager_model = gpt(shardkit.fully_shard, mesh=mesh)
        with shardkit.trace() as eager:
            eager_model(*batch())[1].backward()
    describe = lambda e: (e.kind, e.group, e.dtype, e.numel, e.world, e.mesh_dim)  # noqa: E731
    recomputed = Counter({describe(e) for e in eager.collectives("all_gather") if e.group != ""})  # once per block: backward
    expected = Counter(describe(e) for e in eager.collectives()) - recomputed
    assert Counter(describe(e) for e in compiled.collectives()) == expected
    assert all(e.done_ns >= e.t for e in compiled.collectives())
    drawn = [e for e in timeline.chrome_events([compiled]) if e.get("cat") in ("all_gather", "reduce_scatter")]
    assert len(drawn) == len(compiled.collectives()) == 6  # 3 all-gathers in forward, 3 reduce-scatters


def test_to_a_dtype_moves_the_layout_with_the_parameters():
    """``model.to(torch.float64)``: the groups gather, and reduce, in the new dtype (the sharded
    parameters' data was replaced; each group re-derives its shards from it, as eager mode)."""
    with fake_world(WORLD) as mesh:
        model = gpt(shardkit.compiled.fully_shard, mesh=mesh).to(torch.float64)
        _, loss = model(*batch())
        loss.backward()
        assert loss.dtype == torch.float64
        assert {p.dtype for p in model.parameters()} == {p.grad.dtype for p in model.parameters()} == {torch.float64}


# Peak memory -----------------------------------------------------------------------------------
_TRACKING: list[MemTracker] = []


def _tracked(gm, example_inputs):
    """aot_eager's compiler, running each graph under the active tracker (dynamo compiles
    nothing while a dispatch mode is on, so the tracker is entered inside the graphs)."""
    run = boxed_nop(gm, example_inputs)

    def call(args):
        if not _TRACKING:
            return run(args)
        with _TRACKING[0]:
            return run(args)

    call._boxed_call = True
    return call


def peak_mib(mesh, mode: str, reshard: bool) -> float:
    """One step's peak of live tensor bytes (the fake process group allocates every
    collective's output as a real one does)."""
    torch._dynamo.reset()
    model = gpt(shardkit.compiled.fully_shard if mode == "compiled" else shardkit.fully_shard, mesh=mesh, reshard_after_forward=reshard)
    if mode == "compiled":
        backend = aot_autograd(fw_compiler=_tracked, bw_compiler=_tracked, partition_fn=min_cut_rematerialization_partition)
        model = torch.compile(model, backend=backend, fullgraph=True)
    model(*batch())[1].backward()  # compile (and warm up) outside the tracker
    tracker = MemTracker().track(model)
    _TRACKING.append(tracker)
    try:
        with tracker if mode == "eager" else contextlib.nullcontext():
            model(*batch())[1].backward()
    finally:
        _TRACKING.clear()
    return tracker.peak_bytes / 2**20


def test_peak_memory_is_at_most_eager_shardkits():
    """Recomputing the all-gathers in backward (reshard_after_forward=True) keeps less than
    keeping the unsharded parameters, and neither is above eager shardkit's with the same
    setting (here every group reshards or keeps, the root too)."""
    with fake_world(WORLD) as mesh:
        peaks = {(mode, reshard): peak_mib(mesh, mode, reshard) for mode in ("compiled", "eager") for reshard in (True, False)}
    assert peaks["compiled", True] < peaks["compiled", False], peaks
    for reshard in (True, False):
        assert peaks["compiled", reshard] <= peaks["eager", reshard], peaks


def trained(model: nn.Module, step, steps: int) -> dict:
    """``steps`` AdamW steps of ``step`` (the model, or what calls it) on batches (4, 8): the full parameters."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        step(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


class _TwoAndASpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.spare, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x):
        return self.out(self.b(self.a(x)))


def test_only_the_parameters_a_forward_did_not_read_are_checked_after_backward():
    """Compiled mode reads the grad-presence counts back after backward (a device sync on GPU)
    only for parameters a traced forward did not read (shardkit/compiled/unused.py): none in a
    group of two modules, each with a forward of its own that reads only its own parameters;
    the root's unused Linear. Run without torch.compile: the same notes, at each call."""
    with fake_world(WORLD) as mesh:
        model = _TwoAndASpare()
        shardkit.compiled.fully_shard([model.a, model.b], mesh=mesh)
        shardkit.compiled.fully_shard(model, mesh=mesh)
        model(torch.randn(4, 8)).sum().backward()
        pair, root = model.a._shardkit_state, model._shardkit_state
        names = lambda group: {f"{type(p.slots[0].module).__name__}.{p.slots[0].name}" for i, p in enumerate(group.params) if i in group.watch.unread}  # noqa: E731
        assert pair.watch.unread == set() and pair.watch.hooked == {}
        assert len(root.watch.unread) == 2 and names(root) == {"Linear.weight", "Linear.bias"}
        assert {root.params[i].slots[0].module for i in root.watch.unread} == {model.spare}
        assert list(root.watch.hooked) == [0]  # the presence leaf of the root's one bucket


def test_a_forward_without_autograd_watches_nothing_and_reads_under_it_are_no_use():
    """An evaluation under no_grad (all reads without autograd: no gradient can follow) watches
    no parameter: watching is for good, and each backward would read the counts back. Inside a
    training forward, a parameter read only under no_grad (a norm used as a constant) is watched:
    it gets no gradient, so .grad stays None, as in eager mode (it had the graph's zeros).
    Run without torch.compile: the same notes, at each call."""

    class Normed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.scale = nn.Linear(8, 8), nn.Parameter(torch.ones(8))

        def forward(self, x):
            with torch.no_grad():
                norm = self.scale.norm()
            return self.lin(x) / norm

    with fake_world(WORLD) as mesh:
        model = Normed()
        shardkit.compiled.fully_shard(model, mesh=mesh)
        group = model._shardkit_state
        with torch.no_grad():
            model(torch.randn(4, 8))
        assert group.watch.unread == set()
        model(torch.randn(4, 8)).sum().backward()
        assert {group.params[i].slots[0].name for i in group.watch.unread} == {"scale"}


class _Permuted(nn.Module):
    """A block whose forward reads a frozen integer parameter (a permutation of its features)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.perm = nn.Parameter(torch.randperm(8), requires_grad=False)

    def forward(self, x):
        return torch.tanh(self.lin(x))[..., self.perm]


def test_a_frozen_integer_parameter_is_gathered_and_trains_as_eager_mode():
    """An integer parameter (``requires_grad=False``: torch allows no other) in a block's group
    and the root's: compiled mode raised at ``fully_shard`` ("only Tensors of floating point
    dtype can require gradients": its bucket's grad-presence leaf). Now it is all-gathered as
    eager mode does, and 3 steps under ``torch.compile`` (fullgraph, aot_eager) give eager
    shardkit's parameters exactly (world 1), with accumulation without sync and
    ``set_reshard_after_backward(False)`` (their leaves for an integer bucket hold nothing);
    at world 2 it compiles to one graph each way."""
    def sharded(fully_shard, mesh) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(_Permuted(), _Permuted(), nn.Linear(8, 1))
        model.register_parameter("offset", nn.Parameter(torch.arange(3), requires_grad=False))
        for block in model[:2]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_reshard_after_backward(False)
        return model

    def accumulated(model: nn.Module, step) -> dict:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for i in range(3):
            model.set_requires_gradient_sync(i != 1)
            step(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
            if i != 1:
                optimizer.step()
                optimizer.zero_grad()
        for module in (m for m in model.modules() if isinstance(m, shardkit.FSDPModule)):
            module.reshard()  # (eager mode holds the unsharded parameters after backward: not resharding)
        return {n: p.full_tensor() for n, p in model.named_parameters()}

    with fake_world(1) as mesh:
        torch._dynamo.reset()
        eager = accumulated(model := sharded(shardkit.fully_shard, mesh), model)
        compiled = accumulated(model := sharded(shardkit.compiled.fully_shard, mesh), torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert compiled.keys() == eager.keys() and all(torch.equal(compiled[n], eager[n]) for n in eager)
    assert compiled["0.perm"].dtype == torch.int64 and not model[0].perm.requires_grad
    recording = Recording()
    with fake_world(2) as mesh:
        torch._dynamo.reset()
        torch.compile(sharded(shardkit.compiled.fully_shard, mesh), fullgraph=True, backend=recording)(torch.randn(4, 8)).sum().backward()
    assert recording.dynamo_graphs == 1 and len(recording.graphs["backward"]) == 1


class _NormAndHead(nn.Module):
    """Two blocks, then a norm and a head that are one group (``fully_shard([norm, head])``, as
    torchtitan groups them); ``head_outside``: the forward stops at the norm and the loss
    calls the head (a chunked loss)."""

    def __init__(self, head_outside: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 3)
        self.head_outside = head_outside

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return x if self.head_outside else self.head(x)


def _norm_and_head(fully_shard, mesh, head_outside: bool = False, **kwargs) -> _NormAndHead:
    torch.manual_seed(0)
    model = _NormAndHead(head_outside)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh)
    return model


def test_a_group_of_several_modules_run_eagerly_gathers_once_per_forward():
    """The pair ``fully_shard([norm, head])`` in compiled mode run without torch.compile (the
    quick tier's check; the next test compiles four models): one all-gather for the pair per
    forward, as eager shardkit (the blocks' two, then the pair's), not one per module."""
    with fake_world(2) as mesh:
        gathers = []
        for fully_shard in (shardkit.fully_shard, shardkit.compiled.fully_shard):
            model = _norm_and_head(fully_shard, mesh)
            with shardkit.trace() as t:
                model(torch.randn(4, 8, requires_grad=True))
            gathers.append([e.nbytes for e in t.collectives() if e.kind == "all_gather"])
    assert len(gathers[0]) == 3 and gathers[1] == gathers[0], gathers


def test_a_group_of_several_modules_gathers_once_per_forward_as_eager_mode():
    """``fully_shard([norm, head])`` under ``torch.compile`` failed in AOTAutograd's partitioner
    ("failed to partition the joint forward-backward graph") whenever the group reshards after
    forward (the default below the root): each module gathered the group, CSE merged the two
    gathers across their checkpoints, and the boundary fell on the copy-out's list of outputs.
    Now the group is gathered at the norm and kept for the head while the root's forward runs,
    as eager mode keeps it: at world 2 the forward and backward graphs (one each) hold eager
    shardkit's collectives and bytes, for both reshard_after_forward values. A head the loss
    calls outside the forward gathers again, as in eager mode. 3 AdamW steps give eager
    shardkit's parameters exactly (world 1)."""
    def step_of(model: _NormAndHead):
        return (lambda x: model.head(model(x))) if model.head_outside else model

    for kwargs in ({}, dict(reshard_after_forward=False)):
        recording = Recording()
        with fake_world(2) as mesh:
            torch._dynamo.reset()
            # (an input that requires grad: else the graph's backward needs no weight of the first block, and gathers it not)
            torch.compile(_norm_and_head(shardkit.compiled.fully_shard, mesh, **kwargs), fullgraph=True, backend=recording)(torch.randn(4, 8, requires_grad=True)).sum().backward()
            model = _norm_and_head(shardkit.fully_shard, mesh, **kwargs)
            with shardkit.trace() as t:
                out = model(torch.randn(4, 8, requires_grad=True))
            eager_forward = Counter((e.kind, e.nbytes) for e in t.collectives())
            with shardkit.trace() as t:
                out.sum().backward()
            eager_backward = Counter((e.kind, e.nbytes) for e in t.collectives())
        assert recording.dynamo_graphs == 1 and [len(recording.graphs[k]) for k in ("forward", "backward")] == [1, 1]
        assert Counter(recording.collectives("forward")) == eager_forward and sum(eager_forward.values()) == 3, kwargs  # (the blocks, then norm and head once; the root holds none)
        assert Counter(recording.collectives("backward")) == eager_backward, kwargs

    for head_outside in (False, True):
        with fake_world(1) as mesh:
            torch._dynamo.reset()
            eager = trained(model := _norm_and_head(shardkit.fully_shard, mesh, head_outside), step_of(model), 3)
            compiled = trained(model := _norm_and_head(shardkit.compiled.fully_shard, mesh, head_outside), torch.compile(step_of(model), fullgraph=True, backend="aot_eager"), 3)
        assert all(torch.equal(compiled[n], eager[n]) for n in eager), head_outside


def test_a_second_model_compiles_in_the_same_process():
    """Two compiled-mode models of the same code, compiled one after the other (make bench
    --compile does: with and without the overlap pass): the second recompiles the same frames,
    and dynamo's automatic dynamic must not turn a value that differs between them (a group's
    id for unused.py) into a symbolic int; it crashed with "unhashable type: non-nested SymInt"."""
    with fake_world(WORLD) as mesh:
        torch._dynamo.reset()
        for _ in range(2):
            model = torch.compile(gpt(shardkit.compiled.fully_shard, mesh=mesh), fullgraph=True, backend="aot_eager")
            model(*batch())[1].backward()
            assert all(p.grad is not None for p in model.parameters())


class Breaking(nn.Module):
    """Two layers with a branch on a value read with ``.item()`` between them (never taken):
    dynamo breaks the graph there. ``spare``: a layer the forward never uses."""

    def __init__(self, dim: int, spare: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, dim), nn.Linear(dim, dim)
        if spare:
            self.spare = nn.Linear(dim, dim)

    def forward(self, x):
        x = torch.tanh(self.a(x))
        if x.abs().sum().item() > 1e9:  # never true: a graph break
            x = x * 2
        return torch.tanh(self.b(x)) + x


def train_breaking(fully_shard, mesh, blocks: int, dim: int, compile_model: bool, spare: bool = False) -> tuple[dict, dict]:
    """``blocks`` Breaking blocks and a head, each block then the root sharded, two AdamW steps
    (``torch.compile`` with its default, aot_eager, for ``compile_model``): the full parameters,
    and whether each ``.grad`` was None after the last backward."""
    torch.manual_seed(0)
    model = nn.Sequential(*(Breaking(dim, spare) for _ in range(blocks)), nn.Linear(dim, 1))
    for block in model[:blocks]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    run = torch.compile(model, backend="aot_eager") if compile_model else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        run(torch.randn(4, dim, generator=torch.Generator().manual_seed(step))).sum().backward()
        none = {n: p.grad is None for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.full_tensor() for n, p in model.named_parameters()}, none


def test_more_models_and_breaking_blocks_than_dynamos_recompile_limit(monkeypatch):
    """Dynamo keeps at most ``recompile_limit`` graphs per code object (8 by default; 2 here,
    for a cheaper test: shardkit takes it for torch's default), and compiled mode's graphs guard
    on the identity of their groups: (1) more models of one code compiled in one process with
    ``fullgraph=True`` than the limit (the ninth failed, FailOnRecompileLimitHit: the roots
    shared one forward's code object); (2) more blocks that break the graph under
    ``torch.compile``'s default, a graph each for the block's forward (past the eighth, dynamo
    ran them eagerly), and as many as make regions (a region cannot break the graph: it failed
    with UncapturedHigherOrderOpError; region.allowed_here). Both now compile every graph, and
    (2) trains as eager mode."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    import shardkit.compiled.region

    monkeypatch.setattr(shardkit.compiled, "_DEFAULT_LIMIT", 2)
    monkeypatch.setattr(shardkit.compiled, "_limit_set", 2)
    monkeypatch.setattr(shardkit.compiled.region, "REGIONS_FROM", 3)

    with fake_world(1) as mesh, torch._dynamo.config.patch(recompile_limit=2, fail_on_recompile_limit_hit=True):
        torch._dynamo.reset()
        for _ in range(3):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
            shardkit.compiled.fully_shard(model, mesh=mesh)
            torch.compile(model, fullgraph=True, backend="aot_eager")(torch.randn(2, 4)).sum().backward()
            assert all(p.grad is not None for p in model.parameters())
            # its root's forward holds its graph alone: no other model's guards to check first
            assert len(_debug_get_cache_entry_list(type(model).forward.__code__)) == 1
        eager, _ = train_breaking(shardkit.fully_shard, mesh, 3, 4, False)
        compiled, _ = train_breaking(shardkit.compiled.fully_shard, mesh, 3, 4, True)
        assert torch._dynamo.config.recompile_limit >= 2 + 4  # room for this model's groups
        torch._dynamo.config.recompile_limit = 5  # a limit the user set stays
        shardkit.compiled.fully_shard(nn.Linear(4, 4), mesh=mesh)
        assert torch._dynamo.config.recompile_limit == 5
    assert all(torch.equal(compiled[n], eager[n]) for n in eager)


class Checkpointed(nn.Module):
    """Blocks called through ``torch.utils.checkpoint`` in the parent's forward, as transformers'
    ``gradient_checkpointing_enable`` calls its layers."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.inp, self.head, self.checkpointed = nn.Linear(8, 16), nn.Linear(16, 1), checkpointed
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x))
        return self.head(x)


def _checkpointed_blocks(fully_shard, mesh, checkpointed: bool, reshard: bool) -> Checkpointed:
    torch.manual_seed(0)
    model = Checkpointed(checkpointed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)
    return model


def test_blocks_under_the_users_checkpoint_compile_in_one_graph_with_the_backwards_collectives_without_it():
    """``fullgraph=True`` through a block's gather inside the user's checkpoint: it failed ("HOP:
    Unsafe side effect", the gather sets the group's gathered tensors); now one graph each way
    (aot_eager), and the backward's collectives are those without the checkpoint (world 2): each
    block all-gathered again where it reshards after forward, not at all where it does not (the
    user's checkpoint recomputed that gather too, 3 all-gathers more than eager mode's backward).
    Eager shardkit's parameters: the next test (slow tier)."""
    for reshard, gathered_again in ((True, 3), (False, 0)):
        backward = {}
        for checkpointed in (False, True):
            recording = Recording()
            with fake_world(2) as mesh:
                torch._dynamo.reset()
                torch.compile(_checkpointed_blocks(shardkit.compiled.fully_shard, mesh, checkpointed, reshard), fullgraph=True, backend=recording)(torch.randn(4, 8)).sum().backward()
            assert recording.dynamo_graphs == 1 and len(recording.graphs["backward"]) == 1
            backward[checkpointed] = Counter(kind for kind, _ in recording.collectives("backward"))
        assert backward[True] == backward[False] == Counter(all_gather=gathered_again, reduce_scatter=4), (reshard, backward)


def test_blocks_under_the_users_checkpoint_train_to_eager_shardkits_parameters():
    """The blocks under the user's checkpoint, both reshard_after_forward values: 2 steps
    compiled (fullgraph, aot_eager) give eager shardkit's parameters exactly (world 1)."""
    for reshard in (True, False):
        with fake_world(1) as mesh:
            torch._dynamo.reset()
            eager = trained(model := _checkpointed_blocks(shardkit.fully_shard, mesh, True, reshard), model, 2)
            compiled = trained(model := _checkpointed_blocks(shardkit.compiled.fully_shard, mesh, True, reshard), torch.compile(model, fullgraph=True, backend="aot_eager"), 2)
        assert all(torch.equal(compiled[n], eager[n]) for n in eager), reshard


def test_dynamo_reaches_each_module_and_group_by_one_path(monkeypatch):
    """Dynamo guards that two paths to one object still reach one object (``DUPLICATE_INPUT``;
    torch 2.13 builds them as one Python function, about 2 ms a guard at compile). The traced
    runtime must not reach a module through its group (``group.params[i].slots[0].module``,
    besides ``self._modules``), nor a group through another (``.parent``): with those, the
    2-block GPT had 97 such guards. What is left is one per parameter for its property's
    group, one per parameter for its DTensor's mesh, and a few for modules imported twice."""
    from torch._dynamo.guards import GuardBuilder

    pairs = set()
    original = GuardBuilder.DUPLICATE_INPUT

    def recording(self, guard, source_b):
        pairs.add((guard.name, source_b.name))
        return original(self, guard, source_b)

    monkeypatch.setattr(GuardBuilder, "DUPLICATE_INPUT", recording)
    with fake_world(WORLD) as mesh:
        torch._dynamo.reset()
        sharded = gpt(shardkit.compiled.fully_shard, mesh=mesh)
        torch.compile(sharded, fullgraph=True, backend="eager")(*batch())
    through = [pair for pair in pairs if any(".slots[" in name or ".parent" in name for name in pair)]
    assert through == [], through[:3]
    assert len(pairs) <= 2 * len(list(sharded.parameters())) + 8, len(pairs)


def test_blocks_that_break_the_graph_train_as_eager_mode_under_compiles_default():
    """``torch.compile``'s default, ``fullgraph=False``, with blocks that break the graph between
    two layers (an ``.item()`` branch) and an unused layer: several graphs per step, eager
    shardkit's parameters exactly and its None gradient for the unused layer (world 1, aot_eager;
    on 2 gloo ranks: tests/gloo/test_compiled_mode_graph_breaks.py). It crashed in the resumed
    frame ("unhashable type: non-nested SymInt") before unused._read took int(i)."""
    from torch._dynamo.utils import counters

    with fake_world(1) as mesh:
        torch._dynamo.reset()
        counters.clear()
        eager, eager_none = train_breaking(shardkit.fully_shard, mesh, 2, 8, False, spare=True)
        compiled, compiled_none = train_breaking(shardkit.compiled.fully_shard, mesh, 2, 8, True, spare=True)
    assert counters["graph_break"]
    assert compiled_none == eager_none and eager_none["0.spare.weight"]
    assert all(torch.equal(compiled[n], eager[n]) for n in eager)
