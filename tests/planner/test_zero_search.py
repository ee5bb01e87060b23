"""The auto plan's ZeRO configurations under a budget (autopar/planner/zero_search.py): equal
budgeted problems solved once, unequal ones not merged; a solver that stops without a plan is
a one-line error naming the configuration."""

from __future__ import annotations

import pytest

import solver
from autopar.capture.export import capture
from autopar.errors import PlanningError
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner.driver import Driver
from autopar.planner.problem import ZeroConfig
from autopar.planner.space import build_space
from autopar.planner.zero_search import search_budgeted
from tests.models import tiny_mlp

BUDGET = 250_000.0
"""Binds ZeRO-1 (its budget-free plan peaks at 305,664 bytes on 2x2 with SGD)."""


@pytest.fixture(scope="module")
def space():
    # With SGD there is no optimizer state: ZeRO-1 shards nothing, so its problem equals stage
    # 0's on that axis, (1,) and (1, 1) are the same problem, (2,) another.
    model, args, kwargs = tiny_mlp()
    mesh = Mesh.parse("2x2", device="h100")
    return build_space(capture(model, args, kwargs), mesh, PlanOptions(optimizer="sgd"))


def test_equal_budgeted_problems_are_solved_once_and_unequal_ones_are_not(
    space, monkeypatch
) -> None:
    zeros = [ZeroConfig(stages=(1,)), ZeroConfig(stages=(1, 1)), ZeroConfig(stages=(2,))]
    driver = Driver(space, options=PlanOptions(optimizer="sgd", gap=0.0))
    configurations = driver.configurations
    problems = [configurations.budgeted_problem(z, BUDGET) for z in zeros]
    assert problems[0] == problems[1] and problems[0] != problems[2]
    budgeted_calls = []
    real_solve = solver.solve

    def counting_solve(problem, **kwargs):
        if problem.memory_budget_bytes is not None:
            budgeted_calls.append(problem)
        return real_solve(problem, **kwargs)

    monkeypatch.setattr(solver, "solve", counting_solve)
    lines: list[str] = []
    found = search_budgeted(configurations, zeros, budget=BUDGET, gap=0.0, report=lines.append)
    names = space.mesh.axis_names
    assert [s["what"] for s in found.stats] == [
        "solved",
        f"same problem as {zeros[0].label(names)}",
        "solved",
    ]
    searched_calls = len(budgeted_calls)
    # Each configuration alone: the shared answer is (1, 1)'s own, priced under (1, 1); the
    # search made the solver calls of (1,) and (2,) only.
    alone, calls_alone = [], []
    for zero in zeros:
        before = len(budgeted_calls)
        alone.append(configurations.solve(zero, name="auto", budget=BUDGET))
        calls_alone.append(len(budgeted_calls) - before)
    assert min(calls_alone) >= 1
    assert searched_calls == calls_alone[0] + calls_alone[2]
    for entry, own in zip(found.log, alone, strict=True):
        assert entry["zero_stages"] == list(own.zero.stages)
        assert entry["step_s"] == pytest.approx(own.evaluation.step_s, rel=1e-12)
        assert entry["peak_memory_bytes"] == pytest.approx(own.evaluation.peak_memory_bytes)
    assert found.best is not None and found.best.evaluation.peak_memory_bytes <= BUDGET
    assert configurations._recorded == {}  # released after the search


