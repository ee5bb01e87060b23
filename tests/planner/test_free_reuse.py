"""autopar/planner/free_reuse.py and the evaluation's parameter states (issue 16, the
llama3-70b rows): stage 2 on every axis takes stage 0's budget-free answer, priced under its own
ZeRO bytes, only where its budget-free problem is the same but for bytes; the budgeted search
then makes no budget-free solve of it and chooses the plan it chose before. Each test builds
its own driver (no solve, problem or evaluation cache kept from another test)."""

from __future__ import annotations

import pytest

from tests.planner.test_primal_across import GAP, _zeros, tiny_gpt_driver


@pytest.fixture()
def driver():
    return tiny_gpt_driver()


def _stage0(driver):
    from autopar.planner.problem import ZeroConfig

    return driver.configurations.solve(ZeroConfig(), name="auto", budget=None)


def test_stage_two_takes_stage_zeros_answer_priced_under_its_own_bytes(driver) -> None:
    from autopar.planner.free_reuse import reused_free
    from autopar.planner.problem import evaluate

    zero2 = _zeros(driver)[0]
    assert set(zero2.stages) == {2}  # the search's first configuration
    free0 = _stage0(driver)
    reused = reused_free(driver.configurations, zero2, free0)
    assert reused is not None and reused.zero == zero2 and reused.choice == free0.choice
    own = driver.configurations.solve(zero2, name="auto", budget=None)
    # The same optimum and bound as its own solve (bytes are in no constraint).
    assert reused.solution.objective_s == pytest.approx(own.solution.objective_s, rel=1e-12)
    assert reused.solution.bound_s == pytest.approx(own.solution.bound_s, rel=1e-12)
    assert reused.evaluation.step_s == pytest.approx(own.evaluation.step_s, rel=1e-12)
    # Priced under stage 2's bytes, not stage 0's.
    expected = evaluate(driver.space, reused.choice, zero2)
    assert reused.evaluation.peak_memory_bytes == expected.peak_memory_bytes
    assert reused.evaluation.peak_memory_bytes < free0.evaluation.peak_memory_bytes
    assert reused.solution.peak_memory_bytes == pytest.approx(expected.peak_memory_bytes, rel=1e-9)


def test_a_configuration_priced_otherwise_is_not_taken(driver) -> None:
    from autopar.planner.free_reuse import reused_free

    zeros = _zeros(driver)
    free0 = _stage0(driver)
    stage3 = [z for z in zeros if 3 in z.stages]
    assert stage3
    # ZeRO-3 adds parameter gathers: other seconds, so no answer is taken.
    assert all(reused_free(driver.configurations, z, free0) is None for z in stage3)


def test_the_search_makes_no_budget_free_solve_of_the_first_and_chooses_as_before(
    driver, monkeypatch
) -> None:
    from autopar.planner import primal, zero_search
    from autopar.planner.configurations import ConfigurationSolver

    monkeypatch.setattr(primal, "SEARCH_MIPS", 1000)  # the seed's round 2 never cut short
    configurations, zeros = driver.configurations, _zeros(driver)
    free0 = _stage0(driver)
    solved_free: list = []
    solve = ConfigurationSolver.solve

    def counting(self, zero, *, budget, **kwargs):
        if budget is None:
            solved_free.append(zero)
        return solve(self, zero, budget=budget, **kwargs)

    monkeypatch.setattr(ConfigurationSolver, "solve", counting)
    common = dict(budget=driver.budget, gap=GAP, report=lambda line: None)
    floor = free0.solution.bound_s
    taken = zero_search.search_budgeted(configurations, zeros, floor=floor, like=free0, **common)
    assert zeros[0] not in solved_free
    solved_free.clear()
    plain = zero_search.search_budgeted(configurations, zeros, floor=floor, **common)
    assert zeros[0] in solved_free
    assert taken.best.evaluation.step_s == pytest.approx(plain.best.evaluation.step_s, rel=1e-9)
    assert taken.best.zero == plain.best.zero
    assert min(taken.bounds) == pytest.approx(min(plain.bounds), rel=1e-12)


def test_the_evaluation_prices_each_parameter_as_param_state_does(driver) -> None:
    from autopar.planner.problem import evaluate, param_state

    space = driver.space
    free0 = _stage0(driver)
    for zero in _zeros(driver):
        ev = evaluate(space, free0.choice, zero)
        states = [
            param_state(space, node, free0.choice[i], zero)
            for i, node in enumerate(space.nodes)
            if node.kind == "param"
        ]
        assert len({s[2]["params"] for s in states}) > 2  # parameters of several sizes
        for key in ("params", "grads", "optimizer", "master"):
            assert ev.memory[key] == pytest.approx(sum(s[2][key] for s in states), rel=1e-12)
        assert ev.zero_comm_s == pytest.approx(sum(s[1] for s in states), rel=1e-12, abs=1e-15)
