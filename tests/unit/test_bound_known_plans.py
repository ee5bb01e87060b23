"""A priced bound given known plans (solver.budgeted.priced_bound ``plans``): where one of them
is priced under the target at the separable multiplier, the separable D cannot reach the
target and is not solved where the pattern D reaches it. On tiny budgeted problems with
patterns, against the same bound without plans: Pricing.plan_value is the priced problem's
objective of the plan, the bound is the same (so is the skip), it is under the optimum, and
the separable solve is left out exactly where the plan is priced under the target and the
bound skips (one priced solve fewer)."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solver.shrink as shrink
from solver import InfeasibleError, Problem
from solver.budgeted import Recorded, priced_bound
from solver.count_patterns import count_patterns
from solver.lagrangian import priced, recompute_patterns, transient_floor
from solver.presolve import plan_objective_s
from solver.pricing import Pricing
from tests.unit.test_budget_stops import assert_bounds_optimum
from tests.unit.test_lagrangian import _optimum, budgeted_problems
from tests.unit.test_zero_bounds import _counting_solves

FEW = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _bound(problem: Problem, lams: tuple[float, float], target: float, plans) -> tuple:
    """priced_bound at (separable, pattern) multipliers ``lams``: the bound, the feasibility
    step, the priced solves made and the multipliers recorded."""
    record = Recorded(edges=problem.edges)
    calls = _counting_solves()
    try:
        bound, fits = priced_bound(
            problem, lams[1], separable_multiplier=lams[0], target=target, record=record,
            plans=plans,
        )  # fmt: skip
    finally:
        shrink.solve = calls.real
    return bound, fits, len(calls), set(record.bounds)


@FEW
@given(
    budgeted_problems(),
    st.floats(0.0, 2.0),
    st.floats(0.0, 2.0),
    st.lists(st.integers(0, 2), min_size=5, max_size=5),
    st.sampled_from((0.9, 0.999, 1.001, 1.1)),
)
def test_a_known_plan_under_the_target_leaves_the_separable_solve_out(
    problem: Problem, lam_sep: float, lam: float, picks: list[int], scale: float
) -> None:
    if recompute_patterns(problem) is None and count_patterns(problem) is None:
        return  # no pattern D: the separable D alone is the bound
    plan = tuple(p % node.num_choices for p, node in zip(picks, problem.nodes, strict=False))
    pricing = Pricing(problem)
    value = pricing.plan_value(problem, lam_sep, plan)
    try:
        exact = plan_objective_s(priced(problem, lam_sep, pricing), plan)
    except InfeasibleError:
        exact = math.inf
    assert value == exact or abs(value - exact) <= 1e-12 * max(1.0, abs(exact))
    optimum = _optimum(problem)
    constant = problem.memory_offset_bytes + transient_floor(problem) - problem.memory_budget_bytes
    upper = value + lam_sep * constant
    # Targets on both sides of the plan's price (skipping the separable solve or not).
    target = upper * scale if math.isfinite(upper) and upper else scale
    try:
        without = _bound(problem, (lam_sep, lam), target, ())
        given_plan = _bound(problem, (lam_sep, lam), target, (plan,))
    except InfeasibleError:
        return
    assert given_plan[0] == without[0]  # the same bound, so the same skip decision
    skipped_solve = upper < target and without[0] >= target and lam_sep != lam
    assert given_plan[2] <= without[2] - skipped_solve
    if skipped_solve:
        assert lam_sep not in given_plan[3] and lam_sep in without[3]
    else:
        assert given_plan[2:] == without[2:]
    assert_bounds_optimum(optimum, given_plan[0], None)
    if given_plan[1] is not None:
        assert optimum is not None and given_plan[1] >= optimum * (1 - 1e-9)
