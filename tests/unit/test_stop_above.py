"""A priced solve told the value it is compared with (solver.shrink.solve ``stop_above``)
either answers exactly as without it, or stops and reports a bound at or above that value
and below the optimum; pruning (solver/prune.py) likewise. The pattern D with solves stopped
early (lagrangian.pattern_dual ``stop_early``) keeps D, its smallest value and every
pattern's bound below that pattern's optimum, against the same D solved whole and brute force
(issue 16, session 24)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solver.prune
import solver.shrink
from solver import Edge, InfeasibleError, Node, Problem, brute_force, plan_objective_s, solve
from solver.budgeted import _answer_key
from solver.count_patterns import count_patterns
from solver.lagrangian import pattern_dual, priced, recompute_patterns
from solver.pattern_bounds import pattern_problem, pattern_terms, trivial_floor
from solver.problem import Segment
from solver.prune import prune
from tests.unit.test_lagrangian import budgeted_problems
from tests.unit.test_prune import cores, cores_with_tails, every_plan

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
SCALES = st.sampled_from((0.5, 0.9, 0.99, 0.999, 1.001, 1.01, 1.1))


@pytest.fixture
def prune_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prune every budget-free core, however small, and never give up (test_prune's)."""
    monkeypatch.setattr(solver.shrink, "PRUNE_MIN_ENTRIES", -1)
    monkeypatch.setattr(solver.prune, "GIVE_UP_KEPT", 1.0)


def _tolerance(value: float) -> float:
    return 1e-9 * max(1.0, abs(value))


def _cutoff(optimum: float, scale: float) -> float:
    """A value around the optimum, on either side (scale 1 would leave the side to rounding)."""
    return optimum * scale if optimum else scale - 1.0


@SETTINGS
@given(st.one_of(cores(), cores_with_tails()), SCALES)
def test_pruning_with_stop_above_is_unchanged_or_stops_above_it(
    prune_everything, problem: Problem, scale: float
) -> None:
    plans = every_plan(problem)
    if not plans:
        return
    optimum = min(cost for _, cost in plans)
    cutoff = _cutoff(optimum, scale)
    stopped = prune(problem, stop_above=cutoff)
    whole = prune(problem)
    if stopped is None or not stopped.stopped:
        assert stopped == whole  # nothing changes below the first bound
        return
    assert cutoff <= stopped.lower_s <= optimum + _tolerance(optimum)
    assert stopped.upper_s == pytest.approx(plan_objective_s(problem, stopped.upper_plan))
    assert stopped.upper_s >= optimum - _tolerance(optimum)
    assert stopped.problem is problem
    assert all(len(k) == n.num_choices for k, n in zip(stopped.keep, problem.nodes, strict=True))


def _check_solve(problem: Problem, scale: float) -> bool:
    """solve with ``stop_above`` around the optimum of the solve without it; True where it
    stopped."""
    try:
        whole = solve(problem)
    except InfeasibleError:
        return False
    cutoff = _cutoff(whole.objective_s, scale)
    found = solve(problem, stop_above=cutoff)
    if "stopped_above" not in found.details:
        fields = ("choices", "objective_s", "bound_s", "gap", "status", "recomputed")
        assert [getattr(found, f) for f in fields] == [getattr(whole, f) for f in fields]
        return False
    assert found.status == "feasible"
    assert cutoff <= found.bound_s <= whole.objective_s + _tolerance(whole.objective_s)
    assert found.objective_s >= whole.objective_s - _tolerance(whole.objective_s)
    if math.isfinite(found.objective_s):
        assert found.objective_s == pytest.approx(plan_objective_s(problem, found.choices))
    return True


@SETTINGS
@given(cores(), SCALES)
def test_a_core_solve_with_stop_above_is_exact_or_stops_above_it(
    prune_everything, problem: Problem, scale: float
) -> None:
    _check_solve(problem, scale)


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0), SCALES)
def test_a_priced_solve_with_stop_above_is_exact_or_stops_above_it(
    prune_everything, problem: Problem, lam: float, scale: float
) -> None:
    """The relaxation's priced problems (tie classes, segment terms): elimination, tie
    contraction and pruning, each with the value passed on."""
    _check_solve(priced(problem, lam * 0.5), scale)


def test_a_solve_stops_right_after_elimination_where_the_least_entries_reach_the_value() -> None:
    """A chain (elimination leaves nothing): the least entries are the optimum itself, so a
    value below it stops the solve with that bound, one above it does not."""
    problem = Problem(
        nodes=(
            Node(name="a", cost_s=(1.0, 2.0), memory_bytes=(0.0, 0.0)),
            Node(name="b", cost_s=(3.0, 1.0), memory_bytes=(0.0, 0.0)),
        ),
        edges=(Edge(src=0, dst=1, cost_s=((0.5, 0.0), (0.25, 1.0))),),
    )
    whole = solve(problem)
    assert whole.objective_s == 2.0
    below = solve(problem, stop_above=1.9)
    assert below.details == {"stopped_above": 1.0}
    assert 1.9 <= below.bound_s <= 2.0
    above = solve(problem, stop_above=2.1)
    assert "stopped_above" not in above.details and above.objective_s == 2.0


