"""A priced bound with a skip target stops its pattern D once a priced plan is below the
target (solver.budgeted.priced_bound): on tiny budgeted problems with recompute patterns,
against the same bound evaluated whole and against brute force, the skip decision is the
same, a bound that skips is the whole D itself, the bound is below the optimum, and it takes
no more priced solves (fewer in some examples)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solver.shrink as shrink
from solver import InfeasibleError, Problem
from solver.budgeted import Recorded, priced_bound
from solver.count_patterns import count_patterns
from solver.lagrangian import recompute_patterns
from tests.unit.test_budget_stops import assert_bounds_optimum
from tests.unit.test_lagrangian import _optimum, budgeted_problems
from tests.unit.test_zero_bounds import _counting_solves

FEW = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
SAVED: list[int] = []
"""Per example, the priced solves the target saved (checked over all of them below)."""


def _bound(problem: Problem, lam: float, target: float | None) -> tuple[float, int]:
    """priced_bound's bound at ``lam`` (the pattern D: no separable multiplier) and the priced
    solves it made."""
    record = Recorded(edges=problem.edges)
    calls = _counting_solves()
    try:
        bound, _ = priced_bound(problem, lam, target=target, record=record)
    finally:
        shrink.solve = calls.real
    assert record.bounds[lam] == bound
    return bound, len(calls)


@FEW
@given(budgeted_problems(), st.floats(0.0, 2.0), st.sampled_from((0.9, 0.999, 1.001, 1.1)))
def test_a_target_keeps_the_skip_and_the_bound_below_the_optimum(
    problem: Problem, lam: float, scale: float
) -> None:
    if recompute_patterns(problem) is None and count_patterns(problem) is None:
        return  # no pattern D: the separable D alone, which has nothing to give up
    optimum = _optimum(problem)
    try:
        whole, whole_solves = _bound(problem, lam, None)
    except InfeasibleError:
        return
    # Targets near the whole D, on both sides of it (skip or not). Not at D itself: the
    # target is moved by the bound's constant and back, so at D a rounding decides the side.
    target = whole * scale if math.isfinite(whole) and whole else scale
    given_up, solves = _bound(problem, lam, target)
    tolerance = 1e-9 * max(1.0, abs(whole))
    assert (given_up >= target) == (whole >= target)
    assert given_up <= whole + tolerance
    if whole >= target:  # above the target the pattern D is evaluated whole
        assert (given_up, solves) == (whole, whole_solves)
    assert solves <= whole_solves
    assert_bounds_optimum(optimum, given_up, None)
    SAVED.append(whole_solves - solves)


def test_the_targets_saved_priced_solves() -> None:
    # Runs after the hypothesis test above (file order): in some of its examples the pattern
    # D stopped at the target before every pattern was solved.
    assert sum(SAVED) > 0, SAVED
