"""A budget-free model is solved as its linear relaxation first (solver/highs_direct.py): an
integral relaxation is the MIP's answer, proven; a fractional one falls back to the MIP."""

from __future__ import annotations

import dataclasses
import random

import pytest

from solver import Edge, Node, Problem, brute_force, highs_direct
from solver.presolve import reduce_problem

pytestmark = pytest.mark.skipif(highs_direct.highspy is None, reason="needs highspy")


def _model(problem: Problem, *, relaxation_first: bool) -> highs_direct.DirectModel:
    model = highs_direct.build(problem, reduce_problem(problem), minimise_peak=False)
    return model if relaxation_first else dataclasses.replace(model, integer_columns=None)


def _run(model: highs_direct.DirectModel) -> highs_direct.DirectOutcome:
    return highs_direct.run(model, time_limit_s=None, gap=0.0, abs_gap=None, msg=False)


def _triangle() -> Problem:
    """Three nodes that each want to differ from the other two: no 2-colouring of a triangle
    does, so the best plan pays 1, while the relaxation pays 0 at one half everywhere."""
    nodes = tuple(Node(name=f"n{i}", cost_s=(0.0, 0.0), memory_bytes=(0.0, 0.0)) for i in range(3))
    same = ((1.0, 0.0), (0.0, 1.0))
    edges = tuple(Edge(src=a, dst=b, cost_s=same) for a, b in ((0, 1), (1, 2), (0, 2)))
    return Problem(nodes=nodes, edges=edges)


def _random_layout_problem(seed: int) -> Problem:
    """A chain with skip edges, costs like a layout model's (diagonal cheap, conversions not)."""
    rng = random.Random(seed)
    k = 4
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(rng.uniform(0, 3) for _ in range(k)),
            memory_bytes=(0.0,) * k,
        )
        for i in range(6)
    )
    pairs = [(i, i + 1) for i in range(5)] + [(i, i + 2) for i in range(0, 4, 2)]
    edges = tuple(
        Edge(
            src=a,
            dst=b,
            cost_s=tuple(
                tuple(0.0 if s == t else rng.uniform(0.5, 2) for t in range(k)) for s in range(k)
            ),
        )
        for a, b in pairs
    )
    return Problem(nodes=nodes, edges=edges)


def test_an_integral_relaxation_is_the_mips_answer() -> None:
    integral = 0
    for seed in range(6):
        problem = _random_layout_problem(seed)
        first = _model(problem, relaxation_first=True)
        assert first.integer_columns is not None
        relaxed = highs_direct._integral_relaxation(first.highs, first.integer_columns)
        mip = _run(_model(problem, relaxation_first=False))
        _, best = brute_force(problem)
        red = reduce_problem(problem)
        mip_choices = highs_direct.decode(red, first, mip.values)
        if relaxed is not None:  # integral: the MIP's plan, proven
            integral += 1
            assert relaxed.status == "optimal"
            assert highs_direct.decode(red, first, relaxed.values) == mip_choices
            assert relaxed.bound == pytest.approx(mip.bound, rel=1e-9, abs=1e-12)
        outcome = _run(_model(problem, relaxation_first=True))
        assert highs_direct.decode(red, first, outcome.values) == mip_choices
        assert outcome.status == "optimal"
        assert outcome.bound * first.objective_scale == pytest.approx(best, rel=1e-6, abs=1e-9)
    assert integral >= 3  # layout-like models mostly have integral relaxations


def test_a_fractional_relaxation_falls_back_to_the_mip() -> None:
    problem = _triangle()
    model = _model(problem, relaxation_first=True)
    assert highs_direct._integral_relaxation(model.highs, model.integer_columns) is None
    outcome = _run(_model(problem, relaxation_first=True))
    red = reduce_problem(problem)
    choices = highs_direct.decode(red, model, outcome.values)
    assert outcome.status == "optimal"
    assert brute_force(problem)[1] == 1.0
    assert sum(1.0 for a, b in ((0, 1), (1, 2), (0, 2)) if choices[a] == choices[b]) == 1.0


def test_budgeted_models_and_models_with_segments_run_the_mip_directly() -> None:
    problem = dataclasses.replace(_random_layout_problem(0), memory_budget_bytes=1.0)
    assert _model(problem, relaxation_first=True).integer_columns is None
