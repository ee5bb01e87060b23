"""The alternative (mixing) solve that configurations._finish caps at about the joint solve's
time: at gap 0 (as the stored plans are solved) with no user time limit, a capped alternative that found a better plan without
proving it is solved to the end, so the plan does not depend on the machine's load."""

from __future__ import annotations

import pytest

import solver
from autopar.options import PlanOptions
from autopar.planner.configurations import _cut_short


def _solution(objective_s: float, *, status: str = "optimal", gap: float = 0.0) -> solver.Solution:
    return solver.Solution(
        choices=(0,),
        objective_s=objective_s,
        bound_s=objective_s * (1 - gap),
        gap=gap,
        status=status,
        backend="highs",
        peak_memory_bytes=0.0,
        num_variables=1,
        num_constraints=0,
        build_s=0.0,
        solve_s=0.0,
    )


JOINT = _solution(2.0)
CAPPED_BETTER = _solution(1.5, status="feasible", gap=0.1)


def test_capped_better_alternative_is_solved_to_the_end_at_gap_0():
    assert _cut_short(CAPPED_BETTER, JOINT, PlanOptions(gap=0.0), limit=10.0)


@pytest.mark.parametrize(
    ("plain", "options", "limit"),
    [
        (None, PlanOptions(gap=0.0), 10.0),  # no alternative plan at all
        (_solution(1.5), PlanOptions(gap=0.0), 10.0),  # proven optimal already
        (_solution(2.5, status="feasible", gap=0.1), PlanOptions(gap=0.0), 10.0),  # worse
        (CAPPED_BETTER, PlanOptions(gap=0.0, time_limit_s=5.0), 5.0),  # the user's limit
        (CAPPED_BETTER, PlanOptions(gap=0.0), None),  # not capped by _finish
        (CAPPED_BETTER, PlanOptions(gap=0.2), 10.0),  # within the gap the user allows
        (CAPPED_BETTER, PlanOptions(gap=0.01), 10.0),  # a gap to spend: the cap stands
    ],
)
def test_otherwise_the_alternative_stands(plain, options, limit):
    assert not _cut_short(plain, JOINT, options, limit)
