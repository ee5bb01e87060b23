"""What the ZeRO search (autopar/planner/zero_search.py) bounds configurations with, on tiny
budgeted problems against brute force: a relaxation started from a bound evaluation
(solver.budgeted.Warm) gives the very Solution of one started cold; a bound derived from
another problem's (solver/derived_bounds.py) and a priced bound with a skip target (the
separable D first) stay below the exact optimum."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solver.shrink as shrink
from solver import InfeasibleError, Node, Problem, solve
from solver.budgeted import Recorded, Warm, priced_bound
from solver.derived_bounds import derived_bound, fitting, fitting_step, reference
from solver.problem import Segment
from tests.unit.test_budget_stops import assert_bounds_optimum
from tests.unit.test_lagrangian import _optimum, budgeted_problems

FEW = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
TIMES = ("lagrangian_s", "fixing_s", "build_s", "solve_s")
"""Solution details that are wall-clock seconds, not results."""
TAKEN: list[int] = []
"""Per example, the recorded answers the relaxation took (checked over all of them below)."""


class _Calls(list):
    real = None


def _counting_solves() -> _Calls:
    """Count the budget-free solves solver.shrink.solve makes (the priced solves: the
    relaxation's solve_free imports it at each call); put back by the caller."""
    calls = _Calls()
    calls.real = real = shrink.solve

    def counted(problem, **kwargs):
        if kwargs.get("relaxation"):
            calls.append(1)
        return real(problem, **kwargs)

    shrink.solve = counted
    return calls


def _result(solution) -> tuple:
    """Everything a Solution says but the seconds it took."""
    details = {
        k: v
        for k, v in solution.details.items()
        if k not in TIMES and k != "lagrangian_reused_solves"
    }
    return (dataclasses.replace(solution, build_s=0.0, solve_s=0.0, details={}), details)


def relaxed_start(problem: Problem, scale: float, cut: bool):
    """``problem`` solved at gap 1%, its multipliers scaled by ``scale`` and a cutoff at its
    objective so scaled (with ``cut``), or None where no relaxation ran (infeasible, the
    budget-free plan fits, or the exact path)."""
    try:
        first = solve(problem, gap=0.01)
    except InfeasibleError:
        return None
    if "lagrangian_multiplier" not in first.details:
        return None
    warm = (
        first.details["lagrangian_separable_multiplier"] * scale,
        first.details["lagrangian_multiplier"] * scale,
    )
    return first, warm, (first.objective_s * scale if cut else None)


@settings(FEW, max_examples=9)
@given(budgeted_problems(), st.floats(0.5, 1.5), st.booleans())
def test_a_relaxation_started_from_a_bound_evaluation_is_the_cold_one(
    problem: Problem, scale: float, cut: bool
) -> None:
    started = relaxed_start(problem, scale, cut)
    if started is None:
        return
    first, warm, cutoff = started
    record = Recorded(edges=problem.edges)
    target = first.objective_s * scale * 0.99 if cut else None
    priced_bound(problem, warm[1], separable_multiplier=warm[0], target=target, record=record)
    solved = len(record.answers)
    calls = _counting_solves()
    cold = solve(problem, gap=0.01, cutoff_s=cutoff, warm_multipliers=warm)
    cold_calls = len(calls)
    started = solve(problem, gap=0.01, cutoff_s=cutoff, warm_multipliers=Warm(*warm, record))
    shrink.solve = calls.real
    assert _result(started) == _result(cold)
    # Every answer the relaxation took (each once) is a priced solve it did not make.
    assert len(calls) - cold_calls == cold_calls - (solved - len(record.answers))
    TAKEN.append(solved - len(record.answers))
    if cut:  # a record of another problem (other edges) is not taken
        other = Recorded(edges=problem.edges, answers=dict(record.answers))
        clone = dataclasses.replace(problem, edges=tuple(list(problem.edges)))
        again = solve(clone, gap=0.01, cutoff_s=cutoff, warm_multipliers=Warm(*warm, other))
        assert _result(again) == _result(cold) and len(other.answers) == len(record.answers)


def test_the_relaxations_took_recorded_answers() -> None:
    # Runs after the hypothesis test above (file order): in some of its examples the
    # relaxation did take the bound evaluation's answers.
    assert sum(TAKEN) > 0, TAKEN


@st.composite
def configuration_pairs(draw) -> tuple[Problem, Problem]:
    """A budgeted problem and another that differs from it only in some nodes' seconds and
    bytes and in the memory offset (as two ZeRO configurations of one model do)."""
    problem = draw(budgeted_problems())
    nodes = list(problem.nodes)
    for i in draw(st.sets(st.integers(0, len(nodes) - 1), max_size=len(nodes))):
        node = nodes[i]
        cost = tuple(max(0.0, c + draw(st.floats(-2.0, 2.0))) for c in node.cost_s)
        memory = tuple(max(0.0, m + draw(st.floats(-40.0, 40.0))) for m in node.memory_bytes)
        nodes[i] = Node(
            name=node.name,
            cost_s=cost,
            memory_bytes=memory,
            transient_bytes=node.transient_bytes,
        )
    other = dataclasses.replace(
        problem, nodes=tuple(nodes), memory_offset_bytes=draw(st.floats(0.0, 20.0))
    )
    return problem, other


@FEW
@given(configuration_pairs(), st.floats(0.0, 2.0))
def test_a_bound_derived_from_another_configuration_is_below_its_optimum(
    pair: tuple[Problem, Problem], lam: float
) -> None:
    problem, other = pair
    try:
        bound, _ = priced_bound(problem, lam)
    except InfeasibleError:
        return
    ref = reference(problem, lam, bound)
    assert derived_bound(problem, ref) == bound  # from itself: every difference is 0
    derived = derived_bound(other, ref)
    assert derived is not None
    optimum = _optimum(other)
    if optimum is not None:
        assert derived <= optimum + 1e-9 * max(1.0, abs(optimum))
    # Not derived across problems that differ in more than node seconds and bytes.
    budget = other.memory_budget_bytes + 1.0
    assert derived_bound(dataclasses.replace(other, memory_budget_bytes=budget), ref) is None
    if problem.edges:
        edges = problem.edges[1:]
        assert derived_bound(dataclasses.replace(other, edges=edges), ref) is None


@FEW
@given(budgeted_problems(), st.floats(0.0, 2.0), st.floats(0.0, 2.0), st.floats(0.5, 1.5))
def test_a_priced_bound_with_a_target_is_below_the_optimum(
    problem: Problem, lam: float, separable: float, scale: float
) -> None:
    optimum = _optimum(problem)
    target = (optimum if optimum is not None else 10.0) * scale
    try:
        bound, fits = priced_bound(problem, lam, separable_multiplier=separable, target=target)
    except InfeasibleError:
        return
    assert_bounds_optimum(optimum, bound, fits)


def test_a_plan_proves_a_tie_level_feasible_only_when_its_classes_choose_alike() -> None:
    nodes = tuple(Node(name=f"n{i}", cost_s=(1.0, 2.0), memory_bytes=(5.0, 1.0)) for i in range(3))
    problem = Problem(nodes=nodes, memory_budget_bytes=8.0, tied=((0, 1),))
    assert fitting_step(problem, (1, 1, 0)) == 5.0  # 7 bytes fit
    assert fitting_step(problem, (0, 1, 1)) is None  # splits the class
    assert fitting_step(problem, (0, 0, 1)) is None  # 11 bytes do not fit
    assert fitting_step(problem, (1, 1)) is None  # not a plan of this problem


def test_a_plans_own_recomputation_proves_it_fits_when_it_does() -> None:
    """fitting_step ``try_first``: copies that are allowed and fit give the step with them (a
    proof, not the fastest); copies that do not fit, exceed a segment's, break an overlap
    clique or do not match the segments fall back to the fastest recomputation."""
    nodes = (Node(name="a", cost_s=(1.0,), memory_bytes=(10.0,)),)
    seg = Segment(name="s", nodes=(0,), freed_bytes=((4.0,),), recompute_s=((0.5,),), copies=2)
    roomy = Problem(nodes=nodes, memory_budget_bytes=10.0, segments=(seg,))
    assert fitting_step(roomy, (0,)) == 1.0  # nothing recomputed fits
    assert fitting_step(roomy, (0,), try_first=[(2,)]) == 2.0  # fits too: taken as it is
    tight = dataclasses.replace(roomy, memory_budget_bytes=7.0)  # 10 - 2 x 4 + 4 alive again
    assert fitting_step(tight, (0,)) == 2.0
    assert fitting_step(tight, (0,), try_first=[(1,)]) == 2.0  # 10 bytes: does not fit
    assert fitting_step(tight, (0,), try_first=[(3,)]) == 2.0  # more copies than it has
    assert fitting_step(tight, (0,), try_first=[(2, 2)]) == 2.0  # not one per segment
    pair = Problem(
        nodes=nodes, memory_budget_bytes=7.0, segments=(seg, dataclasses.replace(seg, name="t"))
    )
    assert fitting_step(pair, (0,), try_first=[(2, 2)]) == 2.0  # 3.0 breaks their clique
    assert fitting_step(pair, (0,), try_first=[(0, 2)]) == 2.0
    # In order, the first that is allowed and fits; fitting gives its copies too.
    assert fitting(roomy, (0,), [(3,), (2,), (0,)]) == ((2,), 2.0)
    assert fitting(tight, (0,), [(1,)]) == ((2,), 2.0)  # the MIP's
