"""Per-pattern lower bounds kept from the last pattern evaluation (solver/kept_lowers.py):
on another problem with the very same segments object (another ZeRO configuration), at the
same multiplier and patterns, they bound each of its pattern problems' optima from below
(leaves folded with the patterns' terms on them, or not); the pattern D found with them is
the one found afresh; the same problem evaluated again, or another multiplier or segments
object, takes nothing."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import forget_kept
from solver.errors import InfeasibleError
from solver.kept_lowers import kept_floors
from solver.lagrangian import pattern_dual, priced, recompute_patterns
from solver.pattern_bounds import pattern_problem, pattern_table, pattern_terms
from solver.problem import Edge, Node, Problem, Segment, SegmentEdge
from solver.shrink import solve
from tests.unit.test_lagrangian import _free_solver, budgeted_problems

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _other_costs(problem: Problem, data: st.DataObject) -> Problem:
    """``problem`` with other node seconds and bytes on some nodes (the same segments object,
    edges and tie classes): what another ZeRO configuration changes."""
    costs = st.floats(0.0, 10.0, allow_nan=False)
    sizes = st.floats(0.0, 100.0, allow_nan=False)
    nodes = []
    for n in problem.nodes:
        if data.draw(st.booleans()):
            n = dataclasses.replace(
                n,
                cost_s=tuple(data.draw(costs) for _ in n.cost_s),
                memory_bytes=tuple(data.draw(sizes) for _ in n.memory_bytes),
            )
        nodes.append(n)
    return dataclasses.replace(problem, nodes=tuple(nodes))


def _exact(problem: Problem, stop_above: float | None = None) -> tuple:
    """An exact priced solve (a solve may stop above ``stop_above``; this one never does)."""
    return _free_solver(problem)


def _pattern_optimum(problem: Problem, lam: float, pattern: tuple[int, ...]) -> float:
    base = priced(dataclasses.replace(problem, segments=()), lam)
    _, _, extra, extra_edges = pattern_terms(problem, lam, pattern)
    try:
        return solve(pattern_problem(base, extra, extra_edges), gap=0.0).objective_s
    except InfeasibleError:
        return math.inf


def _with_segment_edges(problem: Problem, data: st.DataObject) -> Problem:
    """Maybe give each segment the resharding seconds of the edges it consumes (re-issued
    when it is recomputed: pattern terms on edges, a leaf's included)."""
    if not problem.segments or not data.draw(st.booleans()):
        return problem
    costs = st.floats(0.0, 3.0, allow_nan=False)
    segments = []
    for seg in problem.segments:
        inside = [e for e in problem.edges if e.dst in seg.nodes]
        edges = tuple(
            SegmentEdge(
                src=e.src,
                dst=e.dst,
                cost_s=tuple(tuple(data.draw(costs) for _ in row) for row in e.cost_s),
            )
            for e in inside
            if data.draw(st.booleans())
        )
        segments.append(dataclasses.replace(seg, edges=edges))
    return dataclasses.replace(problem, segments=tuple(segments))


def _terms(problem: Problem, lam: float, patterns: list) -> list:
    return pattern_table(problem, lam, patterns, {})[0]


@settings(SETTINGS, max_examples=150)
@given(budgeted_problems(), st.floats(0.0, 2.0), st.data())
def test_kept_floors_bound_every_pattern_of_another_problem(problem, lam, data):
    problem = _with_segment_edges(problem, data)
    patterns = recompute_patterns(problem)
    if not patterns:
        return
    other = _other_costs(problem, data)
    forget_kept()
    try:
        pattern_dual(problem, lam, _exact, patterns, cache={}, stop_early=True)
    except InfeasibleError:  # the edges forbid every plan, whatever the costs
        return
    base = priced(dataclasses.replace(other, segments=()), lam)
    floors = kept_floors(other, base, lam, patterns, _terms(other, lam, patterns))
    if base == priced(dataclasses.replace(problem, segments=()), lam):
        assert floors is None  # the same priced problem again: nothing taken
        return
    assert floors is not None
    for floor, pattern in zip(floors, patterns, strict=True):
        optimum = _pattern_optimum(other, lam, pattern)
        assert floor <= optimum + 1e-9 * max(1.0, abs(optimum))
    # The pattern D with them is the one found afresh.
    kept = pattern_dual(other, lam, _exact, patterns, cache={}, stop_early=True)
    forget_kept()
    fresh = pattern_dual(other, lam, _exact, patterns, cache={}, stop_early=True)
    assert math.isclose(kept.lower, fresh.lower, rel_tol=1e-9, abs_tol=1e-9)


@st.composite
def parameter_problems(draw: st.DrawFn) -> Problem:
    """A chain of 3-4 ops of 1-4 strategies each, each op reading a parameter leaf (its own
    strategy count, as a weight's layouts), a segment over the middle ops whose terms may
    cover the leaves' edges (a recomputed op gathers its weight again), maybe a tie class on
    two leaves (not folded), and a budget."""
    costs = st.floats(0.0, 5.0, allow_nan=False).map(lambda v: round(v, 2))
    sizes = st.floats(0.0, 50.0, allow_nan=False).map(lambda v: round(v, 1))
    ops = draw(st.integers(3, 4))
    widths = [draw(st.integers(1, 4)) for _ in range(2 * ops)]  # ops, then their leaves
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(draw(costs) for _ in range(w)),
            memory_bytes=tuple(draw(sizes) for _ in range(w)),
        )
        for i, w in enumerate(widths)
    )

    def table(a: int, b: int) -> tuple[tuple[float, ...], ...]:
        return tuple(tuple(draw(costs) for _ in range(widths[b])) for _ in range(widths[a]))

    edges = [Edge(src=i, dst=i + 1, cost_s=table(i, i + 1)) for i in range(ops - 1)]
    for i in range(ops):  # the leaf as the edge's source or, sometimes, its destination
        leaf = ops + i
        if draw(st.booleans()):
            edges.append(Edge(src=leaf, dst=i, cost_s=table(leaf, i)))
        else:
            edges.append(Edge(src=i, dst=leaf, cost_s=table(i, leaf)))
    members = tuple(range(1, ops))
    segment = Segment(
        name="s",
        nodes=members,
        freed_bytes=tuple(tuple(draw(sizes) for _ in range(widths[n])) for n in members),
        recompute_s=tuple(tuple(draw(costs) / 4 for _ in range(widths[n])) for n in members),
        edges=tuple(
            SegmentEdge(src=e.src, dst=e.dst, cost_s=table(e.src, e.dst))
            for e in edges
            if (e.dst in members or e.src in members) and draw(st.booleans())
        )
        # Sometimes a recomputed op reads the first op's leaf too: an edge the base lacks.
        + ((SegmentEdge(src=ops, dst=1, cost_s=table(ops, 1)),) if draw(st.booleans()) else ()),
        copies=draw(st.integers(1, 3)),
    )
    tied = ()
    if draw(st.booleans()) and widths[ops] == widths[ops + 1]:
        tied = ((ops, ops + 1),)
    budget = round(sum(max(n.memory_bytes) for n in nodes) * draw(st.floats(0.3, 1.0)), 1)
    return Problem(
        nodes=nodes, edges=tuple(edges), memory_budget_bytes=budget, segments=(segment,), tied=tied
    )


