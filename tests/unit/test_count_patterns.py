"""Count patterns over alike layers (solver/count_patterns.py) against brute force."""

from __future__ import annotations

import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from solver import Edge, Node, Problem, solve
from solver.checkpointing import contract_segments, counts_allowed
from solver.count_patterns import count_patterns
from solver.fixing import fix
from solver.lagrangian import pattern_dual, transient_floor
from solver.pattern_bounds import pattern_terms
from solver.problem import Segment, SegmentEdge
from tests.unit.test_lagrangian import SETTINGS, _free_solver, _optimum


@st.composite
def layered_problems(draw) -> Problem:
    """An input node, then 2-3 layers of 2 nodes in a chain (tie class per position), each
    layer with nested segments (the layer, its first node, its last node; the layer's segment
    maybe re-issuing its input edge); layers alike or drawn apart, maybe a first layer that
    differs; a budget between the smallest and the largest resident plan."""
    layers = draw(st.integers(2, 3))
    width = 2
    costs = st.floats(0.0, 10.0, allow_nan=False).map(lambda v: round(v, 2))
    sizes = st.floats(0.0, 100.0, allow_nan=False).map(lambda v: round(v, 1))

    def row(values) -> tuple[float, ...]:
        return tuple(draw(values) for _ in range(width))

    def table() -> tuple[tuple[float, ...], ...]:
        return tuple(row(costs) for _ in range(width))

    alike = draw(st.booleans())
    template = [(row(costs), row(sizes), row(sizes), row(costs)) for _ in range(2)]
    inner = table()
    nodes = [Node(name="in", cost_s=row(costs), memory_bytes=row(sizes))]
    edges: list[Edge] = []
    segments: list[Segment] = []
    for layer in range(layers):
        fresh = not alike or (layer == 0 and draw(st.booleans()))
        values = [(row(costs), row(sizes), row(sizes), row(costs)) for _ in range(2)]
        values = values if fresh else template
        first = len(nodes)
        for j, (cost, memory, _, _) in enumerate(values):
            nodes.append(Node(name=f"l{layer}n{j}", cost_s=cost, memory_bytes=memory))
        into = table()
        edges.append(Edge(src=first - 1, dst=first, cost_s=into))
        edges.append(Edge(src=first, dst=first + 1, cost_s=inner if not fresh else table()))
        freed = [tuple(min(f, m) for f, m in zip(v[2], v[1], strict=True)) for v in values]
        again = [tuple(c / 4 for c in v[3]) for v in values]
        spans = [(0, 1), (0,), (1,)]
        for lo in spans:
            seg_edges = ()
            if lo == (0, 1) and draw(st.booleans()):
                seg_edges = (SegmentEdge(src=first - 1, dst=first, cost_s=into),)
            segments.append(
                Segment(
                    name=f"l{layer}{lo}",
                    nodes=tuple(first + j for j in lo),
                    freed_bytes=tuple(freed[j] for j in lo),
                    recompute_s=tuple(again[j] for j in lo),
                    edges=seg_edges,
                )
            )
    tied = tuple(tuple(1 + 2 * layer + j for layer in range(layers)) for j in range(2))
    low = sum(min(n.memory_bytes) for n in nodes)
    high = sum(max(n.memory_bytes) for n in nodes) + 50.0
    return Problem(
        nodes=tuple(nodes),
        edges=tuple(edges),
        memory_budget_bytes=round(draw(st.floats(low, high)), 1),
        segments=tuple(segments),
        tied=tied,
    )


@settings(SETTINGS, max_examples=60)
@given(layered_problems(), st.floats(0.0, 2.0), st.data())
def test_the_count_patterns_cover_every_recomputation(problem, lam, data) -> None:
    # The lemma under the bound: for plans whose layers choose alike, the cheapest count
    # pattern's priced terms are at most those of every allowed recomputation (as counts).
    counted = count_patterns(problem)
    inner = counted.problem
    x = tuple(data.draw(st.integers(0, n.num_choices - 1)) for n in inner.nodes)

    def terms(counts: tuple[int, ...]) -> float:
        _, _, extra, extra_edges = pattern_terms(inner, lam, counts)
        nodes = math.fsum(float(row[x[i]]) for i, row in extra.items())
        return nodes + math.fsum(float(m[x[a]][x[b]]) for (a, b), m in extra_edges.items())

    cheapest = min(terms(p) for p in counted.patterns)
    _, groups = contract_segments(problem, counted.contracted.node_map)
    ranges = [range(s.min_copies, s.copies + 1) for s in problem.segments]
    for r in itertools.product(*ranges):
        if counts_allowed(problem.segments, r):
            value = terms(tuple(sum(r[k] for k in g) for g in groups))
            assert cheapest <= value + 1e-9 * max(1.0, abs(value))


@settings(SETTINGS, max_examples=30)
@given(layered_problems(), st.floats(0.0, 2.0))
def test_the_count_pattern_dual_is_below_the_optimum(problem, scale) -> None:
    # Every count vector where the layers of a class recompute alike but at most one, with
    # the segment alive again chosen by priority: min over them bounds every recomputation.
    counted = count_patterns(problem)
    assert counted is not None and counted.patterns
    optimum = _optimum(problem)
    if optimum is None:
        return
    lam = scale * 0.5
    found = pattern_dual(counted.problem, lam, _free_solver, counted.patterns)
    budget = problem.memory_budget_bytes
    inner = counted.problem
    dual = found.lower + lam * (inner.memory_offset_bytes + transient_floor(inner) - budget)
    assert dual <= optimum + 1e-9 * max(1.0, abs(optimum))
    assert all(len(plan) == len(inner.nodes) for plan in found.plans)
    # Reduced-cost fixing over the count patterns keeps the optimal plan's strategies.
    from solver import brute_force

    best = brute_force(problem)[0]
    keep = fix(problem, lam, None, optimum, None, counted)
    assert all(c in k for c, k in zip(best, keep, strict=True))


@settings(SETTINGS, max_examples=25)
@given(layered_problems(), st.sampled_from([0.01, 0.2]))
def test_a_solve_over_count_patterns_reports_an_honest_gap(problem, gap) -> None:
    optimum = _optimum(problem)
    if optimum is None:
        return
    sol = solve(problem, gap=gap)
    tolerance = 1e-9 * max(1.0, abs(optimum))
    assert sol.peak_memory_bytes <= problem.memory_budget_bytes + 1e-9
    assert sol.bound_s <= optimum + tolerance
    assert sol.gap <= gap + 1e-9
    if sol.objective_s > 0:
        assert math.isclose(
            sol.gap, (sol.objective_s - sol.bound_s) / sol.objective_s, abs_tol=1e-9
        )
