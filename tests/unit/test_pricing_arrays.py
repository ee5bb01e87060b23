"""solver.pricing's flat arrays, made in one pass over the nodes and segments, hold exactly what
converting every node's and segment's tuples one by one gives (positions, seconds, bytes)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solver import Node, Problem
from solver.pricing import Pricing, forget_pricing, node_arrays
from solver.problem import Segment

_values = st.floats(0.0, 1e12, allow_nan=False) | st.integers(0, 2**62)


@st.composite
def problems(draw) -> Problem:
    """Nodes of 1-4 strategies each (seconds and bytes: floats or large ints), and segments
    over distinct nodes in any order, some with no node."""
    widths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=7))
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(draw(_values) for _ in range(w)),
            memory_bytes=tuple(draw(_values) for _ in range(w)),
        )
        for i, w in enumerate(widths)
    )
    segments = []
    for k in range(draw(st.integers(0, 3))):
        members = draw(st.permutations(range(len(nodes))))[: draw(st.integers(0, len(nodes)))]
        segments.append(
            Segment(
                name=f"s{k}",
                nodes=tuple(members),
                freed_bytes=tuple(tuple(draw(_values) for _ in range(widths[n])) for n in members),
                recompute_s=tuple(tuple(draw(_values) for _ in range(widths[n])) for n in members),
            )
        )
    return Problem(nodes=nodes, edges=(), segments=tuple(segments))


def _one_by_one(problem: Problem) -> tuple:
    """Every node's and segment's tuples converted alone and concatenated."""
    starts = np.concatenate([[0], np.cumsum([n.num_choices for n in problem.nodes])])
    flat = [
        np.concatenate([np.asarray(getattr(n, field), dtype=np.float64) for n in problem.nodes])
        for field in ("cost_s", "memory_bytes")
    ]
    segments = []
    for seg in problem.segments:
        rows = [
            np.concatenate([np.asarray(r, dtype=np.float64) for r in getattr(seg, field)])
            if seg.nodes
            else np.zeros(0)
            for field in ("recompute_s", "freed_bytes")
        ]
        spans = [np.arange(starts[n], starts[n + 1]) for n in seg.nodes]
        segments.append((np.concatenate(spans) if spans else np.zeros(0, np.intp), *rows))
    return starts, *flat, segments


@settings(max_examples=200, deadline=None)
@given(problems())
def test_the_flat_arrays_are_the_tuples_converted_one_by_one(problem) -> None:
    starts, cost, memory, segments = _one_by_one(problem)
    pricing = Pricing(problem)
    assert np.array_equal(pricing.starts, starts)
    assert pricing.cost.tobytes() == cost.tobytes()
    assert pricing.memory.tobytes() == memory.tobytes()
    made = node_arrays(problem)
    assert made[0].tobytes() == cost.tobytes() and made[1].tobytes() == memory.tobytes()
    assert len(pricing.segments) == len(segments)
    for got, want in zip(pricing.segments, segments, strict=True):
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@settings(max_examples=20, deadline=None)
@given(problems(), problems())
def test_pricing_of_a_problem_is_kept_for_that_very_problem(first, second) -> None:
    """Pricing.of: the same object for the very same problem (the last two kept), its arrays
    Pricing's; an equal problem that is another object gets its own; forget_pricing drops
    them."""
    forget_pricing()
    kept = Pricing.of(first)
    assert Pricing.of(first) is kept
    fresh = Pricing(first)
    assert kept.cost.tobytes() == fresh.cost.tobytes()
    assert kept.memory.tobytes() == fresh.memory.tobytes()
    assert kept.starts.tobytes() == fresh.starts.tobytes()
    other = Pricing.of(second)
    assert other is not kept and Pricing.of(first) is kept and Pricing.of(second) is other
    copy = Problem(nodes=first.nodes, edges=first.edges, segments=first.segments)
    assert Pricing.of(copy) is not kept  # the third: the first is dropped
    assert Pricing.of(first) is not kept
    forget_pricing()
    assert Pricing.of(second) is not other