def _free_solver(problem: Problem, stop_above: float | None = None):
    sol = solve(problem, stop_above=stop_above)
    return sol.choices, sol.objective_s, sol.bound_s


def _loosest_stopper(problem: Problem, stop_above: float | None = None):
    """The weakest solve a ``stop_above`` allows: where the optimum is at or above the value,
    the value itself as the bound (on these small problems the real stops are mostly exact)."""
    sol = solve(problem)
    if stop_above is not None and sol.bound_s >= stop_above:
        return sol.choices, sol.objective_s, stop_above
    return sol.choices, sol.objective_s, sol.bound_s


@settings(SETTINGS, max_examples=80)
@given(budgeted_problems(), st.floats(0.0, 2.0), st.sampled_from((_free_solver, _loosest_stopper)))
def test_the_pattern_dual_stopping_early_keeps_d_and_bounds_each_pattern(
    prune_everything, problem: Problem, scale: float, solve_free
) -> None:
    _check_pattern_dual(problem, scale * 0.5, solve_free)


def test_a_solve_stopped_at_the_smallest_value_leaves_d_as_it_is() -> None:
    """Fixed (found by the search above with the stops given half a second less than the
    smallest value: D fell from 0.25 to 0): two patterns of one segment's two copies, the
    second solved with the first's value as its stop."""
    zero = (0.0, 0.0)
    nodes = (
        Node(name="n0", cost_s=zero, memory_bytes=(1.0, 1.0)),
        *(Node(name=f"n{i}", cost_s=zero, memory_bytes=zero) for i in range(1, 5)),
    )
    tables = (
        (zero, zero),
        (zero, zero),
        ((None, 0.0), (0.0, None)),
        ((0.0, None), (0.0, 0.0)),
    )
    segments = (
        Segment(name="s02", nodes=(0, 1), freed_bytes=(zero, zero), recompute_s=(zero, zero)),
        Segment(name="s01", nodes=(0,), freed_bytes=((0.0, 0.5),), recompute_s=(zero,), copies=2),
    )
    problem = Problem(
        nodes=nodes,
        edges=tuple(Edge(src=i, dst=i + 1, cost_s=t) for i, t in enumerate(tables)),
        memory_budget_bytes=1.0,
        segments=segments,
    )
    _check_pattern_dual(problem, 0.5, _loosest_stopper)


def _check_pattern_dual(problem: Problem, lam: float, solve_free) -> None:
    """pattern_dual with ``stop_early`` (its solves by ``solve_free``) against the same D solved
    whole: the same D and smallest value, and every pattern's bound below its optimum."""
    patterns = recompute_patterns(problem)
    if patterns is None:
        counted = count_patterns(problem)
        if counted is None:
            return
        problem, patterns = counted.problem, counted.patterns
    try:
        whole = pattern_dual(problem, lam, _free_solver, patterns)
        early = pattern_dual(problem, lam, solve_free, patterns, stop_early=True)
    except InfeasibleError:
        return
    assert early.lower == pytest.approx(whole.lower, rel=1e-12, abs=1e-12)
    assert early.value == pytest.approx(whole.value, rel=1e-12, abs=1e-12)
    # Every pattern's bound stays below its own priced optimum (chord floors and reduced-cost
    # fixing take them as such).
    base = priced(dataclasses.replace(problem, segments=()), lam)
    held: dict = {}
    for k, pattern in enumerate(patterns):
        _, _, extra, extra_edges = pattern_terms(problem, lam, pattern)
        made = pattern_problem(base, extra, extra_edges)
        try:
            optimum = solve(made).objective_s
        except InfeasibleError:
            continue
        assert early.lowers[k] <= optimum + _tolerance(optimum)
        assert trivial_floor(base, extra, extra_edges, held) <= optimum


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0))
def test_the_trivial_floor_is_below_the_brute_force_optimum(problem: Problem, scale: float):
    patterns = recompute_patterns(problem)
    if patterns is None:
        return
    lam = scale * 0.5
    base = priced(dataclasses.replace(problem, segments=()), lam)
    held: dict = {}
    for pattern in patterns:
        _, _, extra, extra_edges = pattern_terms(problem, lam, pattern)
        try:
            optimum = brute_force(pattern_problem(base, extra, extra_edges))[1]
        except InfeasibleError:
            continue
        assert trivial_floor(base, extra, extra_edges, held) <= optimum


def test_answers_are_keyed_by_the_value_they_were_solved_against() -> None:
    problem = Problem(nodes=(Node(name="a", cost_s=(1.0, 2.0), memory_bytes=(0.0, 0.0)),), edges=())
    edges = problem.edges
    assert _answer_key(problem, edges) == _answer_key(problem, edges, None, None)
    assert _answer_key(problem, edges, None, 1.5) == _answer_key(problem, edges, None, 1.5)
    assert _answer_key(problem, edges, None, 1.5) != _answer_key(problem, edges)
    assert _answer_key(problem, edges, None, 1.5) != _answer_key(problem, edges, None, 2.5)
