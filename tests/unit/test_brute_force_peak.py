"""The brute-force oracle (solver/brute_force.py) sums a plan's peak as the solver does: every
term in one math.fsum. A plan exactly at the budget once summed over 3e-14 above it there
(a partial sum rounded first), so the oracle's optimum was above the plan the solver found
(tests/unit/test_no_search.py's hypothesis examples, in some test orders)."""

from __future__ import annotations

from solver import Edge, Node, Problem, solve
from solver.brute_force import brute_force_recompute
from solver.presolve import plan_peak_memory_bytes
from solver.problem import Segment

ZEROS = ((0.0, 0.0, 0.0),) * 3


def _at_the_budget() -> Problem:
    return Problem(
        nodes=(
            Node(
                name="n0",
                cost_s=(1.0, 1.0, 0.0),
                memory_bytes=(0.0, 0.0, 96.2),
                transient_bytes=(0.0, 0.0, 69.2),
            ),
            Node(name="n1", cost_s=(1.0, 0.0, 9.0), memory_bytes=(0.0, 69.2, 0.0)),
            Node(name="n2", cost_s=(0.0, 0.0, 0.0), memory_bytes=(0.0, 0.0, 0.0)),
        ),
        edges=(
            Edge(src=0, dst=1, cost_s=ZEROS),
            Edge(src=1, dst=2, cost_s=ZEROS),
            Edge(src=0, dst=2, cost_s=ZEROS),
        ),
        memory_budget_bytes=158.4,
        segments=(
            Segment(
                name="s02",
                nodes=(0, 1),
                freed_bytes=((0.0,) * 3,) * 2,
                recompute_s=((0.0,) * 3,) * 2,
                copies=1,
            ),
            Segment(
                name="s01",
                nodes=(0,),
                freed_bytes=((0.0, 0.0, 76.2),),
                recompute_s=((0.0, 0.0, 0.0),),
                copies=2,
            ),
        ),
    )


def test_a_plan_exactly_at_the_budget_fits_the_oracle_as_it_fits_the_solver() -> None:
    problem = _at_the_budget()
    choices, objective, recomputed = brute_force_recompute(problem)
    exact = solve(problem, gap=0.0)
    assert objective == exact.objective_s
    assert plan_peak_memory_bytes(problem, exact.choices, exact.recomputed) <= 158.4
    assert plan_peak_memory_bytes(problem, choices, recomputed) <= 158.4
    # The costless plan (n0 and n1 on their free strategies) fits only with s01 recomputed
    # twice, and then exactly at the budget.
    assert objective == 0.0
    assert plan_peak_memory_bytes(problem, (2, 1, 0), (0, 2)) == 158.4