@settings(SETTINGS, max_examples=150)
@given(parameter_problems(), st.floats(0.0, 0.2), st.data())
def test_folded_leaves_bound_each_pattern_from_the_others_exact_optima(problem, lam, data):
    """With the other problem's exact pattern optima kept (the tightest it can keep), every
    floor is still at most this problem's exact optimum of that pattern: the folds (either
    orientation, with the patterns' terms on the leaf's edge) and the other differences are
    lower bounds."""
    costs = st.floats(0.0, 5.0, allow_nan=False)
    sizes = st.floats(0.0, 50.0, allow_nan=False)
    nodes = list(problem.nodes)
    for i in data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=3)):
        nodes[i] = dataclasses.replace(
            nodes[i],
            cost_s=tuple(data.draw(costs) for _ in nodes[i].cost_s),
            memory_bytes=tuple(data.draw(sizes) for _ in nodes[i].memory_bytes),
        )
    edges = list(problem.edges)
    if data.draw(st.booleans()):  # an edge's seconds differ too (not folded there)
        k = data.draw(st.integers(0, len(edges) - 1))
        rows = [[data.draw(costs) for _ in row] for row in edges[k].cost_s]
        edges[k] = dataclasses.replace(edges[k], cost_s=tuple(map(tuple, rows)))
    other = dataclasses.replace(problem, nodes=tuple(nodes), edges=tuple(edges))
    floors = _exact_floors(problem, other, lam)
    if floors is None:
        assert priced(dataclasses.replace(other, segments=()), lam) == priced(
            dataclasses.replace(problem, segments=()), lam
        )


