"""skip_ahead.skip_ahead (issue 16, session 27): configurations skipped before their
budget-free solves, on the priced bound of the configuration that derives the most others'
and on the bounds derived from it. A configuration is skipped only on a bound at or over the
skip line of the plan given, and every such bound is a real one: no more than that
configuration's optimum (solved exactly at gap 0). The tiny GPT on 2 ranks, where stage 3
derives stage 2's bound; the plan given is the primal seed's, its step lowered so that the
line falls under the bounds (the seed's multipliers price them 25% under the plan here). The
search itself reaches this code on llama3-70b b256 fp32, where the searched plan skips six
configurations ahead (README, session 27)."""

from __future__ import annotations

import dataclasses

import pytest

from solver.problem import gap_floor
from tests.planner.test_lazy_order import _exact
from tests.planner.test_primal_across import GAP, _zeros, tiny_gpt_driver
from tests.planner.test_seed_work_limit import SEED_BUDGET


@pytest.fixture(scope="module")
def exact() -> dict[tuple[int, ...], float]:
    """Each configuration's optimum under the budget (gap 0)."""
    return _exact(SEED_BUDGET)


def _seeded(driver):
    from autopar.planner.primal import seed
    from autopar.planner.zero_search import bounded

    zeros = _zeros(driver)
    everything = bounded(driver.configurations, zeros, driver.budget)
    best = seed(driver.configurations, everything, budget=driver.budget, gap=GAP)
    assert best is not None and best.warm_multipliers is not None
    return zeros, best


@pytest.mark.parametrize("lowered", [1.0, 0.7])
def test_a_configuration_is_skipped_ahead_only_on_a_real_bound_over_the_line(
    exact, lowered
) -> None:
    from autopar.planner.skip_ahead import skip_ahead

    driver = tiny_gpt_driver(SEED_BUDGET)
    zeros, best = _seeded(driver)
    step = best.solution.objective_s * lowered
    given = dataclasses.replace(best, solution=dataclasses.replace(best.solution, objective_s=step))
    line = gap_floor(step, GAP)
    skipped: dict[tuple[int, ...], float] = {}
    lines: list[str] = []
    left = skip_ahead(
        driver.configurations,
        zeros,
        driver.budget,
        GAP,
        given,
        lambda zero, bound: skipped.__setitem__(zero.stages, bound),
        lines.append,
    )
    assert sorted([*(z.stages for z in left), *skipped]) == sorted(z.stages for z in zeros)
    assert any(line.startswith("skip ahead:") for line in lines), lines
    for stages, bound in skipped.items():
        assert bound >= line, (stages, bound, line)
        assert bound <= exact[stages] * (1 + 1e-9), (stages, bound, exact[stages])
    if lowered < 1.0:
        # The line under the bounds: the skip is exercised (else the checks above prove nothing).
        assert skipped, lines


def test_nothing_is_skipped_ahead_at_gap_zero() -> None:
    from autopar.planner.skip_ahead import skip_ahead

    driver = tiny_gpt_driver(SEED_BUDGET)
    zeros, best = _seeded(driver)
    left = skip_ahead(
        driver.configurations, zeros, driver.budget, 0.0, best, lambda *a: None, lambda line: None
    )
    assert left == list(zeros)


def test_the_seed_does_not_search_again_from_the_plan_a_search_ended_at() -> None:
    """zero_search._ordered's second seed after the lead's search (primal.seed ``done``)."""
    from autopar.planner.primal import seed
    from autopar.planner.zero_search import bounded

    driver = tiny_gpt_driver(SEED_BUDGET)
    configurations = driver.configurations
    everything = bounded(configurations, _zeros(driver), driver.budget)
    first = seed(configurations, everything, budget=driver.budget, gap=GAP)
    assert first is not None
    runs: dict[bool, list[str]] = {}
    for skip in (False, True):
        runs[skip] = []
        seed(
            configurations,
            everything,
            budget=driver.budget,
            gap=GAP,
            report=runs[skip].append,
            start_from=first,
            done={(first.zero, first.choice)} if skip else (),
        )
    searches = {k: [line for line in v if line.startswith("primal ZeRO")] for k, v in runs.items()}
    assert searches[False], runs[False]  # without it, the same search runs again
    assert not searches[True], runs[True]
