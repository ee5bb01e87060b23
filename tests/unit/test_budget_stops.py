"""The budgeted path when HiGHS stops without a plan (memory, time, iterations: issue 16), and
the bound a ZeRO configuration is skipped on (solver.budgeted.priced_bound), against brute
force."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from solver import Edge, Node, Problem, SolverStoppedError, highs_direct, solve
from solver.budgeted import priced_bound
from solver.errors import STOP_REASONS, stop_code, stop_reason
from tests.unit.test_lagrangian import SETTINGS, _optimum, budgeted_problems


def _knapsack_chain(num_nodes: int = 60, seed: int = 3) -> Problem:
    """A chain of 3-strategy nodes (time vs bytes) whose budget binds: the relaxation's plan is
    not within a 1e-6 gap of its bound, so the MIP after reduced-cost fixing runs."""
    rng = random.Random(seed)

    def draw(lo: float, hi: float) -> float:
        return round(rng.uniform(lo, hi), 2)

    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(draw(1, 10) for _ in range(3)),
            memory_bytes=tuple(draw(1, 100) for _ in range(3)),
        )
        for i in range(num_nodes)
    )
    edges = tuple(
        Edge(src=i, dst=i + 1, cost_s=tuple(tuple(draw(0, 1) for _ in range(3)) for _ in range(3)))
        for i in range(num_nodes - 1)
    )
    low = sum(min(n.memory_bytes) for n in nodes)
    high = sum(max(n.memory_bytes) for n in nodes)
    return Problem(nodes=nodes, edges=edges, memory_budget_bytes=low + 0.3 * (high - low))


def _stop_highs_at_once(monkeypatch) -> None:
    """Every budgeted HiGHS MIP stops before its first plan: HiGHS's own time limit at 0 s and
    no presolve (the real solver stops, with its status; a memory limit ends the same way)."""
    real_run = highs_direct.run

    def run(model, **kwargs):
        if model.budgeted and not kwargs.get("relaxation"):
            model.highs.setOptionValue("time_limit", 0.0)
            model.highs.setOptionValue("presolve", "off")
            kwargs["time_limit_s"] = None  # the fixed MIP's own limit would replace the 0 s
        return real_run(model, **kwargs)

    monkeypatch.setattr(highs_direct, "run", run)


def test_a_stopped_mip_keeps_the_relaxations_plan_with_its_bound(monkeypatch) -> None:
    problem = _knapsack_chain()
    exact = solve(problem, gap=0.0)  # the proven optimum, before HiGHS is made to stop
    unstopped = solve(problem, gap=1e-6)
    assert unstopped.details.get("lagrangian_then_mip") == 1.0  # the MIP runs on this problem
    _stop_highs_at_once(monkeypatch)
    solution = solve(problem, gap=1e-6)
    details = solution.details
    assert stop_reason(details["mip_stopped"]) == "time limit reached"
    # The relaxation's plan and bound, reported as they are: feasible, the honest gap.
    assert solution.status == "feasible"
    assert solution.peak_memory_bytes <= problem.memory_budget_bytes
    assert solution.bound_s == details["lagrangian_bound_s"]
    assert solution.bound_s <= exact.objective_s <= solution.objective_s
    gap = (solution.objective_s - solution.bound_s) / solution.objective_s
    assert solution.gap == pytest.approx(gap) and gap > 1e-6


def test_no_plan_at_all_is_a_one_line_error_with_what_to_do(monkeypatch) -> None:
    _stop_highs_at_once(monkeypatch)
    with pytest.raises(SolverStoppedError) as caught:
        solve(_knapsack_chain(), gap=0.0)  # the exact MIP: no relaxation to fall back on
    message = str(caught.value)
    assert "\n" not in message and "stopped without a plan" in message
    assert "--gap" in message and "--time-limit" in message and "memory" in message
    assert caught.value.reason == "Time limit reached"


def test_stop_reasons_round_trip_their_codes() -> None:
    for k, reason in enumerate(STOP_REASONS):
        assert stop_code(reason) == k and stop_reason(k) == reason.lower()
    assert stop_reason(stop_code("Memory limit reached")) == "memory limit reached"
    assert stop_reason(stop_code("Unknown")) == "stopped early"


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0))
def test_the_bound_a_configuration_is_skipped_on_is_below_its_optimum(problem, scale) -> None:
    # priced_bound at ANY multiplier (another configuration's included) is at most the exact
    # optimum, and a plan it reports as fitting proves the problem feasible.
    optimum = _optimum(problem)
    try:
        bound, fits = priced_bound(problem, scale * 0.5)
    except Exception:  # forbidden pairs everywhere: nothing to bound
        return
    assert_bounds_optimum(optimum, bound, fits)


def assert_bounds_optimum(optimum: float | None, bound: float, fits: float | None) -> None:
    """``priced_bound``'s contract against the brute-force ``optimum`` (None: infeasible): the
    bound is below it, and a plan reported as fitting costs at least it (and proves it exists)."""
    if optimum is None:
        assert fits is None
        return
    assert bound <= optimum + 1e-9 * max(1.0, abs(optimum))
    if fits is not None:
        assert fits >= optimum - 1e-9 * max(1.0, abs(optimum))


def test_a_large_fixed_mip_runs_in_a_worker_with_the_same_answer(monkeypatch) -> None:
    """solver/budgeted.py runs a fixed MIP of ISOLATE_ENTRIES entries or more in a worker
    process (HiGHS out of memory may die, not stop); here every fixed MIP counts as large."""
    import solver.parallel as parallel

    problem = _knapsack_chain()
    here = solve(problem, gap=1e-6)
    assert here.details.get("lagrangian_then_mip") == 1.0  # the fixed MIP ran
    calls = []
    real = parallel.solve_isolated
    monkeypatch.setattr(parallel, "ISOLATE_ENTRIES", 0)
    monkeypatch.setattr(
        parallel, "solve_isolated", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    isolated = solve(problem, gap=1e-6)
    assert calls, "the fixed MIP did not run in a worker"
    assert isolated.choices == here.choices
    assert isolated.objective_s == here.objective_s and isolated.bound_s == here.bound_s
