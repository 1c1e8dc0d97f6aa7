"""shardkit.compiled.overlap.overlapped on small graphs written out by hand: where each
collective and its wait land, and that the order stays a valid one. (On inductor's real
graphs: tests/fake/test_compiled_overlap.py.)"""

import random

from shardkit.compiled.overlap import GATHER, SCATTER, WAIT, Op, overlapped


class Graph:
    """Ops appended in traced order; ``name`` -> index."""

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self.names: list[str] = []

    def add(self, name: str, *deps: str, kind: str = "", trace_of: str | None = None) -> None:
        self.ops.append(Op(kind, [self.names.index(d) for d in deps], None if trace_of is None else self.names.index(trace_of)))
        self.names.append(name)

    def order(self) -> list[str]:
        return [self.names[i] for i in overlapped(self.ops)]


def forward(groups: int, two_steps: bool = False) -> Graph:
    """As traced: each group copies its shards in, all-gathers, waits, then computes twice;
    ``two_steps`` (``reshard_after_forward=R``): it all-gathers what it keeps (``first``), then
    the rest from it (``ag``)."""
    g = Graph()
    g.add("x")
    last = "x"
    for k in range(groups):
        g.add(f"copy{k}")
        if two_steps:
            g.add(f"first{k}", f"copy{k}", kind=GATHER)
            g.add(f"fw{k}", f"first{k}", kind=WAIT)
        g.add(f"ag{k}", f"fw{k}" if two_steps else f"copy{k}", kind=GATHER)
        g.add(f"w{k}", f"ag{k}", kind=WAIT)
        g.add(f"mm{k}a", last, f"w{k}")
        g.add(f"mm{k}b", f"mm{k}a", f"w{k}")
        last = f"mm{k}b"
    return g


def backward(groups: int) -> Graph:
    """As the partitioner places them: each group re-gathers right before its backward compute,
    then reduce-scatters its gradient, which is waited for, divided and returned at once."""
    g = Graph()
    g.add("grad")
    last = "grad"
    for k in reversed(range(groups)):
        g.add(f"ag{k}", kind=GATHER)
        g.add(f"w{k}", f"ag{k}", kind=WAIT)
        g.add(f"mm{k}", last, f"w{k}")
        g.add(f"rs{k}", f"mm{k}", kind=SCATTER)
        g.add(f"rw{k}", f"rs{k}", kind=WAIT)
        g.add(f"div{k}", f"rw{k}")
        last = f"mm{k}"
    return g


def test_each_all_gather_is_issued_before_the_previous_groups_compute_and_waited_for_at_its_first_use():
    order = forward(3).order()
    assert order == ["x", "copy0", "ag0", "w0", "copy1", "ag1", "mm0a", "mm0b", "w1", "copy2", "ag2", "mm1a", "mm1b", "w2", "mm2a", "mm2b"]


def test_in_two_steps_the_second_overlaps_the_previous_groups_compute_and_the_first_one_group_earlier():
    """reshard_after_forward=R: group k's second step (``ag``) runs during group k-1's compute,
    as a one-step gather does; its first step (what the second reads) is issued when group
    k-1's first step arrived, so it too runs during group k-2's compute, at most two in flight."""
    order = forward(3, two_steps=True).order()
    assert order == ["x", "copy0", "first0", "fw0", "copy1", "first1", "ag0", "w0", "fw1", "ag1", "copy2", "first2", "mm0a", "mm0b",
                     "w1", "fw2", "ag2", "mm1a", "mm1b", "w2", "mm2a", "mm2b"]


def test_each_reduce_scatter_is_waited_for_just_before_the_next_one_the_last_at_the_end():
    order = backward(3).order()
    assert order == ["grad", "ag2", "w2", "ag1", "mm2", "rs2", "w1", "ag0", "mm1", "rw2", "div2", "rs1", "w0", "mm0", "rw1", "div1", "rs0", "rw0", "div0"]


def test_a_trace_op_moves_with_what_it_records():
    g = forward(2)
    g.add("issued1", "copy1", trace_of="ag1")
    g.add("done1", "w1", trace_of="w1")
    order = g.order()
    assert order.index("issued1") == order.index("ag1") - 1 and order.index("done1") == order.index("w1") + 1


def test_a_wait_traced_early_moves_to_just_before_the_first_op_reading_it():
    g = Graph()
    g.add("x")
    g.add("ag", kind=GATHER)
    g.add("w", "ag", kind=WAIT)
    g.add("other", "x")  # reads nothing of the all-gather
    g.add("use", "other", "w")
    assert g.order() == ["x", "ag", "other", "w", "use"]


def test_an_op_that_the_moved_collective_reads_moves_before_it():
    """ag1's input is computed from mm0a (not from the shards alone): it cannot be issued before mm0a."""
    g = Graph()
    g.add("x")
    g.add("ag0", "x", kind=GATHER)
    g.add("w0", "ag0", kind=WAIT)
    g.add("mm0a", "x", "w0")
    g.add("mm0b", "mm0a")
    g.add("ag1", "mm0a", kind=GATHER)
    g.add("w1", "ag1", kind=WAIT)
    g.add("mm1", "mm0b", "w1")
    order = g.order()
    assert order.index("mm0a") < order.index("ag1") < order.index("w1") < order.index("mm1")


def test_any_graph_keeps_every_op_after_what_it_reads():
    """Random graphs with collectives, waits and trace ops: the order is a permutation in which
    every op follows its inputs (the sort cannot break a dependence, whatever the rules)."""
    rng = random.Random(0)
    for _ in range(300):
        ops: list[Op] = []
        for i in range(rng.randint(1, 40)):
            deps = sorted(rng.sample(range(i), rng.randint(0, min(i, 3))))
            kind = rng.choice(["", "", "", GATHER, SCATTER])
            if deps and ops[deps[-1]].kind in (GATHER, SCATTER) and rng.random() < 0.7:
                kind = WAIT
            trace_of = rng.choice(deps) if deps and rng.random() < 0.1 else None
            ops.append(Op(kind, deps, trace_of))
        order = overlapped(ops)
        assert sorted(order) == list(range(len(ops)))
        position = {op: at for at, op in enumerate(order)}
        assert all(position[d] < position[i] for i, op in enumerate(ops) for d in op.deps)
