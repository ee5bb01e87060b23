"""``solver.problem.gap_floor``: the least bound a plan is within the gap of, as the planner
reports gaps. A stop at ``bound >= objective * (1 - gap)`` alone let the tiny GPT's plan at
a 2.5 MB budget report 1.0000000000000063% at the default 1% (tests/planner/test_budget_gap)."""

from __future__ import annotations

import math

from hypothesis import example, given, settings
from hypothesis import strategies as st

from solver.problem import gap_floor


@settings(deadline=None, max_examples=500, derandomize=True)
@given(
    objective=st.floats(min_value=1e-12, max_value=1e6),
    gap=st.sampled_from([1e-9, 1e-4, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1]),
)
@example(objective=0.00029462137940165247, gap=0.01)  # the plan that reported 1.0000000000000063%
def test_the_floor_is_within_the_gap_as_reported_and_only_ulps_above_the_product(
    objective: float, gap: float
) -> None:
    floor = gap_floor(objective, gap)
    assert (objective - floor) / objective <= gap
    product = objective * (1.0 - gap)
    assert product <= floor <= product + 8 * math.ulp(objective)
    # Nothing lower than the floor passes: one ulp down is outside the gap (or below the
    # product, where the product itself was already inside).
    below = math.nextafter(floor, -math.inf)
    assert (objective - below) / objective > gap or below < product


def test_the_reported_example_fails_the_plain_product() -> None:
    objective, gap = 0.00029462137940165247, 0.01
    assert (objective - objective * (1.0 - gap)) / objective > gap  # why gap_floor exists
    assert gap_floor(objective, gap) > objective * (1.0 - gap)


def test_non_finite_objectives_are_the_product() -> None:
    assert gap_floor(math.inf, 0.01) == math.inf
    assert gap_floor(0.0, 0.01) == 0.0
