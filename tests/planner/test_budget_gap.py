"""Budget-bound planning with a gap (issue 16): the Lagrangian path and the bounded ZeRO
configurations against the proven optimum (gap 0, whose plan tests/planner/stored_plans pins)."""

from __future__ import annotations

import pytest

from autopar.api import plan_captured
from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from tests.models import tiny_gpt


@pytest.mark.slow
def test_default_gap_plan_is_within_it_of_the_proven_optimum_and_says_so() -> None:
    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    mesh = Mesh.parse("2", device="h100")
    budget = 2_500_000  # binds: stage 0 does not fit (the tiny-gpt-2-zero stored case)
    exact = plan_captured(
        captured, mesh, PlanOptions(memory_budget=budget, gap=0.0), model_name="tiny"
    ).data
    fast_plan = plan_captured(captured, mesh, PlanOptions(memory_budget=budget), model_name="tiny")
    fast = fast_plan.data
    assert PlanOptions().gap == 0.01
    optimum = exact["solver"]["objective_s"]
    assert exact["solver"]["gap"] == 0.0
    sol = fast["solver"]
    assert fast["predicted"]["peak_memory_bytes"] <= budget
    assert sol["bound_s"] <= optimum * (1 + 1e-9)
    assert optimum <= sol["objective_s"] <= optimum * 1.01
    assert sol["gap"] == pytest.approx((sol["objective_s"] - sol["bound_s"]) / sol["objective_s"])
    assert sol["gap"] <= 0.01
    # Every ZeRO configuration was solved, skipped on its bound, or did not fit.
    statuses = {c["status"] for c in sol["candidates"]}
    assert statuses <= {"optimal", "feasible", "skipped", "infeasible"}
    # A configuration is skipped only within the gap of the plan, and the plan's bound is
    # below every configuration's (skipped ones included).
    for entry in sol["candidates"]:
        if entry["status"] == "skipped":
            assert entry["bound_s"] >= sol["objective_s"] * (1 - 0.01)
            assert sol["bound_s"] <= entry["bound_s"]
    if sol["gap"] > 0:
        assert "bound" in fast_plan.summary()


def test_a_configuration_cut_off_by_a_better_plan_is_not_solved_again(monkeypatch) -> None:
    # Driver.auto hands each budgeted ZeRO configuration the best step found so far: once the
    # relaxation's bound proves the configuration cannot beat it by the gap, its plan so far
    # comes back ('cutoff'), and ConfigurationSolver._finish must not take its re-solve path
    # (a 'feasible' solve above the gap otherwise is re-solved without segments).
    import solver
    from autopar.planner.driver import Driver
    from autopar.planner.space import build_space
    from autopar.planner.zero_choice import zero_candidates

    model, args, kwargs = tiny_gpt()
    mesh = Mesh.parse("2", device="h100")
    options = PlanOptions(memory_budget=2_500_000)
    driver = Driver(build_space(capture(model, args, kwargs), mesh, options))
    calls, warm_starts = [], []
    real_solve = solver.solve

    def counting_solve(problem, **kwargs):
        calls.append(kwargs.get("cutoff_s"))
        warm_starts.append(kwargs.get("warm_multipliers"))
        return real_solve(problem, **kwargs)

    monkeypatch.setattr(solver, "solve", counting_solve)
    for zero in zero_candidates(mesh.ndim, mesh.shape):  # one the relaxation plans
        uncut = driver.configurations.solve(zero, name="auto", budget=driver.budget)
        if "lagrangian_bound_s" in uncut.solution.details:
            break
    else:
        raise AssertionError("no ZeRO configuration went through the relaxation")
    calls.clear()
    cut = driver.configurations.solve(zero, name="auto", budget=driver.budget, cutoff_s=1e-12)
    assert calls == [1e-12]  # one solve: the relaxation stopped at once, nothing re-solved
    assert cut.solution.cut_off
    assert cut.evaluation.peak_memory_bytes <= driver.budget
    # Its bound is still a bound: not above the configuration's plan solved without a cutoff.
    assert cut.solution.bound_s <= uncut.solution.objective_s * (1 + 1e-9)
    assert cut.solution.objective_s >= uncut.solution.bound_s * (1 - 1e-9)
    # Driver.auto starts each configuration's relaxation where the best plan's ended
    # (warm_from): the multipliers reach solver.solve, and the bound is still a bound.
    assert uncut.warm_multipliers is not None and min(uncut.warm_multipliers) >= 0.0
    warm_starts.clear()
    warm = driver.configurations.solve(zero, name="auto", budget=driver.budget, warm_from=uncut)
    assert warm_starts[0] == uncut.warm_multipliers
    assert warm.evaluation.peak_memory_bytes <= driver.budget
    assert warm.solution.bound_s <= uncut.solution.objective_s * (1 + 1e-9)
    assert warm.solution.objective_s >= uncut.solution.bound_s * (1 - 1e-9)
