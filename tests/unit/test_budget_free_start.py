"""How the first budgeted relaxation of a ZeRO search starts (issue 16, session 13), on tiny
budgeted problems against brute force: its priced solve at multiplier 0 taken from the
configuration's budget-free solve (solver.budgeted.budget_free_record), and its first
multiplier after 0 where freeing the budget-free plan's excess is worth the gap."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import given

from solver import Edge, InfeasibleError, Node, Problem, solve
from solver.budgeted import Warm, budget_free_record
from solver.lagrangian import priced, relax
from solver.presolve import plan_peak_memory_bytes
from tests.unit.test_lagrangian import _free_solver, _optimum, budgeted_problems
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


def _barely_binding_chain(num_nodes: int = 40, seed: int = 5) -> Problem:
    """A chain of 3-strategy nodes (time vs bytes) whose budget-free plan is a little over the
    budget: a plan within 1% of the budget-free optimum fits."""
    rng = random.Random(seed)
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=(10.0, 10.0 + rng.uniform(0.001, 0.01), 10.0 + rng.uniform(1, 3)),
            memory_bytes=(100.0, 100.0 - rng.uniform(5, 10), 100.0 - rng.uniform(20, 30)),
        )
        for i in range(num_nodes)
    )
    edges = tuple(Edge(src=i, dst=i + 1, cost_s=((0.0,) * 3,) * 3) for i in range(num_nodes - 1))
    return Problem(nodes=nodes, edges=edges, memory_budget_bytes=100.0 * num_nodes - 150.0)


def test_the_first_multiplier_after_zero_prices_the_excess_at_the_gap() -> None:
    # first_multiplier (spread of seconds over spread of bytes) prices a byte at about 0.1 s
    # here, where trading 40 nodes' 5-10 bytes for 0.001-0.01 s each is what the budget asks:
    # from there the search bisected down several times. The gap's price of the excess finds
    # a plan within 1% at the first multiplier after 0.
    problem = _barely_binding_chain()
    found = relax(problem, _free_solver, target_gap=0.01)
    assert found.choices is not None
    assert found.objective_s - found.bound_s <= 0.01 * found.objective_s
    assert found.evaluations == 2
    optimum = solve(problem, gap=0.0).objective_s  # the exact MIP (too many for brute force)
    assert found.bound_s <= optimum + 1e-9 <= found.objective_s + 2e-9
