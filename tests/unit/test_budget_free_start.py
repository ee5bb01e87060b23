"""How the first budgeted relaxation of a ZeRO search starts (issue 16, session 13), on tiny
budgeted problems against brute force: its priced solve at multiplier 0 taken from the
configuration's budget-free solve (solver.budgeted.budget_free_record)."""

from __future__ import annotations

import dataclasses

from hypothesis import given

from solver import InfeasibleError, solve
from solver.budgeted import Warm, budget_free_record
from solver.lagrangian import priced
from solver.presolve import plan_peak_memory_bytes
from tests.unit.test_lagrangian import _optimum, budgeted_problems
from tests.unit.test_zero_bounds import FEW, _counting_solves, _result


def _answer(solution) -> tuple:
    return (
        solution.choices,
        solution.objective_s,
        solution.bound_s,
        solution.num_variables,
        solution.num_constraints,
    )


@FEW
@given(budgeted_problems())
def test_a_relaxation_takes_its_first_priced_solve_from_the_budget_free_one(problem) -> None:
    free_problem = dataclasses.replace(problem, memory_budget_bytes=None, segments=())
    try:
        free = solve(free_problem)
        cold = solve(problem, gap=0.01)
    except InfeasibleError:
        return
    record = budget_free_record(problem, _answer(free))
    if any(seg.min_copies for seg in problem.segments):
        assert record is None  # at 0 the priced problem holds the forced recomputation
        return
    assert record is not None and len(record.answers) == 1
    calls = _counting_solves()
    try:
        warm = solve(problem, gap=0.01, warm_multipliers=Warm(0.0, 0.0, record))
    finally:
        import solver.shrink as shrink

        shrink.solve = calls.real
    optimum = _optimum(problem)
    scale = max(1.0, abs(optimum)) if optimum is not None else 1.0
    assert optimum is not None
    assert warm.bound_s <= optimum + 1e-9 * scale <= warm.objective_s + 2e-9 * scale
    assert plan_peak_memory_bytes(problem, warm.choices, warm.recomputed or None) <= (
        problem.memory_budget_bytes * (1 + 1e-12)
    )
    if "lagrangian_multiplier" not in cold.details:
        return  # no relaxation ran: nothing taken
    assert warm.details.get("lagrangian_reused_solves") == 1.0
    # Where the budget-free solve answers as the priced solve at 0 does, the very same search.
    at_zero = solve(priced(problem, 0.0), gap=0.0, relaxation=True)
    if (at_zero.choices, at_zero.objective_s, at_zero.bound_s) == _answer(free)[:3]:
        assert _result(warm) == _result(cold)
