"""Hypothesis strategies for the fuzzer's examples: a model ``Spec`` and a call sequence."""

from __future__ import annotations

from hypothesis import strategies as st

from tests.fuzz.sequences import KNOBS, TARGETS, UNSHARD_HOWS, Spec

seeds = st.integers(0, 2**16)
targets = st.sampled_from(TARGETS)


def own_shard_size(world: int) -> int:
    """The shard dim of the mesh ``Spec.param_mesh`` puts the blocks' lin.weight on."""
    return world // 2 if world >= 4 else world


@st.composite
def specs(draw, world: int, fsdp2_only: bool = False, mesh: str | None = None) -> Spec:
    """A model; ``fsdp2_only``: none of what FSDP2 rejects (several dtypes in a group, weights
    tied across groups), for the tier that only compares with FSDP2. One in five shards
    shardkit's side in compiled mode, with only what that mode takes: no mesh of a
    parameter's own; half of those run the blocks as
    nested compile regions (``Spec.regions``). One in four steps the 2-D matrices with Muon
    (``Spec.optim``: half of those with owners for every bucket, the other half as it comes,
    which on gloo computes these small buckets on every rank); one in four with a bool reshard_after_forward makes the blocks' weight a
    tensor subclass with FSDP2's all-gather hooks (``Spec.extension``). At world 8 and more, one in
    four is HSDP x TP (``Spec.mesh == "hsdp_tp"``); ``mesh`` draws only that mesh."""
    compiled = draw(st.sampled_from([False] * 4 + [True]))  # (shrinks towards eager mode)
    meshes = ["1d", "hsdp", "hsdp1"] if world % 2 == 0 else ["1d"]
    if mesh is None:  # (given: that mesh only, e.g. the 8-rank gloo tier's HSDP x TP)
        mesh = draw(st.sampled_from(meshes + ["hsdp_tp"] * (world % 8 == 0)))  # HSDP x TP: the blocks' lin column-wise over tp 2
    shard_size = {"hsdp": world // 2, "hsdp_tp": world // 4}.get(mesh, world)
    ints = [r for r in (2, 4) if r < shard_size and shard_size % r == 0]  # reshard to R ranks after forward
    reshard = draw(st.sampled_from([True, False, *ints]))
    # (not with swap_data: Tagged asserts that fsdp_post_all_gather's out= is the buffer it built, which a swap
    # replaces; not with an int reshard_after_forward: NotImplementedError in FSDP2 and shardkit alike)
    extension = isinstance(reshard, bool) and mesh != "hsdp_tp" and draw(st.sampled_from([False] * 3 + [True]))  # (shrinks towards plain parameters)
    tied = draw(st.sampled_from(["none", "same"] if fsdp2_only else ["none", "same", "across"]))
    return Spec(
        blocks=draw(st.sampled_from([2, 3])),
        nested=draw(st.booleans()),
        mixed=False if fsdp2_only else draw(st.booleans()),
        tied=tied,
        mp=draw(st.booleans()),
        reshard=reshard,
        mesh=mesh,
        foreach=draw(st.booleans()),
        unused=draw(st.booleans()),
        swap_data=not extension and draw(st.booleans()),
        # the blocks' lin.weight on an HSDP mesh of its own, the rest on a 1-D one (an int
        # reshard_after_forward must divide both meshes' shard dims)
        param_mesh=mesh == "1d" and world % 2 == 0 and (isinstance(reshard, bool) or own_shard_size(world) % reshard == 0) and not compiled and draw(st.booleans()),
        compiled_mode=compiled,
        regions=compiled and draw(st.booleans()),
        optim=draw(st.sampled_from(["adamw"] * 6 + ["muon", "muon-owners"])),  # (shrinks towards AdamW alone)
        extension=extension,
        paired=tied == "none" and draw(st.booleans()),
    )


def _knob_values(kind: str) -> st.SearchStrategy:
    return {
        "bool": st.booleans(),
        "factor": st.sampled_from([1.0, 4.0]),
        "buffers": st.integers(1, 3),
        "prefetch": st.sampled_from([[], ["blocks.1"], ["blocks.0"], ["blocks.0", "blocks.1"]]),
        "on": st.just(True),
    }[kind]


def knob_calls() -> st.SearchStrategy[tuple]:
    return st.one_of(
        [st.tuples(st.just("set"), st.just(knob), targets, _knob_values(kind)) for knob, (kind, _) in KNOBS.items()]
    )


def _training_calls() -> list[st.SearchStrategy[tuple]]:
    """Training calls come most often (a train step is forward, backward and the optimizer
    step, checked after each), so that sequences reach second and third steps."""
    train = st.tuples(st.just("train"), seeds)
    clipped = st.tuples(st.just("train"), seeds, st.sampled_from([0.01, 1000.0]))  # clip_grad_norm_ before the step
    forward = st.tuples(st.just("forward"), seeds)
    evaluate = st.tuples(st.just("evaluate"), seeds, st.sampled_from(["no_grad", "inference_mode"]))  # a validation pass
    return [train, train, clipped, forward, forward, evaluate, st.just(("backward",)), st.just(("backward",)), st.just(("step",)), st.just(("zero_grad",))]


STATE_CALLS = [st.just(("state_dict_roundtrip",)), st.just(("state_dict_from_thread",)), st.tuples(st.just("load_reference"), st.sampled_from([0.5, 2.0]))]
CLIP = st.tuples(st.just("clip"), st.sampled_from([0.01, 1000.0]))  # clips every gradient / none
PRE_HOOK = st.tuples(st.just("pre_hook"), targets)  # a block's forward pre-hook reads its weight (the blocks only)


def commands() -> st.SearchStrategy[tuple]:
    """One call."""
    return st.one_of(
        *_training_calls(),
        st.tuples(st.just("unshard"), targets, st.sampled_from(UNSHARD_HOWS)),
        st.tuples(st.just("reshard"), targets),
        knob_calls(),
        knob_calls(),
        *STATE_CALLS,
        CLIP,
        st.tuples(st.just("raise_in_forward"), seeds),
        st.just(("to_float64",)),
        st.tuples(st.just("pipeline_microbatches"), seeds, st.integers(1, 2)),
        st.tuples(st.just("penalized_forward"), seeds),  # a gradient penalty: a create_graph=True backward inside
        PRE_HOOK,
    )


COMPILED_KNOBS = {  # the settings compiled mode takes, and the values it takes (the others raise)
    "reshard_after_forward": st.booleans(),
    "gradient_divide_factor": _knob_values("factor"),
    "is_last_backward": st.booleans(),
    "force_sum_reduction_for_comms": st.booleans(),
    "requires_gradient_sync": st.booleans(),
    "requires_all_reduce": st.booleans(),
    "reshard_after_backward": st.booleans(),
}


def compiled_commands() -> st.SearchStrategy[tuple]:
    """The calls compiled mode takes: its FSDPModule settings (``COMPILED_KNOBS``), unshard and
    reshard (which do nothing there: the graph gathers), no reset_iter_state."""
    knobs = [st.tuples(st.just("set"), st.just(knob), targets, values) for knob, values in COMPILED_KNOBS.items()]
    return st.one_of(*_training_calls(), *STATE_CALLS, CLIP, PRE_HOOK, st.just(("to_float64",)), *knobs,
                     st.tuples(st.just("unshard"), targets, st.sampled_from(UNSHARD_HOWS)), st.tuples(st.just("reshard"), targets))


def sequences(max_size: int = 14, compiled: bool = False) -> st.SearchStrategy[list[tuple]]:
    """A few knobs set first (where each can matter for the whole sequence), then the calls;
    ``compiled``: compiled mode's calls only."""
    if compiled:
        return st.lists(compiled_commands(), min_size=1, max_size=max_size)
    return st.builds(lambda knobs, calls: knobs + calls, st.lists(knob_calls(), max_size=3), st.lists(commands(), min_size=1, max_size=max_size))
