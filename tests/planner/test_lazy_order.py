"""The budgeted ZeRO search's lazy order of work (issue 16, session 26: one primal search per
seed, problems and fits kept): every ZeRO configuration is either solved or skipped on a bound
that justifies it, a bound that is no more than that configuration's exact optimum and at
least the skip line of the plan returned, and the plan is within the gap of every
configuration's exact optimum."""

from __future__ import annotations

import pytest

from autopar.planner.problem import ZeroConfig
from solver.problem import gap_floor
from tests.planner.test_primal_across import GAP, _zeros, tiny_gpt_driver
from tests.planner.test_seed_work_limit import SEED_BUDGET


def _exact(budget: int) -> dict[tuple[int, ...], float]:
    """Each configuration's optimum under ``budget`` at gap 0 (its own driver)."""
    from autopar.options import PlanOptions
    from autopar.planner.driver import Driver

    driver = tiny_gpt_driver(budget)
    exact = Driver(driver.space, options=PlanOptions(memory_budget=budget, gap=0.0))
    out = {}
    for zero in _zeros(exact):
        solved = exact.configurations.solve(zero, name="auto", budget=exact.budget)
        assert solved.solution.status == "optimal"
        out[zero.stages] = solved.solution.objective_s
    return out


@pytest.mark.parametrize("budget", [SEED_BUDGET, 2_500_000])
def test_no_configuration_is_dropped_without_a_bound_that_justifies_it(budget) -> None:
    from autopar.planner.zero_search import search_budgeted

    driver = tiny_gpt_driver(budget)
    configurations = driver.configurations
    zeros = _zeros(driver)
    stage0 = configurations.solve(ZeroConfig(), name="auto", budget=None)
    lines: list[str] = []
    found = search_budgeted(
        configurations,
        zeros,
        budget=driver.budget,
        gap=GAP,
        report=lines.append,
        floor=stage0.solution.bound_s,
    )
    assert found.best is not None
    exact = _exact(budget)
    # Every configuration is accounted for: solved (or the same problem as one solved) or
    # skipped, none left out of the log.
    assert sorted(tuple(e["zero_stages"]) for e in found.log) == sorted(z.stages for z in zeros)
    line = gap_floor(found.best.solution.objective_s, GAP)
    skipped = [e for e in found.log if e["status"] == "skipped"]
    for entry in skipped:
        # Justified: at or over the skip line of the plan returned (the line only falls as the
        # best plan improves), and a real bound: not above that configuration's optimum.
        assert entry["bound_s"] >= line
        assert entry["bound_s"] <= exact[tuple(entry["zero_stages"])] * (1 + 1e-9)
    # The plan is within the gap of the best exact optimum, and its bound is a bound.
    best_exact = min(exact.values())
    assert found.best.solution.objective_s >= best_exact * (1 - 1e-9)
    assert gap_floor(found.best.solution.objective_s, GAP) <= best_exact * (1 + 1e-9)
    assert min(found.bounds) <= best_exact * (1 + 1e-9)