def _layers(shift: float, seed: int = 3) -> Problem:
    """A chain of five nodes (three strategies each, seconds and bytes drawn from ``seed``),
    one segment over the middle three recomputable up to four times; ``shift`` added to the
    first node's seconds (the node another configuration prices otherwise). Seed 3 at
    multiplier 0.3 is one where the kept bounds spare a pattern solve (found by search)."""
    rng = random.Random(seed)
    width = 3

    def row(low: float, high: float) -> tuple[float, ...]:
        return tuple(round(rng.uniform(low, high), 1) for _ in range(width))

    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(v + (shift if i == 0 else 0.0) for v in row(0.0, 5.0)),
            memory_bytes=tuple(float(rng.randint(1, 10)) for _ in range(width)),
        )
        for i in range(5)
    )
    edges = tuple(
        Edge(src=i, dst=i + 1, cost_s=tuple(row(0.0, 3.0) for _ in range(width))) for i in range(4)
    )
    segment = Segment(
        name="s",
        nodes=(1, 2, 3),
        freed_bytes=tuple(tuple(float(rng.randint(0, 8)) for _ in range(width)) for _ in range(3)),
        recompute_s=tuple(row(0.0, 2.0) for _ in range(3)),
        copies=4,
    )
    return Problem(nodes=nodes, edges=edges, memory_budget_bytes=20.0, segments=(segment,))


def test_another_configuration_solves_fewer_patterns_for_the_same_bound():
    problem = _layers(0.0)
    other = dataclasses.replace(_layers(0.05), segments=problem.segments)
    patterns = recompute_patterns(problem)
    lam = 0.3
    solved: list[Problem] = []

    def counting(p: Problem, *stop: float) -> tuple[tuple[int, ...], float, float]:
        solved.append(p)
        return _free_solver(p)

    forget_kept()
    pattern_dual(problem, lam, counting, patterns, cache={})
    solved.clear()
    kept = pattern_dual(other, lam, counting, patterns, cache={})
    with_kept = len(solved)
    forget_kept()
    solved.clear()
    fresh = pattern_dual(other, lam, counting, patterns, cache={})
    assert with_kept < len(solved)
    assert math.isclose(kept.lower, fresh.lower, rel_tol=1e-12)
    assert math.isclose(kept.lower, min(_pattern_optimum(other, lam, p) for p in patterns))


def test_nothing_is_taken_at_another_multiplier_or_for_other_segments():
    problem = _layers(0.0)
    other = dataclasses.replace(_layers(0.05), segments=problem.segments)
    patterns = recompute_patterns(problem)
    forget_kept()
    pattern_dual(problem, 0.05, _free_solver, patterns, cache={})

    def floors(p: Problem, lam: float) -> list[float] | None:
        base = priced(dataclasses.replace(p, segments=()), lam)
        return kept_floors(p, base, lam, patterns, _terms(p, lam, patterns))

    assert floors(other, 0.05) is not None
    assert floors(other, 0.06) is None
    apart = _layers(0.05)  # equal segments, another object
    assert floors(apart, 0.05) is None
    assert floors(problem, 0.05) is None  # itself again
    forget_kept()
    assert floors(other, 0.05) is None


