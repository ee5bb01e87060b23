"""solver/background.py: a priced bound evaluated in a worker process is the one evaluated
here, the same floats (bound, feasibility step, bound per multiplier), and a worker that
fails gives no answer rather than a wrong one."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import InfeasibleError, Problem
from solver.background import start_priced_bound
from solver.budgeted import Recorded, priced_bound
from tests.unit.test_lagrangian import budgeted_problems


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    budgeted_problems(),
    st.floats(0.0, 2.0),
    st.floats(0.0, 2.0),
    st.one_of(st.none(), st.floats(0.0, 50.0)),
)
def test_a_bound_in_a_worker_is_the_bound_here(
    problem: Problem, lam: float, separable: float, target: float | None
) -> None:
    recorded = Recorded(edges=problem.edges)
    options = {"separable_multiplier": separable, "target": target}
    try:
        here = priced_bound(problem, lam, **options, record=recorded)
    except InfeasibleError:
        return
    answer = start_priced_bound(problem, lam, **options).result()
    assert answer is not None
    bound, fits, bounds = answer
    assert (bound, fits) == here
    assert bounds == recorded.bounds and list(bounds) == list(recorded.bounds)


def test_a_failing_worker_gives_no_answer() -> None:
    problem = Problem(nodes=())  # no budget: priced_bound raises in the worker
    assert start_priced_bound(problem, 1.0).result() is None
