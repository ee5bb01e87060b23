"""solver/primal.py: plans that fit the budget, found from plans at hand, against brute force
on tiny budgeted problems (tie classes, segments, forbidden pairs)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from solver import Edge, Node, Problem, solve
from solver.alike import splits
from solver.presolve import plan_objective_s, plan_peak_memory_bytes
from solver.primal import Fitted, best_fit, fit, kept_strategies, search
from tests.unit.test_count_patterns import layered_problems
from tests.unit.test_lagrangian import SETTINGS, _optimum, budgeted_problems

TOLERANCE = 1e-9


def _free_plan(problem: Problem) -> tuple[int, ...] | None:
    """The budget-free optimum's layouts (what the ZeRO search hands the heuristic)."""
    free = Problem(nodes=problem.nodes, edges=problem.edges, tied=problem.tied)
    try:
        return solve(free).choices
    except Exception:  # the edges forbid every plan
        return None


def _check(problem: Problem, found: Fitted, optimum: float | None) -> None:
    """A plan of the problem that fits, alike, priced exactly, never below the optimum."""
    assert optimum is not None  # a plan that fits exists
    assert not splits(problem, found.choices)
    assert found.objective_s == plan_objective_s(problem, found.choices, found.recomputed)
    peak = plan_peak_memory_bytes(problem, found.choices, found.recomputed)
    assert found.peak_memory_bytes == peak <= problem.memory_budget_bytes
    assert found.objective_s >= optimum - TOLERANCE * max(1.0, abs(optimum))


@settings(SETTINGS, max_examples=30)
@given(st.one_of(budgeted_problems(), layered_problems()), st.data())
def test_heuristic_plans_fit_and_are_never_below_the_brute_force_optimum(problem, data) -> None:
    optimum = _optimum(problem)
    plans = [
        tuple(data.draw(st.integers(0, n.num_choices - 1)) for n in problem.nodes)
        for _ in range(data.draw(st.integers(0, 3)))
    ]
    free = _free_plan(problem)
    plans += [free] if free is not None else []
    for plan in plans:
        found = fit(problem, plan)
        if found is not None:
            _check(problem, found, optimum)
    first = best_fit(problem, plans)
    best = search(problem, plans)
    assert (first is None) == (best is None)
    if best is not None:
        _check(problem, best, optimum)
        assert best.objective_s <= first.objective_s  # the neighbourhood starts from it
        assert all(best.choices[i] in k for i, k in enumerate(kept_strategies(problem, best)))


@settings(SETTINGS, max_examples=20)
@given(st.one_of(budgeted_problems(), layered_problems()))
def test_a_neighbourhood_holding_every_strategy_finds_the_optimum(problem) -> None:
    # With enough strategies kept per price, the neighbourhood is the whole problem: the
    # search then returns the (alike) optimum whenever some candidate fits.
    import solver.primal as primal

    optimum = _optimum(problem)
    free = _free_plan(problem)
    if free is None or fit(problem, free) is None:
        return
    exact = solve(problem, gap=0.0)
    old = primal.KEEP_PER_PRICE
    primal.KEEP_PER_PRICE = max(n.num_choices for n in problem.nodes)
    try:
        best = search(problem, [free])
    finally:
        primal.KEEP_PER_PRICE = old
    assert best is not None
    _check(problem, best, optimum)
    assert abs(best.objective_s - exact.objective_s) <= TOLERANCE * max(1.0, exact.objective_s)


def test_the_neighbourhood_trades_a_recompute_for_a_smaller_layout() -> None:
    # Two layers (a tie class) and a head. The budget-free plan (strategy 0: fast, big) fits
    # only by recomputing both layers (+2 x 3.0 s); strategy 1 (0.5 s slower per layer, half
    # the bytes) fits without recomputation: 1.0 s instead of 6.0 s.
    problem = _two_layers()
    first = fit(problem, (0, 0, 0))
    assert first is not None and first.recomputed == (1, 1)
    assert first.objective_s == 3.0 + 6.0
    best = search(problem, [(0, 0, 0)])
    assert best is not None and best.choices == (1, 1, 0) and best.recomputed == (0, 0)
    assert best.objective_s == 4.0 == _optimum(problem)


def _two_layers() -> Problem:
    """Two layers (a tie class, two strategies each) and a head, a segment per layer, a
    budget of 12 bytes."""
    from solver.problem import Segment

    layer = Node(name="l", cost_s=(1.0, 1.5), memory_bytes=(10.0, 5.0))
    nodes = (layer, layer, Node(name="h", cost_s=(1.0,), memory_bytes=(1.0,)))
    edges = (
        Edge(src=0, dst=1, cost_s=((0.0, 0.1), (0.1, 0.0))),
        Edge(src=1, dst=2, cost_s=((0.0,), (0.0,))),
    )
    segments = tuple(
        Segment(name=f"s{i}", nodes=(i,), freed_bytes=((9.0, 4.0),), recompute_s=((3.0, 3.0),))
        for i in range(2)
    )
    return Problem(
        nodes=nodes, edges=edges, memory_budget_bytes=12.0, tied=((0, 1),), segments=segments
    )


def _counting_mips(monkeypatch) -> list[int]:
    """A list that grows by one per neighbourhood MIP built (its restricted problem)."""
    import solver.fixing

    made: list[int] = []
    restrict = solver.fixing.restrict_budgeted

    def counting(*args, **kwargs):
        made.append(1)
        return restrict(*args, **kwargs)

    monkeypatch.setattr(solver.fixing, "restrict_budgeted", counting)
    return made


def test_a_step_among_the_strategies_already_searched_makes_no_mip(monkeypatch) -> None:
    # Every strategy is kept around either plan: the second step's neighbourhood is the
    # first's, over which its plan is proven optimal; no second MIP, the same plan.
    made = _counting_mips(monkeypatch)
    best = search(_two_layers(), [(0, 0, 0)])
    assert best is not None and best.choices == (1, 1, 0) and best.objective_s == 4.0
    assert best.searched == ((0, 1), (0, 1), (0,))
    assert len(made) == 1


@settings(SETTINGS, max_examples=25)
@given(st.one_of(budgeted_problems(), layered_problems()))
def test_skipping_steps_within_the_searched_strategies_keeps_the_plan(problem) -> None:
    import pytest

    import solver.primal as primal

    free = _free_plan(problem)
    if free is None:
        return
    with pytest.MonkeyPatch.context() as patch:
        made = _counting_mips(patch)
        skipping = search(problem, [free])
        skipped_mips = len(made)
        step = primal.neighbourhood
        patch.setattr(primal, "neighbourhood", lambda *a, **k: step(*a, **{**k, "within": None}))
        made.clear()
        every = search(problem, [free])
        assert skipped_mips <= len(made)
    assert (skipping is None) == (every is None)
    if skipping is not None:
        assert skipping.choices == every.choices and skipping.recomputed == every.recomputed
        assert skipping.objective_s == every.objective_s
