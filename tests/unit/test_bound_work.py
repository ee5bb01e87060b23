"""Work a bound evaluation no longer repeats (session 25, issue 16): the count patterns a
priced bound built are taken by the relaxation of that very problem; a priced bound fits one
plan that fits, no more; answer keys hash a node once while it is in consecutive problems;
array_table converts a finite matrix without an object array, to the same nested tuples."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import solver.lagrangian as lagrangian
from solver import Node, Problem
from solver.budgeted import EdgeHashes, Recorded, Warm, _answer_key, priced_bound, solve_relaxed
from solver.count_patterns import count_patterns
from solver.errors import InfeasibleError
from solver.tables import array_table
from tests.unit.test_count_patterns import layered_problems
from tests.unit.test_lagrangian import _optimum, budgeted_problems

FEW = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _relaxed(problem: Problem, warm: Warm):
    return solve_relaxed(
        problem, backend="highs", time_limit_s=None, gap=0.01, msg=False, warm=warm
    )


@FEW
@given(layered_problems(), st.floats(0.05, 2.0))
def test_the_relaxation_takes_the_bound_evaluations_count_patterns(problem, lam) -> None:
    if lagrangian.recompute_patterns(problem) is not None or count_patterns(problem) is None:
        return  # no count patterns here
    record = Recorded(edges=problem.edges)
    try:
        priced_bound(problem, lam, separable_multiplier=lam, record=record)
    except InfeasibleError:
        return
    assert record.counted is not None and record.counted[0] is problem
    counted = []
    original = lagrangian.count_patterns

    def counting(p: Problem):
        counted.append(p)
        return original(p)

    lagrangian.count_patterns = counting
    try:
        shared = _relaxed(problem, Warm(lam, lam, record))
        assert not counted  # taken from the record, not counted again
        alone = _relaxed(problem, Warm(lam, lam, None))
        # Another problem's patterns are not taken (the same values, another object).
        other = Recorded(edges=problem.edges, counted=(Problem(nodes=problem.nodes), None))
        _relaxed(problem, Warm(lam, lam, other))
    finally:
        lagrangian.count_patterns = original
    if shared is None or alone is None:
        assert shared is alone is None
        return
    assert shared.choices == alone.choices and shared.recomputed == alone.recomputed
    assert shared.objective_s == alone.objective_s and shared.bound_s == alone.bound_s


@FEW
@given(st.one_of(budgeted_problems(), layered_problems()), st.floats(0.0, 2.0))
def test_a_priced_bound_fits_one_plan_that_fits_and_no_more(problem, lam) -> None:
    fits = []
    original = lagrangian.fit_recompute

    def fitting(p: Problem, choices):
        found = original(p, choices)
        fits.append(found is not None)
        return found

    lagrangian.fit_recompute = fitting
    try:
        bound, step = priced_bound(problem, lam, separable_multiplier=lam, target=math.inf)
    except InfeasibleError:
        return
    finally:
        lagrangian.fit_recompute = original
    assert fits.count(True) <= 1
    assert (step is not None) == any(fits)
    optimum = _optimum(problem)
    if optimum is not None:
        tol = 1e-9 * max(1.0, abs(optimum))
        assert bound <= optimum + tol
        assert step is None or step >= optimum - tol


class _CountedCosts(tuple):
    """A node's costs that count how often they are hashed (as the plain tuple would hash)."""

    hashed = 0

    def __hash__(self) -> int:
        _CountedCosts.hashed += 1
        return tuple.__hash__(self)


def test_a_node_met_again_in_the_next_problem_is_not_hashed_again() -> None:
    nodes = [
        Node(name=f"n{i}", cost_s=_CountedCosts((1.0, float(i))), memory_bytes=(0.0, 0.0))
        for i in range(4)
    ]
    first, second = Problem(nodes=tuple(nodes[:3])), Problem(nodes=(*nodes[:2], nodes[3]))
    node_hashes = EdgeHashes()
    _answer_key(first, (), None, None, node_hashes)
    _CountedCosts.hashed = 0
    key = _answer_key(second, (), None, None, node_hashes)
    assert _CountedCosts.hashed == 1  # the new node only
    # The same key as with no memo, and as a problem of equal nodes of other objects.
    copies = tuple(
        Node(name=n.name, cost_s=tuple(n.cost_s), memory_bytes=n.memory_bytes) for n in second.nodes
    )
    assert key == _answer_key(second, ()) == _answer_key(Problem(nodes=copies), ())
    changed = (*copies[:2], Node(name="n3", cost_s=(1.0, 2.5), memory_bytes=(0.0, 0.0)))
    assert _answer_key(Problem(nodes=changed), ()) != key


def _reference_table(matrix: np.ndarray):
    """array_table's nested tuples as it formed them before (through an object array)."""
    finite = np.isfinite(matrix)
    values = matrix.astype(object)
    values[~finite] = None
    return tuple(map(tuple, values.tolist())), np.where(finite, matrix, np.inf)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=5),
        elements=st.one_of(st.floats(allow_nan=True), st.just(-0.0)),
    )
)
def test_array_table_gives_the_object_paths_tuples_signs_included(matrix) -> None:
    table = array_table(matrix)
    expected, held = _reference_table(matrix)
    assert [[repr(v) for v in row] for row in table] == [[repr(v) for v in row] for row in expected]
    assert table == expected and hash(table) == hash(expected)
    assert np.array_equal(table.matrix, held) and not table.matrix.flags.writeable
    assert [math.copysign(1.0, v) for v in table.matrix.ravel()] == [
        math.copysign(1.0, v) for v in held.ravel()
    ]
    assert matrix.flags.writeable  # the caller's matrix is not frozen
