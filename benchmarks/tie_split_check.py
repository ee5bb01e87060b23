"""Does the budgeted Lagrangian path (solver.solve at a gap) return plans whose tie classes
choose differently? Hypothesis draws tests/unit/test_lagrangian.py's budgeted problems with a tie
class; prints how many plans split one, beat the tied brute-force optimum or report a bound
above it, and the first five (split, objective, tied optimum, the relaxation's bound, the bound
reported). With segments the classes must choose alike (solver/alike.py): 34 at 6c1806a, 0 after.

    PYTHONPATH=. python benchmarks/tie_split_check.py
"""

from hypothesis import HealthCheck, given, settings

from solver import solve
from tests.unit.test_lagrangian import _optimum, budgeted_problems

found = []


@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(budgeted_problems())
def t(problem):
    if not problem.tied:
        return
    try:
        s = solve(problem, gap=0.01)
    except Exception:
        return
    split = any(len({s.choices[i] for i in m}) > 1 for m in problem.tied)
    opt = _optimum(problem)
    below = opt is not None and s.objective_s < opt - 1e-9
    above = opt is not None and s.bound_s > opt + 1e-9
    if split or below or above:
        found.append((split, s.objective_s, opt, s.details.get("lagrangian_bound_s"), s.bound_s))


t()
print(len(found), found[:5])