def _leaf_pair(
    leaf_costs: tuple[float, ...], other_leaf: tuple[float, ...] = (0.0, 0.0), leaf_first=True
):
    """One op (one strategy) reading two leaves of two strategies each through free edges
    (the leaves the edges' sources, or their destinations), a segment over the op (so one
    recompute pattern besides none)."""
    nodes = (
        Node(name="op", cost_s=(0.0,), memory_bytes=(1.0,)),
        Node(name="a", cost_s=leaf_costs, memory_bytes=(0.0, 0.0)),
        Node(name="b", cost_s=other_leaf, memory_bytes=(0.0, 0.0)),
    )
    if leaf_first:
        edges = tuple(Edge(src=i, dst=0, cost_s=((0.0,), (0.0,))) for i in (1, 2))
    else:
        edges = tuple(Edge(src=0, dst=i, cost_s=((0.0, 0.0),)) for i in (1, 2))
    segment = Segment(name="s", nodes=(0,), freed_bytes=((1.0,),), recompute_s=((1.0,),))
    return nodes, edges, segment


@pytest.mark.parametrize("leaf_first", [True, False], ids=["leaf-source", "leaf-destination"])
def test_a_leaf_is_folded_where_the_other_problem_would_not_take_its_cheapest_change(
    leaf_first: bool,
):
    """A parameter's second strategy (priced dear in A) gets 5 s cheaper in B, its first
    0.5 s dearer: node by node B is bounded 5 s below A, folded (the leaf's best strategy
    per strategy of the op) 0.5 s above, B's own optimum."""
    nodes, edges, segment = _leaf_pair((1.0, 10.0), leaf_first=leaf_first)
    problem = Problem(nodes=nodes, edges=edges, memory_budget_bytes=5.0, segments=(segment,))
    b_nodes = (nodes[0], dataclasses.replace(nodes[1], cost_s=(1.5, 5.0)), nodes[2])
    floors = _check_exact_floors(problem, dataclasses.replace(problem, nodes=b_nodes))
    assert floors == pytest.approx([1.5, 2.5])  # B's optima: A's 1.0 and 2.0, plus 0.5


def test_tied_leaves_are_bounded_node_by_node():
    """A leaf in a tie class is not folded (where the solver makes a class choose alike, its
    best strategy is not its own to pick): the same change as above bounds B 5 s below A."""
    nodes, edges, segment = _leaf_pair((1.0, 10.0))
    problem = Problem(
        nodes=nodes, edges=edges, memory_budget_bytes=5.0, segments=(segment,), tied=((1, 2),)
    )
    b_nodes = (nodes[0], dataclasses.replace(nodes[1], cost_s=(1.5, 5.0)), nodes[2])
    floors = _check_exact_floors(problem, dataclasses.replace(problem, nodes=b_nodes))
    assert floors == pytest.approx([-4.0, -3.0])


def _exact_floors(problem: Problem, other: Problem, lam: float) -> list[float] | None:
    """Keep A's (``problem``'s) exact pattern optima at ``lam``; B's (``other``'s) floors from
    them, each checked to be at most B's exact optimum of its pattern."""
    from solver.kept_lowers import keep_lowers

    patterns = recompute_patterns(problem)
    exact = [_pattern_optimum(problem, lam, p) for p in patterns]
    forget_kept()
    keep_lowers(
        problem, priced(dataclasses.replace(problem, segments=()), lam), lam, patterns, exact
    )
    base = priced(dataclasses.replace(other, segments=()), lam)
    floors = kept_floors(other, base, lam, patterns, _terms(other, lam, patterns))
    forget_kept()
    for floor, pattern in zip(floors, patterns, strict=True) if floors is not None else ():
        optimum = _pattern_optimum(other, lam, pattern)
        assert floor <= optimum + 1e-9 * max(1.0, abs(optimum))
    return floors


def _check_exact_floors(problem: Problem, other: Problem) -> list[float]:
    """:func:`_exact_floors` at multiplier 0, where some are expected."""
    floors = _exact_floors(problem, other, 0.0)
    assert floors is not None
    return floors
