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
    left, pending = skip_ahead(
        driver.configurations,
        zeros,
        driver.budget,
        GAP,
        given,
        lambda zero, bound: skipped.__setitem__(zero.stages, bound),
        lines.append,
    )
    assert pending is None  # nothing aside unless asked
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
    assert left == (list(zeros), None)


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


def _skips(driver, zeros, given, monkeypatch, aside: bool, answer: bool = True):
    """skip_ahead then (aside) finish on ``given``: the configurations left, the bounds
    skipped on, the progress lines and the workers started."""
    from autopar.planner import skip_ahead as module
    from solver.background import start_priced_bound

    started: list[int] = []

    def start(*args, **kwargs):
        started.append(1)
        job = start_priced_bound(*args, **kwargs)
        return job if answer else type("NoAnswer", (), {"result": lambda self: None})()

    monkeypatch.setattr(module, "ASIDE_ENTRIES", 0)  # the tiny problems go aside too
    monkeypatch.setattr(module, "usable_cores", lambda: 2)
    monkeypatch.setattr(module, "start_priced_bound", start)
    skipped: dict[tuple[int, ...], float] = {}
    lines: list[str] = []
    record = lambda zero, bound: skipped.__setitem__(zero.stages, bound)  # noqa: E731
    left, pending = module.skip_ahead(
        driver.configurations, zeros, driver.budget, GAP, given, record, lines.append, aside
    )
    assert (pending is not None) == aside and not skipped or not aside
    if pending is not None:
        assert set(pending.waiting).isdisjoint(left)
        left += module.finish(
            driver.configurations, pending, driver.budget, GAP, given, record, lines.append
        )
    return sorted(z.stages for z in left), skipped, lines, started


@pytest.mark.parametrize("answer", [True, False])
def test_the_lead_bounded_aside_skips_what_it_skips_here(monkeypatch, answer) -> None:
    """The lead's bound in a worker while the caller goes on (Pending, finish) skips the same
    configurations on the same bounds as evaluated here; a worker with no answer is
    evaluated here after all (its lines say where it ran)."""
    from autopar.planner.skip_ahead import aside_allowed

    driver = tiny_gpt_driver(SEED_BUDGET)
    zeros, best = _seeded(driver)
    step = best.solution.objective_s * 0.7  # the line under the bounds: something is skipped
    given = dataclasses.replace(best, solution=dataclasses.replace(best.solution, objective_s=step))
    here = _skips(driver, zeros, given, monkeypatch, aside=False)
    aside = _skips(tiny_gpt_driver(SEED_BUDGET), zeros, given, monkeypatch, True, answer)
    assert here[1], here[2]  # exercised: the lead skips something
    assert aside[:2] == here[:2]
    assert aside[3] == [1] and here[3] == []
    worker = [line for line in aside[2] if "in a worker beside the search" in line]
    assert len(worker) == 1, aside[2]
    monkeypatch.setenv("AUTOPAR_PLAN_JOBS", "1")  # one process asked for: nothing aside
    assert not aside_allowed()
