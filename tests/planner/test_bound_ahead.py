"""autopar/planner/bound_ahead.py: a configuration's priced bound evaluated in a worker beside
the next configuration's, which is held until its turn, gives every configuration the bound,
feasibility step, references and recorded priced solves that bounding them one after another
gives (tiny GPT on 2 ranks at a budget that binds, every problem large enough)."""

from __future__ import annotations

import math

from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner.bound_ahead import Ahead
from tests.models import tiny_gpt
from tests.planner.test_primal_across import GAP, _zeros

MULTIPLIERS = (8.121e-11, 9.5e-11)
BUDGET = 2_000_000  # no budget-free plan fits: each configuration needs its own bound


def tiny_gpt_driver():
    """A fresh driver of the tiny GPT on 2 ranks at BUDGET and GAP."""
    from autopar.planner.driver import Driver
    from autopar.planner.space import build_space

    model, args, kwargs = tiny_gpt()
    options = PlanOptions(memory_budget=BUDGET, gap=GAP)
    return Driver(
        build_space(capture(model, args, kwargs), Mesh.parse("2", device="h100"), options)
    )


def _refs(configurations) -> list[tuple[float, float]]:
    return [(ref.multiplier, ref.bound_s) for ref in configurations.references]


def _one_after_another(target: float) -> tuple[list, list, list]:
    """Both configurations bounded in order: their answers, the references after each, and
    the answers their relaxations would reuse."""
    driver = tiny_gpt_driver()
    configurations, zeros = driver.configurations, _zeros(driver)
    found, refs, answers = [], [], []
    for zero in zeros[:2]:
        found.append(configurations.priced_bound(zero, driver.budget, MULTIPLIERS, target=target))
        refs.append(_refs(configurations))
        answers.append(dict(configurations._recorded[(zero, driver.budget)][1].answers))
    return found, refs, answers


def _ahead(driver, zeros) -> Ahead:
    ahead = Ahead(min_entries=0)
    frees = [driver.configurations.solve(z, name="auto", budget=None) for z in zeros]
    assert all(free.evaluation.peak_memory_bytes > driver.budget for free in frees)
    ahead.upcoming = list(zip(zeros, frees, strict=True))[1:]
    return ahead


def test_the_bound_held_for_the_next_configuration_is_the_one_made_in_turn() -> None:
    target = 1.0  # above every bound: nothing is cut short
    expected, refs, answers = _one_after_another(target)
    driver = tiny_gpt_driver()
    configurations, zeros = driver.configurations, _zeros(driver)
    ahead = _ahead(driver, zeros[:2])
    first = ahead.priced_bound(configurations, zeros[0], driver.budget, MULTIPLIERS, target=target)
    assert (ahead.started, ahead.taken) == (1, 0)
    # The first's answer came from the worker; nothing of the second is known yet.
    assert first == expected[0] and _refs(configurations) == refs[0]
    ahead.upcoming = []
    configurations.release()
    second = ahead.priced_bound(configurations, zeros[1], driver.budget, MULTIPLIERS, target=target)
    assert (ahead.started, ahead.taken) == (1, 1)
    assert second == expected[1] and _refs(configurations) == refs[1]
    recorded = configurations._recorded[(zeros[1], driver.budget)][1]
    assert recorded.answers and len(recorded.answers) == len(answers[1])


def test_a_bound_held_at_other_multipliers_or_target_is_not_taken() -> None:
    target = 1.0
    expected, _, _ = _one_after_another(math.nextafter(target, 2.0))
    driver = tiny_gpt_driver()
    configurations, zeros = driver.configurations, _zeros(driver)
    ahead = _ahead(driver, zeros[:2])
    ahead.priced_bound(configurations, zeros[0], driver.budget, MULTIPLIERS, target=target)
    assert ahead.started == 1
    ahead.upcoming = []
    second = ahead.priced_bound(
        configurations, zeros[1], driver.budget, MULTIPLIERS, target=math.nextafter(target, 2.0)
    )
    assert ahead.taken == 0 and second == expected[1]


def test_no_bound_is_evaluated_beside_one_that_derives_it_or_one_skipped() -> None:
    driver = tiny_gpt_driver()
    configurations, zeros = driver.configurations, _zeros(driver)
    ahead = _ahead(driver, zeros[:2])
    ahead.followers = {zeros[0]: {zeros[1]}}
    ahead.priced_bound(configurations, zeros[0], driver.budget, MULTIPLIERS, target=1.0)
    ahead.followers = {}
    low = ahead.upcoming[0][1].solution.bound_s  # the second's budget-free bound skips it
    ahead.priced_bound(configurations, zeros[0], driver.budget, MULTIPLIERS, target=low)
    assert ahead.started == 0
