"""A configuration's budget-free solve as its relaxation's first priced solve (issue 16).

At multiplier 0 the priced problem of a budgeted ZeRO configuration is its budget-free one
(bytes priced at 0, no segment term where no segment must be recomputed), so the optimum the
search found without the budget is that evaluation's answer, and the relaxation takes it
instead of solving it again (0.3-0.5 s on llama3-8b b32 s8192, 1 s on llama3-70b b256 fp32).
Also here: a plan in a built problem's solver indices (:func:`solver_choices`), which that
and the primal search (autopar/planner/primal.py) need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import solver
from autopar.planner.problem import BuiltProblem
from autopar.planner.solve_log import Solved
from solver.budgeted import Recorded, budget_free_record
from solver.presolve import plan_objective_s


def budget_free_answer(
    built: BuiltProblem, problem: solver.Problem, free: Solved
) -> Recorded | None:
    """``free`` (the configuration solved without the budget, at the same tie level) as
    the answer of ``problem`` priced at multiplier 0 (solver.budgeted.budget_free_record),
    or None where its plan is not one of ``problem``'s at the same seconds (another
    configuration's, or strategies the budgeted problem leaves out). The budget-free
    problem has the budgeted one's seconds, edges and tie classes."""
    sol = free.solution
    choices = solver_choices(built, free.choice) if free.zero == built.zero else None
    if choices is None:
        return None
    if not math.isclose(plan_objective_s(problem, choices), sol.objective_s, rel_tol=1e-12):
        return None
    answer = (choices, sol.objective_s, sol.bound_s, sol.num_variables, sol.num_constraints)
    return budget_free_record(problem, answer)


def solver_choices(built: BuiltProblem, choice: Sequence[int]) -> tuple[int, ...] | None:
    """``choice`` (a strategy index per space node) as ``built``'s solver choices, or None
    where it takes a strategy the problem does not offer. Each node mostly offers every
    strategy, in order, so a strategy is found at its own index first (a dict per node of the
    6,346 took 0.8 s of llama3-70b b256 fp32's seeds)."""
    out = []
    for allowed, s in zip(built.allowed, choice, strict=True):
        if s < len(allowed) and allowed[s] == s:
            out.append(s)
        elif s in allowed:
            out.append(allowed.index(s))
        else:
            return None
    return tuple(out)
