"""Reduced-cost fixing's restricted problem (solver/fixing.py restrict_budgeted): its tables,
converted once per distinct table with numpy (solver/tables.py), hold exactly the entries of
reading every kept (row, column) one by one, and every edge keeps a table object of its own
(tie contraction sums tables by identity)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from solver import Edge, Node, Problem
from solver.fixing import restrict_budgeted
from solver.problem import Segment, SegmentEdge


def one_by_one(table, rows, cols):
    return tuple(tuple(table[s][t] for t in cols) for s in rows)


ENTRIES = st.one_of(
    st.floats(-1e3, 1e3), st.none(), st.just(math.inf), st.just(math.nan), st.just(-math.inf)
)


@st.composite
def restricted_cases(draw):
    """3-5 nodes of 1-5 strategies; edges and segment edges drawn from a few shared tables
    (None: a banned pair; +-inf and nan: non-finite entries) or their own; a random non-empty
    ascending subset kept per node."""
    widths = draw(st.lists(st.integers(1, 5), min_size=3, max_size=5))
    num = len(widths)
    nodes = tuple(
        Node(name=f"n{i}", cost_s=tuple(float(k) for k in range(w)), memory_bytes=(1.0,) * w)
        for i, w in enumerate(widths)
    )
    shared: dict[tuple[int, int], tuple] = {}

    def table(a, b):
        shape = (widths[a], widths[b])
        own = tuple(tuple(draw(ENTRIES) for _ in range(shape[1])) for _ in range(shape[0]))
        if draw(st.booleans()):
            return shared.setdefault(shape, own)  # one object for every edge of this shape
        return own

    pairs = [(a, b) for b in range(num) for a in range(b)]
    chosen = draw(st.lists(st.sampled_from(pairs), min_size=1, max_size=8))
    edges = tuple(Edge(src=a, dst=b, cost_s=table(a, b)) for a, b in chosen)
    members = tuple(sorted(draw(st.sets(st.integers(0, num - 1), min_size=1, max_size=3))))
    seg_edges = tuple(
        SegmentEdge(src=a, dst=b, cost_s=table(a, b)) for a, b in chosen if a in members
    )
    segment = Segment(
        name="s0",
        nodes=members,
        freed_bytes=tuple(tuple(float(10 * n + k) for k in range(widths[n])) for n in members),
        recompute_s=tuple(tuple(float(n + k) / 8 for k in range(widths[n])) for n in members),
        edges=seg_edges,
    )
    keep = tuple(
        tuple(sorted(draw(st.sets(st.integers(0, w - 1), min_size=1, max_size=w)))) for w in widths
    )
    problem = Problem(nodes=nodes, edges=edges, memory_budget_bytes=1e9, segments=(segment,))
    return problem, keep


def same_objects(got, want) -> bool:
    """Entry by entry the very same objects (nan included, which == cannot compare)."""
    return len(got) == len(want) and all(
        len(g) == len(w) and all(x is y for x, y in zip(g, w, strict=True))
        for g, w in zip(got, want, strict=True)
    )


@settings(max_examples=120, deadline=None)
@given(restricted_cases())
def test_restricted_tables_equal_reading_every_entry(case) -> None:
    problem, keep = case
    out = restrict_budgeted(problem, keep)
    for new, old in zip(out.edges, problem.edges, strict=True):
        assert (new.src, new.dst) == (old.src, old.dst)
        assert same_objects(new.cost_s, one_by_one(old.cost_s, keep[old.src], keep[old.dst]))
        assert type(new.cost_s) is tuple and all(type(row) is tuple for row in new.cost_s)
    assert len({id(e.cost_s) for e in out.edges}) == len(out.edges)  # never shared
    (seg,), (old_seg,) = out.segments, problem.segments
    for new, old in zip(seg.edges, old_seg.edges, strict=True):
        assert same_objects(new.cost_s, one_by_one(old.cost_s, keep[old.src], keep[old.dst]))
    for n, row, old_row in zip(seg.nodes, seg.freed_bytes, old_seg.freed_bytes, strict=True):
        assert row == tuple(old_row[s] for s in keep[n])
    for node, old, k in zip(out.nodes, problem.nodes, keep, strict=True):
        assert node.cost_s == tuple(old.cost_s[s] for s in k)
    assert out.memory_budget_bytes == problem.memory_budget_bytes
