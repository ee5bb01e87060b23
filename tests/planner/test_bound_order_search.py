"""zero_search takes the configurations in the order autopar/planner/bound_order.py's
derive_first gives them, after the second seed (tiny GPT on 2 ranks at a budget that binds)."""

from __future__ import annotations

import math

from tests.planner.test_primal_across import GAP, _zeros, tiny_gpt_driver


def test_the_search_bounds_configurations_in_derive_firsts_order(monkeypatch) -> None:
    from autopar.planner import zero_search

    driver = tiny_gpt_driver()
    calls = []
    real = zero_search.derive_first

    def reversed_order(configurations, pairs, budget, multiplier, report=lambda line: None, **kw):
        calls.append((list(pairs), multiplier))
        assert real(configurations, pairs, budget, multiplier) is not None
        return list(reversed(pairs))

    monkeypatch.setattr(zero_search, "derive_first", reversed_order)
    zeros = _zeros(driver)
    found = zero_search.search_budgeted(
        driver.configurations,
        zeros,
        budget=driver.budget,
        gap=GAP,
        report=lambda line: None,
        floor=-math.inf,
    )
    assert len(calls) == 1 and [z for z, _ in calls[0][0]] == zeros and calls[0][1] > 0.0
    assert [tuple(e["zero_stages"]) for e in found.log] == [z.stages for z in reversed(zeros)]
    assert found.best is not None and found.best.evaluation.peak_memory_bytes <= driver.budget
