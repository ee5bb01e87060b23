"""Lagrangian reduced-cost fixing (solver/fixing.py) against brute force."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from solver import Edge, Node, Problem, brute_force, solve
from solver.fixing import fix, min_marginals, reduced_cost_keep, restrict_budgeted
from solver.lagrangian import recompute_patterns, relax
from solver.presolve import plan_peak_memory_bytes
from tests.unit.test_lagrangian import SETTINGS, _free_solver, _optimum, budgeted_problems


@st.composite
def free_problems(draw) -> Problem:
    """3-6 nodes of 2-3 strategies in a chain, other pairs joined with probability 2/3 (K4 to
    K6 included: the split relaxation runs), some forbidden pairs, maybe a tie class."""
    num_nodes = draw(st.integers(3, 6))
    width = draw(st.integers(2, 3))
    costs = st.floats(0.0, 10.0, allow_nan=False).map(lambda v: round(v, 2))
    pair = st.one_of(costs, costs, costs, st.none()) if draw(st.booleans()) else costs
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(draw(costs) for _ in range(width)),
            memory_bytes=(0.0,) * width,
        )
        for i in range(num_nodes)
    )
    edges = tuple(
        Edge(
            src=a,
            dst=b,
            cost_s=tuple(tuple(draw(pair) for _ in range(width)) for _ in range(width)),
        )
        for b in range(num_nodes)
        for a in range(b)
        if b == a + 1 or draw(st.integers(0, 2))
    )
    tied = ((0, num_nodes - 1),) if draw(st.booleans()) else ()
    return Problem(nodes=nodes, edges=edges, tied=tied)


def _pinned(problem: Problem, i: int, s: int) -> Problem:
    """``problem`` with node i (and its tie class) offered only strategy s."""
    members = next((c for c in problem.tied if i in c), (i,))
    keep = tuple(
        (s,) if n in members else tuple(range(node.num_choices))
        for n, node in enumerate(problem.nodes)
    )
    return restrict_budgeted(problem, keep)


def _best_with(problem: Problem, i: int, s: int) -> float:
    """The cheapest plan (within the budget, if any) that uses strategy s at node i."""
    value = _optimum(_pinned(problem, i, s))
    return math.inf if value is None else value


def _series_parallel(problem: Problem) -> bool:
    """A chain, or a chain closed into one cycle: elimination needs no split."""
    return all(e.dst == e.src + 1 for e in problem.edges) or len(problem.nodes) == 3


@settings(SETTINGS, max_examples=40)
@given(free_problems())
def test_min_marginals_are_below_every_plan_and_exact_without_splits(problem) -> None:
    bounds = min_marginals(problem)
    exact = _series_parallel(problem)
    for i, node in enumerate(problem.nodes):
        for s in range(node.num_choices):
            truth = _best_with(problem, i, s)
            assert bounds[i][s] <= truth + 1e-9 * max(1.0, abs(truth)) or truth == math.inf
            if exact:
                assert bounds[i][s] == pytest.approx(truth, rel=1e-9, abs=1e-9)


@SETTINGS
@given(budgeted_problems(), st.one_of(st.just(0.0), st.floats(0.0, 1.0)), st.booleans())
def test_the_reduced_cost_bound_is_below_every_plan_that_fits(problem, lam, by_pattern) -> None:
    # LB(i, s) <= the cheapest plan that fits with x_i = s, at any multiplier, over the
    # recompute patterns or with the separable segment term: what makes the fixing exact.
    patterns = recompute_patterns(problem) if by_pattern else None
    truths = [
        [_best_with(problem, i, s) for s in range(n.num_choices)]
        for i, n in enumerate(problem.nodes)
    ]
    finite = [t for row in truths for t in row if t < math.inf]
    if not finite:
        return
    upper = max(finite)  # UB: the worst of them, so every (i, s) with a plan is checked
    lower = reduced_cost_keep(problem, lam, upper, patterns)
    for i, row in enumerate(truths):
        for s, truth in enumerate(row):
            if truth < math.inf:
                assert lower[i][s] <= truth + 1e-9 * max(1.0, abs(truth))


@SETTINGS
@given(budgeted_problems())
def test_the_mip_after_fixing_is_the_brute_force_optimum(problem) -> None:
    optimum = _optimum(problem)
    if optimum is None:
        return
    try:
        found = relax(problem, _free_solver, target_gap=0.0)
    except Exception:  # forbidden pairs everywhere
        return
    if found.choices is None or _optimum(dataclasses.replace(problem, tied=())) != optimum:
        return  # no plan, or the relaxed plan may untie the classes (elimination)
    tolerance = 1e-9 * max(1.0, abs(optimum))
    assert found.bound_s <= optimum + tolerance <= found.objective_s + 2 * tolerance
    keep = fix(
        problem, found.multiplier, found.choices, found.objective_s, recompute_patterns(problem)
    )
    fixed = restrict_budgeted(problem, keep)
    sol = solve(fixed, gap=0.0, relax_first=False)
    assert sol.objective_s == pytest.approx(optimum, rel=1e-9, abs=1e-9)
    assert sol.bound_s <= optimum + tolerance
    choices = tuple(k[c] for k, c in zip(keep, sol.choices, strict=True))
    assert all(c in k for c, k in zip(choices, keep, strict=True))


def test_fixing_drops_the_strategies_no_cheap_plan_uses() -> None:
    # Three nodes, each fast and big (10 bytes) or slow and small; the budget fits one big
    # node, best c's (c is slowest when small): 3 + 3 + 1 = 7. At lam = 0.2 a big node is
    # priced 1 + 2 = 3, and the budget term is -0.2 * 10: LB(c, small) = 3 + 3 + 9 - 2 = 13 >
    # 7 is dropped; every other choice has LB 7 and stays.
    nodes = (
        Node(name="a", cost_s=(1.0, 3.0), memory_bytes=(10.0, 0.0)),
        Node(name="b", cost_s=(1.0, 3.0), memory_bytes=(10.0, 0.0)),
        Node(name="c", cost_s=(1.0, 9.0), memory_bytes=(10.0, 0.0)),
    )
    edges = (
        Edge(src=0, dst=1, cost_s=((0.0, 0.0), (0.0, 0.0))),
        Edge(src=1, dst=2, cost_s=((0.0, 0.0), (0.0, 0.0))),
    )
    problem = Problem(nodes=nodes, edges=edges, memory_budget_bytes=10.0)
    plan, optimum = brute_force(problem)
    assert plan == (1, 1, 0) and optimum == 7.0
    keep = fix(problem, 0.2, plan, optimum, None)
    assert keep == ((0, 1), (0, 1), (0,))
    assert solve(restrict_budgeted(problem, keep), gap=0.0).objective_s == optimum


@SETTINGS
@given(budgeted_problems(), st.sampled_from([0.9, 1.0, 1.05]), st.sampled_from([0.0001, 0.05]))
def test_fixing_against_a_cutoff_keeps_the_bound_valid(problem, scale, gap) -> None:
    # solver.solve(cutoff_s=) fixes against the better of its own plan and the cutoff (a plan
    # found elsewhere, less the gap): when nothing is left, the problem is cut off with the
    # limit as its bound; either way the bound is below this problem's optimum.
    optimum = _optimum(problem)
    untied = _optimum(dataclasses.replace(problem, tied=()))
    if optimum is None or untied is None:
        return
    try:
        sol = solve(problem, gap=gap, cutoff_s=optimum * scale)
    except Exception:  # forbidden pairs everywhere
        return
    tolerance = 1e-9 * max(1.0, abs(optimum))
    assert sol.bound_s <= optimum + tolerance
    assert sol.peak_memory_bytes <= problem.memory_budget_bytes + 1e-9
    assert sol.objective_s >= untied - tolerance


@SETTINGS
@given(budgeted_problems(), st.one_of(st.just(0.0), st.floats(0.0, 1.0)))
def test_fixing_at_a_cutoff_without_a_plan_keeps_the_optimum(problem, lam) -> None:
    # What solver.solve does with a cutoff below its own best plan (budgeted._fixed_mip, no
    # plan kept by force): at the optimum as the limit the MIP over what stays finds it; just
    # below it, nothing within the limit is left.
    from solver.budgeted import _fixed_mip

    optimum = _optimum(problem)
    if optimum is None or _optimum(dataclasses.replace(problem, tied=())) != optimum:
        return
    options = {"backend": "highs", "time_limit_s": None, "gap": 0.0, "msg": False}
    exact, keep = _fixed_mip(problem, lam, None, None, optimum, {}, **options)
    assert exact is not None
    choices = tuple(k[c] for k, c in zip(keep, exact.choices, strict=True))
    if plan_peak_memory_bytes(problem, choices, exact.recomputed) > problem.memory_budget_bytes:
        return  # within HiGHS's feasibility tolerance only: brute force counts it out
    assert exact.objective_s == pytest.approx(optimum, rel=1e-9, abs=1e-9)
    below = optimum - 1e-3 * max(1.0, abs(optimum))
    exact, _ = _fixed_mip(problem, lam, None, None, below, {}, **options)
    assert exact is None or exact.objective_s >= optimum - 1e-9 * max(1.0, abs(optimum))
