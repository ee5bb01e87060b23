"""The pattern bounds' floors (solver/pattern_bounds.py PatternTerms), kept as distinct arrays
per block with their pairwise minima cached, equal the full recomputation over the dense
patterns-by-entries matrix (the same floats), for every pattern or a subset of them; and the
priced problems formed from arrays kept across multipliers (lagrangian.Pricing) equal the
node-by-node construction."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver.lagrangian import priced
from solver.pattern_bounds import PatternTerms
from solver.pricing import Pricing
from solver.problem import Node, Problem
from tests.unit.test_lagrangian import budgeted_problems

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

_VALUES = st.sampled_from([0.0, -0.0, 1.0, -2.5, 0.1, 3e-7, 1e12, np.inf, np.nan])


def _dense_floors(terms: list[tuple[dict, dict]], solved: int, value: float) -> np.ndarray:
    """The full recomputation: every pattern's terms as one row (zero where it adds nothing),
    the solved row subtracted, the least entry per node or edge summed."""
    sizes: dict[tuple, int] = {}
    for extra, extra_edges in terms:
        sizes.update({("n", n): np.size(v) for n, v in extra.items()})
        sizes.update({("e", key): np.size(m) for key, m in extra_edges.items()})
    if not sizes:
        return np.full(len(terms), value)
    keys = sorted(sizes)
    offsets = np.cumsum([0] + [sizes[key] for key in keys])
    rows = np.zeros((len(terms), offsets[-1]))
    for k, (extra, extra_edges) in enumerate(terms):
        for tag, table in (("n", extra), ("e", extra_edges)):
            for key, v in table.items():
                at = offsets[keys.index((tag, key))]
                rows[k, at : at + np.size(v)] = np.ravel(v)
    with np.errstate(invalid="ignore"):  # inf - inf: nan, as the solver's table gives
        diff = rows - rows[solved]
    return value + np.minimum.reduceat(diff, offsets[:-1], axis=1).sum(axis=1)


@st.composite
def pattern_term_lists(draw: st.DrawFn) -> list[tuple[dict, dict]]:
    """Patterns adding terms to a few of 4 nodes (1-3 strategies) and 3 edges, drawn from a
    small pool per node or edge so that patterns often add equal arrays (as patterns
    recomputing the same segments do), sometimes equal copies rather than the same object."""
    node_sizes = [draw(st.integers(1, 3)) for _ in range(4)]
    edge_shapes = {(0, 1): (node_sizes[0], node_sizes[1]), (1, 3): (node_sizes[1], node_sizes[3])}
    edge_shapes[2, 3] = (node_sizes[2], node_sizes[3])

    def arrays(shape: tuple[int, ...]) -> list[np.ndarray]:
        pool = []
        for _ in range(draw(st.integers(1, 3))):
            size = int(np.prod(shape))
            flat = draw(st.lists(_VALUES, min_size=size, max_size=size))
            pool.append(np.asarray(flat, dtype=np.float64).reshape(shape))
        return pool

    node_pools = [arrays((n,)) for n in node_sizes]
    edge_pools = {key: arrays(shape) for key, shape in edge_shapes.items()}
    terms = []
    for _ in range(draw(st.integers(1, 6))):
        extra, extra_edges = {}, {}
        for n, pool in enumerate(node_pools):
            if draw(st.booleans()):
                v = pool[draw(st.integers(0, len(pool) - 1))]
                extra[n] = v.copy() if draw(st.booleans()) else v
        for key, pool in edge_pools.items():
            if draw(st.booleans()):
                m = pool[draw(st.integers(0, len(pool) - 1))]
                extra_edges[key] = m.copy() if draw(st.booleans()) else m
        terms.append((extra, extra_edges))
    return terms


@SETTINGS
@given(pattern_term_lists(), st.floats(-10.0, 10.0), st.data())
def test_floors_equal_the_dense_recomputation(terms, value, data):
    snapshot = [
        ({n: v.copy() for n, v in e.items()}, {k: m.copy() for k, m in f.items()}) for e, f in terms
    ]
    table = PatternTerms(terms)
    # Equal arrays were replaced by one shared object: the terms' values are unchanged.
    for (extra, extra_edges), (before, before_edges) in zip(terms, snapshot, strict=True):
        for now, then in ((extra, before), (extra_edges, before_edges)):
            assert now.keys() == then.keys()
            for key, v in now.items():
                assert np.array_equal(v, then[key], equal_nan=True)
    for solved in range(len(terms)):
        expected = _dense_floors(snapshot, solved, value)
        assert table.floors(solved, value).tobytes() == expected.tobytes()
        among = data.draw(st.lists(st.integers(0, len(terms) - 1), unique=True))
        assert table.floors(solved, value, among).tobytes() == expected[among].tobytes()


def test_floors_share_equal_arrays_and_keep_unequal_ones_apart():
    a, b = np.array([1.0, 2.0]), np.array([1.0, 3.0])
    terms = [({0: a}, {}), ({0: a.copy()}, {}), ({0: b}, {})]
    table = PatternTerms(terms)
    assert terms[1][0][0] is a and terms[2][0][0] is b
    assert table.floors(0, 5.0).tolist() == [5.0, 5.0, 5.0]
    assert table.floors(2, 5.0).tolist() == [4.0, 4.0, 5.0]


def _priced_node_by_node(problem: Problem, lam: float) -> Problem:
    """The priced problem as formed before lagrangian.Pricing: every node's tuples converted
    at each multiplier, the segment terms accumulated node by node."""
    forced = [np.zeros(n.num_choices) for n in problem.nodes]
    best_free = [np.zeros(n.num_choices) for n in problem.nodes]
    for seg in problem.segments:
        spare = seg.copies - seg.min_copies
        for n, freed, again in zip(seg.nodes, seg.freed_bytes, seg.recompute_s, strict=True):
            v = np.asarray(again) - lam * np.asarray(freed)
            if seg.min_copies:
                forced[n] += seg.min_copies * v
            np.minimum(best_free[n], spare * np.minimum(v, 0.0), out=best_free[n])
    seg_terms = [f + g for f, g in zip(forced, best_free, strict=True)]
    nodes = tuple(
        Node(
            name=node.name,
            cost_s=tuple(
                (
                    np.asarray(node.cost_s)
                    + lam * np.asarray(node.memory_bytes)
                    + (seg_terms[i] if problem.segments else 0.0)
                ).tolist()
            ),
            memory_bytes=(0.0,) * node.num_choices,
        )
        for i, node in enumerate(problem.nodes)
    )
    return Problem(nodes=nodes, edges=problem.edges, tied=problem.tied)


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0), st.floats(0.0, 3.0))
def test_priced_from_arrays_kept_across_multipliers_equals_node_by_node(problem, lam, other):
    pricing = Pricing(problem)
    for multiplier in (lam, other, lam):
        assert priced(problem, multiplier, pricing) == _priced_node_by_node(problem, multiplier)
    no_segments = dataclasses.replace(problem, segments=())
    assert priced(no_segments, lam) == _priced_node_by_node(no_segments, lam)


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0), st.data())
def test_a_pattern_bound_on_kept_terms_is_the_one_made_afresh(problem, lam, data):
    """pattern_dual takes the terms and floors of the last multiplier and patterns for the
    very same segments object (pattern_bounds.pattern_table): on another problem with those
    segments and other node costs (another ZeRO configuration), at the same multiplier, the
    evaluation equals one made with nothing kept."""
    from solver import pattern_bounds
    from solver.errors import InfeasibleError
    from solver.kept_lowers import forget_lowers
    from solver.lagrangian import pattern_dual, recompute_patterns
    from tests.unit.test_lagrangian import _free_solver

    patterns = recompute_patterns(problem)
    if not patterns:
        return
    costs = st.floats(0.0, 10.0, allow_nan=False)
    other = dataclasses.replace(
        problem,
        nodes=tuple(
            dataclasses.replace(n, cost_s=tuple(data.draw(costs) for _ in n.cost_s))
            for n in problem.nodes
        ),
    )
    for at in (lam, lam + 0.5):  # the same multiplier, then another (nothing to take)
        pattern_bounds.forget_table()
        try:
            pattern_dual(problem, lam, _free_solver, patterns, cache={})
        except InfeasibleError:  # the edges forbid every plan, whatever the costs
            return
        terms = pattern_bounds._TABLE[0][2]
        forget_lowers()  # the kept lower bounds would raise some (test_kept_lowers.py)
        kept = pattern_dual(other, at, _free_solver, patterns, cache={})
        assert (pattern_bounds._TABLE[0][2] is terms) == (at == lam)
        pattern_bounds.forget_table()
        fresh = pattern_dual(other, at, _free_solver, patterns, cache={})
        assert repr(kept) == repr(fresh)