def test_a_solver_that_stops_without_a_plan_is_a_one_line_error(space, monkeypatch) -> None:
    real_run = solver.highs_direct.run

    def run(model, **kwargs):  # HiGHS's own time limit at 0 s: it stops before any plan
        if model.budgeted:
            model.highs.setOptionValue("time_limit", 0.0)
            model.highs.setOptionValue("presolve", "off")
            kwargs["time_limit_s"] = None  # the fixed MIP's own limit would replace the 0 s
        return real_run(model, **kwargs)

    monkeypatch.setattr(solver.highs_direct, "run", run)
    driver = Driver(space, options=PlanOptions(optimizer="sgd", gap=0.0))
    with pytest.raises(PlanningError) as caught:
        driver.configurations.solve(ZeroConfig(stages=(1,)), name="auto", budget=BUDGET)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("auto, ZeRO ") and "stopped without a plan" in message
    assert "--gap" in message and "--time-limit" in message and "memory" in message
    # With a gap the relaxation runs first: its plan comes back, with its bound and a warning.
    driver = Driver(space, options=PlanOptions(optimizer="sgd", gap=1e-6))
    solved = driver.configurations.solve(ZeroConfig(stages=(1,)), name="auto", budget=BUDGET)
    sol = solved.solution
    assert "mip_stopped" in sol.details and sol.status == "feasible"
    assert sol.bound_s == sol.details["lagrangian_bound_s"] < sol.objective_s
    assert solved.evaluation.peak_memory_bytes <= BUDGET
    (note,) = driver.configurations.notes
    assert note.startswith("auto, ZeRO ") and "stopped without a plan (time limit reached)" in note
    assert f"{sol.gap:.2%}" in note


def test_a_budgeted_relaxation_takes_its_priced_solve_at_zero_from_the_budget_free_one(
    space,
) -> None:
    # ZeRO-2 on the first axis: its budget-free plan (239,488 bytes) is over 200,000 bytes.
    driver = Driver(space, options=PlanOptions(optimizer="sgd", gap=0.01))
    configurations = driver.configurations
    zero, budget = ZeroConfig(stages=(2,)), 200_000.0
    free = configurations.solve(zero, name="auto", budget=None)
    assert free.evaluation.peak_memory_bytes > budget
    cold = configurations.solve(zero, name="auto", budget=budget)
    warm = configurations.solve(zero, name="auto", budget=budget, free=free)
    assert warm.solution.details["lagrangian_reused_solves"] == 1.0
    assert "lagrangian_reused_solves" not in cold.solution.details
    assert warm.choice == cold.choice and warm.segments == cold.segments
    assert warm.solution.objective_s == cold.solution.objective_s
    assert warm.solution.bound_s == cold.solution.bound_s
    # Another configuration's budget-free plan is not taken for this one's.
    other = configurations.solve(ZeroConfig(stages=(1,)), name="auto", budget=None)
    not_taken = configurations.solve(zero, name="auto", budget=budget, free=other)
    assert "lagrangian_reused_solves" not in not_taken.solution.details


def test_configurations_are_solved_budget_free_only_when_the_floor_does_not_skip_them(
    space,
) -> None:
    # Stage 2 on every axis (the first candidate) prices time as stage 0 does: its plan here
    # fits and costs stage 0's budget-free optimum, a bound on every configuration, so the
    # others are skipped on it with no budget-free solve of their own.
    from autopar.planner.zero_choice import zero_candidates

    options = PlanOptions(optimizer="sgd", gap=0.01)
    zeros = zero_candidates(space.mesh.ndim, space.mesh.shape)
    assert zeros[0].stages == (2, 2) and len(zeros) == 4
    names = space.mesh.axis_names
    found = {}
    for floor in (None, -1.0):
        driver = Driver(space, options=options)
        configurations = driver.configurations
        stage0 = configurations.solve(ZeroConfig(), name="auto", budget=None)
        free_solves = []
        real = configurations.solve

        def counting(zero, free_solves=free_solves, real=real, **kwargs):
            if kwargs.get("budget") is None:
                free_solves.append(zero)
            return real(zero, **kwargs)

        configurations.solve = counting
        floor_s = stage0.solution.bound_s if floor is None else floor
        found[floor] = search_budgeted(
            configurations, zeros, budget=BUDGET, gap=0.01, report=lambda line: None, floor=floor_s
        )
        if floor is None:
            assert free_solves == zeros[:1]
            assert [s["what"] for s in found[floor].stats] == ["budget-free fits"] + ["skipped"] * 3
            assert found[floor].bounds[1:] == [floor_s] * 3
            assert all(e["bound_s"] == floor_s for e in found[floor].log[1:])
        else:  # a floor that skips nothing: every configuration solved budget-free, as before
            assert free_solves == zeros
    with_floor, without = found[None], found[-1.0]
    assert with_floor.best.choice == without.best.choice
    assert with_floor.best.zero.label(names) == without.best.zero.label(names)
    assert min(with_floor.bounds) <= with_floor.best.evaluation.step_s
