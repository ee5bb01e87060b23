"""pattern_bounds.pattern_terms with its cache (each node's and edge's term formed once per way
of forming it at a multiplier, shared by the patterns that form it alike) gives, bitwise, the
terms formed pattern by pattern, across multipliers and in any order of the patterns."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver.lagrangian import priced, recompute_patterns
from solver.pattern_bounds import (
    PatternTerms,
    Scaled,
    pattern_problem,
    pattern_terms,
    term_array,
    trivial_floor,
)
from solver.problem import Node, Problem, Segment, SegmentEdge
from tests.unit.test_lagrangian import budgeted_problems


def _plain_terms(problem: Problem, lam: float, pattern: tuple[int, ...]):
    """The terms as formed before the cache: segment by segment, node by node."""
    on = [k for k, r in enumerate(pattern) if r]
    smallest = {k: math.fsum(min(row) for row in problem.segments[k].freed_bytes) for k in on}
    alive = max(on, key=lambda k: smallest[k]) if on else None
    extra: dict = {}
    extra_edges: dict = {}
    for k in on:
        seg, r = problem.segments[k], pattern[k]
        for n, freed, again in zip(seg.nodes, seg.freed_bytes, seg.recompute_s, strict=True):
            freed, again = np.asarray(freed, dtype=float), np.asarray(again, dtype=float)
            term = r * (again - lam * freed)
            if k == alive:
                term = term + lam * freed
            extra[n] = extra.get(n, 0.0) + term
        for e in seg.edges:
            key = (e.src, e.dst)
            extra_edges[key] = extra_edges.get(key, 0.0) + r * np.asarray(e.cost_s, dtype=float)
    lower = math.fsum(float(np.min(v)) for v in extra.values()) + math.fsum(
        float(np.min(m)) for m in extra_edges.values()
    )
    return lower, alive, extra, extra_edges


def _same(got: dict, want: dict) -> bool:
    return list(got) == list(want) and all(
        np.asarray(got[k]).tobytes() == np.asarray(want[k]).tobytes() for k in want
    )


@pytest.mark.parametrize("lazy", [False, True])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budgeted_problems(), st.floats(0.0, 2.0), st.floats(0.0, 3.0), st.randoms(), st.data())
def test_cached_terms_equal_the_plain_ones_bitwise(lazy, problem, lam, other, rng, data):
    """Also ``lazy`` (edge terms held as Scaled): multiplied out, the same floats, their least
    entry the plain array's; an edge's term is the very object at every multiplier."""
    problem = _with_segment_edges(problem, data)
    patterns = recompute_patterns(problem) or []
    cache: dict = {}
    edges_formed: dict = {}
    for multiplier in (lam, other, lam):
        order = list(patterns) * 2  # every pattern twice: the second time from the cache
        rng.shuffle(order)
        formed: dict = {}
        for pattern in order:
            got = pattern_terms(problem, multiplier, pattern, cache, lazy=lazy)
            want = _plain_terms(problem, multiplier, pattern)
            assert got[0] == want[0] and got[1] == want[1]
            assert _same(got[2], want[2]) and _same(got[3], want[3])
            for n, v in got[2].items():  # a pattern formed alike shares the very object
                assert formed.setdefault(pattern, {}).setdefault(n, v) is v
            for key, m in got[3].items():
                assert isinstance(m, Scaled) == lazy
                assert edges_formed.setdefault((pattern, key), m) is m
                if lazy:
                    assert m.least == float(np.min(want[3][key]))
                    assert term_array(m).tobytes() == np.asarray(want[3][key]).tobytes()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budgeted_problems(), st.floats(0.0, 2.0), st.data())
def test_lazy_terms_give_the_plain_terms_floors_and_problems_bitwise(problem, lam, data):
    """Every consumer of pattern_table's lazy terms (PatternTerms' floors, trivial_floor,
    pattern_problem) gives what it gives on the terms multiplied out, bit for bit."""
    problem = _with_segment_edges(problem, data)
    patterns = recompute_patterns(problem) or []
    base = priced(dataclasses.replace(problem, segments=()), lam)
    lazy = [pattern_terms(problem, lam, p, {}, lazy=True) for p in patterns]
    plain = [pattern_terms(problem, lam, p) for p in patterns]
    held_lazy: dict = {}
    held_plain: dict = {}
    for a, b in zip(lazy, plain, strict=True):
        assert a[0] == b[0]
        assert trivial_floor(base, a[2], a[3], held_lazy) == trivial_floor(
            base, b[2], b[3], held_plain
        )
        got, want = pattern_problem(base, a[2], a[3]), pattern_problem(base, b[2], b[3])
        assert got.nodes == want.nodes and _edge_bits(got) == _edge_bits(want)
    tables = [PatternTerms([(t[2], t[3]) for t in terms]) for terms in (lazy, plain)]
    for k in range(len(patterns)):
        value = data.draw(st.floats(-5.0, 5.0))
        got, want = (table.floors(k, value) for table in tables)
        assert got.tobytes() == want.tobytes()


def _edge_bits(problem: Problem) -> list:
    """Every edge's endpoints and table, floats as bits (None kept)."""
    return [
        (
            e.src,
            e.dst,
            [[None if c is None else np.float64(c).tobytes() for c in row] for row in e.cost_s],
        )
        for e in problem.edges
    ]


