"""Lagrangian relaxation of the memory budget (solver/lagrangian.py) against brute force."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import Edge, InfeasibleBudgetError, Node, Problem, brute_force, solve
from solver.lagrangian import (
    pattern_dual,
    priced,
    recompute_patterns,
    relax,
    transient_floor,
)
from solver.problem import Segment


@st.composite
def budgeted_problems(draw) -> Problem:
    """A chain of 3-5 nodes (2-3 strategies, resident and transient bytes), an extra edge,
    maybe a tie class, maybe checkpoint segments (nested, or with copies and minimum copies),
    and a budget between the smallest and the largest resident plan."""
    num_nodes = draw(st.integers(3, 5))
    width = draw(st.integers(2, 3))
    costs = st.floats(0.0, 10.0, allow_nan=False).map(lambda v: round(v, 2))
    sizes = st.floats(0.0, 100.0, allow_nan=False).map(lambda v: round(v, 1))
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(draw(costs) for _ in range(width)),
            memory_bytes=tuple(draw(sizes) for _ in range(width)),
            transient_bytes=tuple(draw(sizes) for _ in range(width)) if draw(st.booleans()) else (),
        )
        for i in range(num_nodes)
    )
    pair = st.one_of(costs, costs, costs, st.none()) if draw(st.integers(0, 3)) == 0 else costs
    edges = [
        Edge(
            src=i,
            dst=i + 1,
            cost_s=tuple(tuple(draw(pair) for _ in range(width)) for _ in range(width)),
        )
        for i in range(num_nodes - 1)
    ]
    if draw(st.booleans()):  # a skip edge makes a cycle
        edges.append(
            Edge(
                src=0,
                dst=num_nodes - 1,
                cost_s=tuple(tuple(draw(costs) for _ in range(width)) for _ in range(width)),
            )
        )
    segments: list[Segment] = []
    if draw(st.integers(0, 2)):
        spans = [(0, 2), (0, 1)] if draw(st.booleans()) else [(1, 3)]
        for lo, hi in spans:
            members = tuple(range(lo, hi))
            copies = draw(st.integers(1, 2))
            segments.append(
                Segment(
                    name=f"s{lo}{hi}",
                    nodes=members,
                    freed_bytes=tuple(
                        tuple(min(draw(sizes), nodes[n].memory_bytes[s]) for s in range(width))
                        for n in members
                    ),
                    recompute_s=tuple(
                        tuple(draw(costs) / 4 for _ in range(width)) for _ in members
                    ),
                    copies=copies,
                    min_copies=draw(st.integers(0, copies)) if draw(st.booleans()) else 0,
                )
            )
    tied = ((num_nodes - 2, num_nodes - 1),) if draw(st.booleans()) else ()
    low = sum(min(n.memory_bytes) for n in nodes)
    high = sum(max(n.memory_bytes) for n in nodes) + 50.0
    budget = round(draw(st.floats(low, high)), 1)
    return Problem(
        nodes=nodes,
        edges=tuple(edges),
        memory_budget_bytes=budget,
        segments=tuple(segments),
        tied=tied,
    )


def _optimum(problem: Problem) -> float | None:
    try:
        return brute_force(problem)[1]
    except InfeasibleBudgetError:
        return None
    except Exception as error:  # the edges forbid everything
        assume_no_plan = "no plan exists" in str(error) or "forbid" in str(error)
        assert assume_no_plan, error
        return None


def _free_solver(problem: Problem) -> tuple[tuple[int, ...], float, float]:
    sol = solve(problem)
    return sol.choices, sol.objective_s, sol.bound_s


SETTINGS = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0))
def test_the_dual_function_is_below_the_optimum_at_every_multiplier(problem, scale) -> None:
    optimum = _optimum(problem)
    if optimum is None:
        return
    # D(lam) at multipliers from 0 to a few times (seconds / bytes) of the problem's spread.
    lam = scale * 0.5
    try:
        free = solve(priced(problem, lam))
    except Exception:  # forbidden pairs everywhere: nothing to bound
        return
    budget = problem.memory_budget_bytes
    dual = free.bound_s + lam * (problem.memory_offset_bytes + transient_floor(problem) - budget)
    assert dual <= optimum + 1e-9 * max(1.0, abs(optimum))


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0))
def test_the_pattern_dual_is_below_the_optimum_at_every_multiplier(problem, scale) -> None:
    # The stronger D: one budget-free solve per recompute pattern, each segment priced whole.
    patterns = recompute_patterns(problem)
    optimum = _optimum(problem)
    if optimum is None or patterns is None:
        return
    lam = scale * 0.5
    try:
        found = pattern_dual(problem, lam, _free_solver, patterns)
    except Exception:  # forbidden pairs everywhere: nothing to bound
        return
    budget = problem.memory_budget_bytes
    dual = found.lower + lam * (problem.memory_offset_bytes + transient_floor(problem) - budget)
    assert dual <= optimum + 1e-9 * max(1.0, abs(optimum))
    assert all(len(plan) == len(problem.nodes) for plan in found.plans)


@settings(SETTINGS, max_examples=12)
@given(budgeted_problems())
def test_a_cutoff_stops_the_search_with_a_valid_bound(problem) -> None:
    # stop_at: the bound at which a plan found elsewhere cannot be beaten by the gap. The search
    # stops once its bound reaches it, and what it reports is still a bound and a real plan.
    optimum = _optimum(problem)
    untied = _optimum(dataclasses.replace(problem, tied=()))
    if optimum is None or untied is None:
        return
    cutoff = optimum - 0.5 * abs(optimum) - 1.0
    try:
        found = relax(problem, _free_solver, stop_at=cutoff, max_evaluations=8)
    except Exception:  # forbidden pairs everywhere
        return
    tolerance = 1e-9 * max(1.0, abs(optimum))
    assert found.bound_s <= optimum + tolerance
    if found.bound_s >= cutoff:  # stopped there: no more evaluations than the whole search
        assert found.evaluations <= relax(problem, _free_solver, max_evaluations=8).evaluations
    if found.choices is not None:  # a plan of the untied problem (elimination unties)
        assert found.objective_s >= untied - tolerance


@SETTINGS
@given(budgeted_problems(), st.sampled_from([0.01, 0.2]))
def test_relaxed_solve_fits_and_reports_an_honest_gap(problem, gap) -> None:
    optimum = _optimum(problem)
    untied = _optimum(dataclasses.replace(problem, tied=()))
    if untied is None:
        looser = problem.memory_budget_bytes + 1e-6
        if _optimum(dataclasses.replace(problem, tied=(), memory_budget_bytes=looser)) is not None:
            return  # the least bytes equal the budget up to rounding: fitting and not are both right
        with pytest.raises(Exception):  # noqa: B017 -- infeasible budget or forbidden pairs
            solve(problem, gap=gap)
        return
    if optimum is None:  # only plans whose tied nodes differ fit (solver/counts.py may find one)
        return
    sol = solve(problem, gap=gap)
    tolerance = 1e-9 * max(1.0, abs(optimum))
    assert sol.peak_memory_bytes <= problem.memory_budget_bytes + 1e-9
    assert sol.bound_s <= optimum + tolerance
    # A plan's layers may differ where elimination unties them: it is a plan of the untied
    # problem, at least that problem's optimum.
    assert sol.objective_s >= untied - tolerance
    if sol.objective_s > 0:
        expected = (sol.objective_s - sol.bound_s) / sol.objective_s
        assert sol.gap == pytest.approx(expected, abs=1e-9)
    assert sol.gap <= gap + 1e-9
    if sol.status == "optimal":
        assert sol.objective_s <= optimum + tolerance


@SETTINGS
@given(budgeted_problems())
def test_gap_zero_is_the_brute_force_optimum(problem) -> None:
    optimum = _optimum(problem)
    if optimum is None:
        return
    sol = solve(problem, gap=0.0)
    assert sol.objective_s == pytest.approx(optimum, rel=1e-9, abs=1e-9)
    assert sol.gap == 0.0 and "lagrangian_bound_s" not in sol.details


def test_relax_brackets_the_multiplier_and_closes_a_knapsack() -> None:
    # Independent nodes: fast and big, or slow and small. The budget lets 3 of 6 be big; each
    # relaxed plan is a threshold rule, and the search finds the multiplier where it fits.
    nodes = tuple(
        Node(name=f"n{i}", cost_s=(1.0, 2.0 + i / 10), memory_bytes=(10.0, 0.0)) for i in range(6)
    )
    edges = tuple(Edge(src=i, dst=i + 1, cost_s=((0.0, 0.0), (0.0, 0.0))) for i in range(5))
    problem = Problem(nodes=nodes, edges=edges, memory_budget_bytes=30.0)
    found = relax(problem, _free_solver, target_gap=0.0)
    optimum = brute_force(problem)[1]
    assert found.objective_s == pytest.approx(optimum)
    assert found.bound_s == pytest.approx(optimum)
    assert found.multiplier > 0.0


def test_the_relaxed_plan_reports_its_bound() -> None:
    nodes = tuple(Node(name=f"n{i}", cost_s=(1.0, 1.5), memory_bytes=(10.0, 4.0)) for i in range(4))
    edges = tuple(Edge(src=i, dst=i + 1, cost_s=((0.0, 0.2), (0.2, 0.0))) for i in range(3))
    problem = Problem(nodes=nodes, edges=edges, memory_budget_bytes=25.0)
    sol = solve(problem, gap=0.5)
    assert math.isfinite(sol.details["lagrangian_bound_s"])
    assert sol.bound_s <= brute_force(problem)[1] <= sol.objective_s + 1e-12


@SETTINGS
@given(budgeted_problems())
def test_the_mip_started_from_a_plan_returns_one_no_worse(problem) -> None:
    # What the relaxation hands the MIP (solver/budgeted.py solve_relaxed): at gap 1 HiGHS may
    # stop at its first plan, so only the start makes the optimum come back every time.
    problem = dataclasses.replace(problem, tied=())
    try:
        best, optimum = brute_force(problem)[:2]
    except Exception:  # the budget or the forbidden pairs leave nothing
        return
    sol = solve(problem, gap=1.0, relax_first=False, start_plan=best)
    tolerance = 1e-9 * max(1.0, abs(optimum))
    assert sol.objective_s <= optimum + tolerance
    assert sol.status == ("optimal" if sol.gap == 0.0 else "feasible")  # not 'optimal' at a gap
    assert sol.peak_memory_bytes <= problem.memory_budget_bytes + 1e-9
    assert sol.bound_s <= optimum + tolerance


def test_a_start_plan_maps_onto_the_strategy_columns_it_chose() -> None:
    # The start handed to HiGHS (solver/ilp.py _start_columns) decodes back to the plan.
    from solver import highs_direct
    from solver.ilp import _start_columns
    from solver.presolve import reduce_problem

    width = 3
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(float((i * 7 + s * 3) % 5) for s in range(width)),
            memory_bytes=tuple(float((i + 2 * s) % 4) for s in range(width)),
        )
        for i in range(6)
    )
    edges = tuple(
        Edge(
            src=i,
            dst=i + 1,
            cost_s=tuple(tuple(float(s != t) for t in range(width)) for s in range(width)),
        )
        for i in range(5)
    )
    problem = Problem(nodes=nodes, edges=edges, memory_budget_bytes=12.0)
    red = reduce_problem(problem)
    model = highs_direct.build(problem, red, minimise_peak=False)
    plan = (2, 0, 1, 2, 1, 0)
    values = np.zeros(model.num_variables)
    for column, value in _start_columns(red, model.x_index, plan).items():
        values[column] = value
    decoded = highs_direct.decode(red, model, values)
    kept = [i for i, allowed in enumerate(red.allowed) if plan[i] in allowed]
    assert len(kept) >= 3  # the check is not vacuous
    assert [decoded[i] for i in kept] == [plan[i] for i in kept]


def _two_disjoint_segments() -> Problem:
    """Two nodes of 10 bytes and 1 s, each its own segment freeing 6 bytes for 0.5 s; a budget
    of 14 bytes: recomputing both (1 s) fits 20 - 12 + 6 = 14 bytes. Optimum 3 s."""
    nodes = tuple(Node(name=f"n{i}", cost_s=(1.0,), memory_bytes=(10.0,)) for i in range(2))
    segments = tuple(
        Segment(name=f"s{i}", nodes=(i,), freed_bytes=((6.0,),), recompute_s=((0.5,),))
        for i in range(2)
    )
    return Problem(
        nodes=nodes,
        edges=(Edge(src=0, dst=1, cost_s=((0.0,),)),),
        memory_budget_bytes=14.0,
        segments=segments,
    )


def test_the_pattern_dual_prices_each_recomputed_segment_whole() -> None:
    # Priced whole, pattern (1, 1) gives D(1) = 2 + 1 + (14 - 14) = 3, the optimum exactly; the
    # node-by-node split cannot see that one recomputed segment is alive again.
    problem = _two_disjoint_segments()
    assert brute_force(problem)[1] == pytest.approx(3.0)
    patterns = recompute_patterns(problem)
    assert sorted(patterns) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    found = pattern_dual(problem, 1.0, _free_solver, patterns)
    assert found.lower + 1.0 * (0.0 - 14.0) == pytest.approx(3.0)
    assert found.peak == pytest.approx(14.0)
    found = relax(problem, _free_solver, target_gap=0.0)
    assert found.bound_s == pytest.approx(3.0) and found.objective_s == pytest.approx(3.0)


@settings(SETTINGS, max_examples=40)
@given(
    budgeted_problems(),
    st.floats(0.0, 0.5),
    st.floats(0.0, 3.0),
    st.floats(0.0, 3.0),
    st.floats(0.5, 2.0),
)
def test_a_search_warm_started_anywhere_keeps_a_valid_bound_and_a_real_plan(
    problem, tight, separable, best, scale
) -> None:
    # Driver.auto starts a ZeRO configuration's search where another's ended (only parameter
    # costs differ): from multipliers of another problem (node seconds scaled, as ZeRO scales
    # parameter costs) and from arbitrary ones, the bound stays below the optimum, the plan
    # fits and its gap is honest, with a cutoff too. Budgets in the lower half of the resident
    # range, so that the budget-free plan rarely fits and the warm start is used.
    low = sum(min(n.memory_bytes) for n in problem.nodes)
    high = sum(max(n.memory_bytes) for n in problem.nodes)
    problem = dataclasses.replace(problem, memory_budget_bytes=low + tight * (high - low))
    optimum = _optimum(problem)
    untied = _optimum(dataclasses.replace(problem, tied=()))
    if optimum is None or untied is None:
        return
    other = dataclasses.replace(
        problem,
        nodes=tuple(
            dataclasses.replace(n, cost_s=tuple(c * scale for c in n.cost_s)) if i % 2 else n
            for i, n in enumerate(problem.nodes)
        ),
    )
    try:
        warmed = solve(other, gap=0.01).details
    except Exception:  # forbidden pairs everywhere, or nothing of the other problem fits
        return
    tolerance = 1e-9 * max(1.0, abs(optimum))
    starts = [(separable, best)]
    if "lagrangian_multiplier" in warmed:
        starts.append((warmed["lagrangian_separable_multiplier"], warmed["lagrangian_multiplier"]))
    for warm in starts:
        sol = solve(problem, gap=0.01, warm_multipliers=warm)
        assert sol.peak_memory_bytes <= problem.memory_budget_bytes + 1e-9
        assert sol.bound_s <= optimum + tolerance
        assert untied - tolerance <= sol.objective_s
        assert sol.gap <= 0.01 + 1e-9
        found = relax(problem, _free_solver, warm=warm, stop_at=optimum, target_gap=0.01)
        assert found.bound_s <= optimum + tolerance
        if found.choices is not None:
            assert found.objective_s >= untied - tolerance


def test_a_warm_started_search_reaches_the_same_bound_in_fewer_evaluations() -> None:
    # Started where the cold search ended (what Driver.auto hands the next ZeRO configuration),
    # the pattern phase begins at the multiplier of the best bound: the same bound (the
    # optimum here) in 3 evaluations instead of 19; from elsewhere, the same bound too.
    problem = _two_disjoint_segments()
    cold = relax(problem, _free_solver, target_gap=0.0)
    assert cold.bound_s == pytest.approx(3.0) and cold.separable_multiplier > 0.0
    warm = relax(
        problem, _free_solver, target_gap=0.0, warm=(cold.separable_multiplier, cold.multiplier)
    )
    assert warm.bound_s == pytest.approx(3.0) and warm.objective_s == pytest.approx(3.0)
    assert warm.evaluations < cold.evaluations
    for start in [(0.3, 1.0), (5.0, 0.01)]:
        assert relax(problem, _free_solver, target_gap=0.0, warm=start).bound_s == pytest.approx(
            3.0
        )
