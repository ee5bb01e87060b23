"""The budgeted path with tie classes and checkpoint segments: classes choose alike
(solver/alike.py, Problem.tied), and the plan, the bound and the brute-force optimum over
tie-consistent plans agree; priced_bound (what a ZeRO configuration is skipped on) likewise:
its plans made alike before they prove a problem feasible, its bound below the alike optimum."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import solver.segment_rows as segment_rows
from solver import Edge, Node, Problem, solve
from solver.alike import make_alike, splits
from solver.budgeted import priced_bound
from solver.errors import InfeasibleError
from solver.presolve import plan_objective_s, plan_peak_memory_bytes
from solver.problem import Segment, SegmentEdge
from tests.unit.test_budget_stops import assert_bounds_optimum
from tests.unit.test_count_patterns import layered_problems
from tests.unit.test_lagrangian import SETTINGS, _optimum, budgeted_problems

TOLERANCE = 1e-9


def _tied_with_segments(problem: Problem) -> bool:
    return bool(problem.tied and problem.segments)


@settings(SETTINGS, max_examples=30)
@given(
    st.one_of(budgeted_problems().filter(_tied_with_segments), layered_problems()),
    st.sampled_from([0.01, 0.05]),
)
def test_budgeted_plans_with_segments_keep_tie_classes_alike(problem, gap) -> None:
    # At main the Lagrangian relaxation's plans (budget-free elimination decides members one
    # by one) came back split, some below the tied optimum with that optimum as their "bound".
    optimum = _optimum(problem)
    if optimum is None:
        return
    found = solve(problem, gap=gap)
    assert not splits(problem, found.choices)
    scale = max(1.0, abs(optimum))
    assert found.objective_s >= optimum - TOLERANCE * scale
    assert found.bound_s <= optimum + TOLERANCE * scale
    assert found.objective_s - found.bound_s <= found.gap * abs(found.objective_s) + 1e-12
    assert found.gap <= gap + TOLERANCE or "mip_stopped" in found.details
    recomputed = found.recomputed
    assert plan_objective_s(problem, found.choices, recomputed) == found.objective_s
    budget = problem.memory_budget_bytes
    assert plan_peak_memory_bytes(problem, found.choices, recomputed) <= budget * (1 + 1e-12)


def test_make_alike_keeps_bytes_and_takes_the_cheaper_member_strategy() -> None:
    nodes = tuple(
        Node(name=f"n{i}", cost_s=(1.0, 3.0, 0.5), memory_bytes=(4.0, 2.0, 9.0)) for i in range(3)
    )
    problem = Problem(nodes=nodes, memory_budget_bytes=20.0, tied=((0, 1, 2),))
    # Members chose 0, 1, 1 (bytes 8): strategy 1 holds 6 bytes, 0 holds 12 (more), so 1 wins
    # though 0 is cheaper; strategy 2 is not a member's choice and is never offered.
    assert make_alike(problem, (0, 1, 1)) == (1, 1, 1)
    assert make_alike(problem, (0, 0, 0)) == (0, 0, 0)
    assert make_alike(problem, (0, 0, 1)) == (1, 1, 1)  # 10 bytes: 0 would hold 12


@settings(SETTINGS, max_examples=20)
@given(st.one_of(budgeted_problems().filter(_tied_with_segments), layered_problems()))
def test_the_defined_segment_rows_give_the_brute_force_optimum(problem) -> None:
    # Every segment through the defined columns a_k, tau_k, the big-M constants of the
    # strategies presolve left and the rows t_j >= T_min b_j (solver/segment_rows.py).
    optimum = _optimum(problem)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(segment_rows, "DEFINE_MIN_TERMS", 0)
            found = solve(problem, gap=0.0)
    except InfeasibleError:
        assert optimum is None
        return
    assert optimum is not None
    assert not splits(problem, found.choices)
    assert abs(found.objective_s - optimum) <= TOLERANCE * max(1.0, abs(optimum))


def test_a_layer_apart_does_not_forbid_the_other_layers_segments() -> None:
    # Two alike layers a -> b; each has a whole-layer segment (its input edge re-issued, so
    # the two stay apart) and a segment of b alone (alike: merged, 2 copies). The budget
    # needs bytes from both layers; the cheapest is layer 0 whole and layer 1's b. Merged,
    # the clique row 2 r_w0 + r_b <= 2 forbade that pair (4.0 s instead of 2.5 s).
    nodes = (Node(name="in", cost_s=(0.0,), memory_bytes=(0.0,)),) + tuple(
        Node(name=f"{n}{layer}", cost_s=(0.0,), memory_bytes=(10.0,))
        for layer in range(2)
        for n in "ab"
    )
    edges = tuple(Edge(src=i, dst=i + 1, cost_s=((0.0,),)) for i in range(4))
    segments = []
    for layer, (into, seconds) in enumerate(((0, 0.0), (2, 5.0))):
        a, b = 1 + 2 * layer, 2 + 2 * layer
        segments.append(
            Segment(
                name=f"w{layer}",
                nodes=(a, b),
                freed_bytes=((10.0,), (10.0,)),
                recompute_s=((0.0,), (0.5,)),
                edges=(SegmentEdge(src=into, dst=a, cost_s=((seconds,),)),),
            )
        )
        segments.append(
            Segment(name=f"b{layer}", nodes=(b,), freed_bytes=((10.0,),), recompute_s=((2.0,),))
        )
    problem = Problem(
        nodes=nodes,
        edges=edges,
        memory_budget_bytes=30.0,
        tied=((1, 3), (2, 4)),
        segments=tuple(segments),
    )
    assert _optimum(problem) == 2.5
    found = solve(problem, gap=0.0)
    assert found.objective_s == 2.5
    assert found.recomputed == (1, 0, 0, 1)


def _split_by_elimination() -> Problem:
    """Two tied leaves that budget-free elimination decides apart (each by its own edge)."""
    single = (0.0,)
    nodes = (
        Node(name="a", cost_s=single, memory_bytes=single),
        Node(name="b", cost_s=single, memory_bytes=single),
        Node(name="x", cost_s=(1.0, 1.0), memory_bytes=(1.0, 1.0)),
        Node(name="y", cost_s=(1.0, 1.0), memory_bytes=(1.0, 1.0)),
    )
    edges = (Edge(src=0, dst=2, cost_s=((0.0, 1.0),)), Edge(src=1, dst=3, cost_s=((1.0, 0.0),)))
    return Problem(nodes=nodes, edges=edges, memory_budget_bytes=10.0, tied=((2, 3),))


def test_a_split_priced_plan_made_alike_proves_the_problem_feasible() -> None:
    problem = _split_by_elimination()
    free = solve(dataclasses.replace(problem, memory_budget_bytes=None))
    assert splits(problem, free.choices)  # what the priced solves return here
    optimum = _optimum(problem)
    assert optimum == 3.0
    for lam in (0.0, 0.5):
        bound, fits = priced_bound(problem, lam)
        assert fits == 3.0  # before: None (the split plan was discarded), so not usable
        assert_bounds_optimum(optimum, bound, fits)


@settings(SETTINGS, max_examples=12)
@given(
    st.one_of(budgeted_problems().filter(lambda p: bool(p.tied)), layered_problems()),
    st.floats(0.0, 2.0),
    st.one_of(st.none(), st.floats(0.0, 2.0)),
)
def test_priced_bounds_of_tied_problems_hold_for_alike_plans(problem, lam, separable) -> None:
    # The brute-force optimum is over plans whose classes choose alike (solver/brute_force.py):
    # the bound is below it and a plan reported as fitting (made alike) costs at least it.
    optimum = _optimum(problem)
    target = None if separable is None else (optimum or 10.0)
    try:
        bound, fits = priced_bound(problem, lam, separable_multiplier=separable, target=target)
    except InfeasibleError:
        return
    assert_bounds_optimum(optimum, bound, fits)