def _with_segment_edges(problem: Problem, data: st.DataObject) -> Problem:
    """``problem`` whose segments of two nodes or more re-issue edges: one the problem has
    (its first two nodes) and one it has not (the reverse pair)."""
    seconds = st.sampled_from([0.0, 0.25, 1.0, 2.5])

    def table(u: int, v: int) -> tuple:
        width_u, width_v = problem.nodes[u].num_choices, problem.nodes[v].num_choices
        return tuple(tuple(data.draw(seconds) for _ in range(width_v)) for _ in range(width_u))

    segments = []
    for seg in problem.segments:
        if len(seg.nodes) >= 2:
            a, b = seg.nodes[:2]
            edges = (
                SegmentEdge(src=a, dst=b, cost_s=table(a, b)),
                SegmentEdge(src=b, dst=a, cost_s=table(b, a)),
            )
            seg = dataclasses.replace(seg, edges=edges)
        segments.append(seg)
    return dataclasses.replace(problem, segments=tuple(segments))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budgeted_problems(), st.floats(0.0, 2.0), st.randoms(), st.data())
def test_pattern_problems_with_shared_tables_equal_the_plain_ones_bitwise(problem, lam, rng, data):
    """pattern_problem with the tables kept over an evaluation (pattern_dual's) builds, in any
    order and repeated, the problem it builds alone, bit for bit; a pattern problem built
    right after one with the same edge term shares that Edge object."""
    problem = _with_segment_edges(problem, data)
    patterns = recompute_patterns(problem) or []
    base = priced(dataclasses.replace(problem, segments=()), lam)
    cache: dict = {}
    terms = {p: pattern_terms(problem, lam, p, cache) for p in patterns}
    order = list(patterns) * 2
    rng.shuffle(order)
    tables: dict = {}
    last = None
    for pattern in order:
        _, _, extra, extra_edges = terms[pattern]
        got = pattern_problem(base, extra, extra_edges, tables)
        want = pattern_problem(base, extra, extra_edges)
        assert got.nodes == want.nodes and got.tied == want.tied
        assert _edge_bits(got) == _edge_bits(want)
        if last is not None and last[0] == pattern:  # the same terms again: the same Edges
            assert all(a is b for a, b in zip(got.edges, last[1].edges, strict=True))
        last = (pattern, got)


def test_rows_and_tables_shared_by_segments_become_one_array() -> None:
    """Segments of identical layers share their rows and tables (autopar converts each once):
    with a cache, each such object becomes one array, whichever segment meets it first, and
    the terms are those formed without the cache, bit for bit."""
    row, other = (1.0, 2.0), (0.5, -0.0)
    table = ((0.0, 0.25), (1.0, 2.5))
    nodes = tuple(Node(name=f"n{i}", cost_s=(0.0, 0.0), memory_bytes=(1.0, 2.0)) for i in range(4))
    segments = tuple(
        Segment(
            name=f"layer{k}",
            nodes=(2 * k, 2 * k + 1),
            freed_bytes=(row, other),
            recompute_s=(other, row),
            edges=(SegmentEdge(src=2 * k, dst=2 * k + 1, cost_s=table),),
        )
        for k in range(2)
    )
    problem = Problem(nodes=nodes, segments=segments, memory_budget_bytes=10.0)
    cache: dict = {}
    got = pattern_terms(problem, 0.5, (1, 1), cache)
    want = _plain_terms(problem, 0.5, (1, 1))
    assert got[0] == want[0] and got[1] == want[1]
    assert _same(got[2], want[2]) and _same(got[3], want[3])
    first, second = cache[0], cache[1]
    assert first[1][0][1] is second[1][0][1]  # the table: one array
    assert first[0][0][1] is second[0][0][1] and first[0][0][2] is second[0][0][2]
    assert len(cache["arrays"]) == 3  # row, other, table


def test_scaled_terms_alike_only_with_the_same_tables_and_copies() -> None:
    """PatternTerms holds a Scaled term unmade, one per tables and copies: a term of the same
    table at other copies is another array (its floors those of the arrays multiplied out),
    one of the same table and copies becomes the first such object."""
    table = np.array([[0.5, -1.0], [2.0, 0.25]])
    other = table.copy()  # equal entries, another table: kept apart (only sharing is lost)
    scaled = [
        Scaled(((1, table),), None),
        Scaled(((3, table),), None),
        Scaled(((3, table),), None),
        Scaled(((3, other),), None),
        Scaled(((1, table), (2, other)), None),
    ]
    lazy = [({}, {(0, 1): m}) for m in scaled]
    plain = [({}, {(0, 1): term_array(m)}) for m in scaled]
    got, want = PatternTerms(lazy), PatternTerms(plain)
    assert lazy[2][1][(0, 1)] is scaled[1] and lazy[3][1][(0, 1)] is scaled[3]
    assert len(got.distinct[0]) == 4
    for k in range(len(scaled)):
        assert got.floors(k, 1.0).tobytes() == want.floors(k, 1.0).tobytes()
    assert [m.least for m in scaled] == [float(np.min(term_array(m))) for m in scaled]


def test_a_trivial_floor_where_an_edge_allows_no_pair_is_infinite() -> None:
    """No plan exists: the floor is inf with or without a pattern's terms on that edge (it
    was nan: inf less inf, found by the hypothesis test above)."""
    from solver.problem import Edge

    nodes = tuple(Node(name=n, cost_s=(0.0, 1.0), memory_bytes=(0.0, 0.0)) for n in "ab")
    base = Problem(nodes=nodes, edges=(Edge(src=0, dst=1, cost_s=((None, None), (None, None))),))
    assert trivial_floor(base, {}, {}, {}) == math.inf
    assert trivial_floor(base, {1: np.ones(2)}, {(0, 1): np.zeros((2, 2))}, {}) == math.inf
