"""The Lagrangian multiplier search (solver/lagrangian.py relax): the slope it steers by is a
supergradient of the concave dual D, so the tangents it stops on bound D from above, and the
search still ends with a valid bound and a plan that fits (brute force on small problems)."""

from __future__ import annotations

import dataclasses
import math

from hypothesis import given
from hypothesis import strategies as st

from solver import Node, Problem, brute_force
from solver.lagrangian import priced, relax, relaxed_peak, transient_floor
from solver.problem import Segment
from tests.unit.test_lagrangian import SETTINGS, _free_solver, _optimum, budgeted_problems


def _dual(problem, lam: float) -> tuple[float, float] | None:
    """(D(lam), its slope from relaxed_peak) by brute force; None when no plan exists."""
    try:
        choices, value = brute_force(priced(problem, lam))
    except Exception:  # the edges forbid every plan
        return None
    constant = problem.memory_offset_bytes + transient_floor(problem) - problem.memory_budget_bytes
    return value + lam * constant, relaxed_peak(problem, choices, lam) - problem.memory_budget_bytes


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0), st.floats(0.0, 2.0))
def test_the_slope_is_a_supergradient_of_the_dual(problem, a, b) -> None:
    """D(b) <= D(a) + slope(a) (b - a) for any two multipliers: nested segments share nodes,
    where counting every segment's freed bytes would overstate the slope."""
    scale = 0.1
    at_a, at_b = _dual(problem, a * scale), _dual(problem, b * scale)
    if at_a is None or at_b is None:
        return
    (d_a, slope), (d_b, _) = at_a, at_b
    assert d_b <= d_a + slope * (b - a) * scale + 1e-7 * max(1.0, abs(d_a), abs(d_b))


@SETTINGS
@given(budgeted_problems(), st.sampled_from([0.0, 0.01, 0.2]))
def test_the_search_bounds_the_optimum_and_its_plan_fits(problem, gap) -> None:
    optimum = _optimum(problem)
    if optimum is None:
        return
    found = relax(problem, _free_solver, target_gap=gap, max_evaluations=10)
    tolerance = 1e-9 * max(1.0, abs(optimum))
    assert found.bound_s <= optimum + tolerance
    if found.choices is not None:  # its tied nodes may differ: above the untied optimum
        untied = _optimum(dataclasses.replace(problem, tied=()))
        assert math.isfinite(found.objective_s)
        assert found.objective_s >= untied - 1e-9 * max(1.0, abs(untied))


def test_a_node_in_nested_segments_frees_its_bytes_once_in_the_slope() -> None:
    """One node in a block and in its attention segment (both free 10 bytes, recompute for
    free): D(lam) = lam (16 - 10 - budget), so the slope is 6 - 10 - budget, not 6 - 20."""
    node = Node(name="n0", cost_s=(1.0,), memory_bytes=(16.0,))
    segments = tuple(
        Segment(name=name, nodes=(0,), freed_bytes=((10.0,),), recompute_s=((0.0,),))
        for name in ("block", "attention")
    )
    problem = Problem(nodes=(node,), memory_budget_bytes=6.0, segments=segments)
    assert relaxed_peak(problem, (0,), 0.5) == 6.0
    (d_a, slope), (d_b, _) = _dual(problem, 0.5), _dual(problem, 1.5)
    assert d_b <= d_a + slope * 1.0 + 1e-12
