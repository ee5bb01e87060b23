"""Per-pattern lower bounds kept from the last pattern evaluation (solver/pattern_bounds.py
keep_lowers, kept_floors): on another problem with the very same segments object (another
ZeRO configuration), at the same multiplier and patterns, they bound each of its pattern
problems' optima from below; the pattern D found with them is the one found afresh; the same
problem evaluated again, or another multiplier or segments object, takes nothing."""

from __future__ import annotations

import dataclasses
import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import pattern_bounds
from solver.errors import InfeasibleError
from solver.lagrangian import pattern_dual, priced, recompute_patterns
from solver.pattern_bounds import kept_floors, pattern_problem, pattern_terms
from solver.problem import Edge, Node, Problem, Segment
from solver.shrink import solve
from tests.unit.test_lagrangian import _free_solver, budgeted_problems

SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)


def _other_costs(problem: Problem, data: st.DataObject) -> Problem:
    """``problem`` with other node seconds and bytes on some nodes (the same segments object,
    edges and tie classes): what another ZeRO configuration changes."""
    costs = st.floats(0.0, 10.0, allow_nan=False)
    sizes = st.floats(0.0, 100.0, allow_nan=False)
    nodes = []
    for n in problem.nodes:
        if data.draw(st.booleans()):
            n = dataclasses.replace(
                n,
                cost_s=tuple(data.draw(costs) for _ in n.cost_s),
                memory_bytes=tuple(data.draw(sizes) for _ in n.memory_bytes),
            )
        nodes.append(n)
    return dataclasses.replace(problem, nodes=tuple(nodes))


def _exact(problem: Problem, stop_above: float | None = None) -> tuple:
    """An exact priced solve (a solve may stop above ``stop_above``; this one never does)."""
    return _free_solver(problem)


def _pattern_optimum(problem: Problem, lam: float, pattern: tuple[int, ...]) -> float:
    base = priced(dataclasses.replace(problem, segments=()), lam)
    _, _, extra, extra_edges = pattern_terms(problem, lam, pattern)
    try:
        return solve(pattern_problem(base, extra, extra_edges), gap=0.0).objective_s
    except InfeasibleError:
        return math.inf


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0), st.data())
def test_kept_floors_bound_every_pattern_of_another_problem(problem, lam, data):
    patterns = recompute_patterns(problem)
    if not patterns:
        return
    other = _other_costs(problem, data)
    pattern_bounds.forget_table()
    try:
        pattern_dual(problem, lam, _exact, patterns, cache={}, stop_early=True)
    except InfeasibleError:  # the edges forbid every plan, whatever the costs
        return
    base = priced(dataclasses.replace(other, segments=()), lam)
    floors = kept_floors(other, base, lam, patterns)
    if base == priced(dataclasses.replace(problem, segments=()), lam):
        assert floors is None  # the same priced problem again: nothing taken
        return
    assert floors is not None
    for floor, pattern in zip(floors, patterns, strict=True):
        optimum = _pattern_optimum(other, lam, pattern)
        assert floor <= optimum + 1e-9 * max(1.0, abs(optimum))
    # The pattern D with them is the one found afresh.
    kept = pattern_dual(other, lam, _exact, patterns, cache={}, stop_early=True)
    pattern_bounds.forget_table()
    fresh = pattern_dual(other, lam, _exact, patterns, cache={}, stop_early=True)
    assert math.isclose(kept.lower, fresh.lower, rel_tol=1e-9, abs_tol=1e-9)


def _layers(shift: float, seed: int = 3) -> Problem:
    """A chain of five nodes (three strategies each, seconds and bytes drawn from ``seed``),
    one segment over the middle three recomputable up to four times; ``shift`` added to the
    first node's seconds (the node another configuration prices otherwise). Seed 3 at
    multiplier 0.3 is one where the kept bounds spare a pattern solve (found by search)."""
    rng = random.Random(seed)
    width = 3

    def row(low: float, high: float) -> tuple[float, ...]:
        return tuple(round(rng.uniform(low, high), 1) for _ in range(width))

    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(v + (shift if i == 0 else 0.0) for v in row(0.0, 5.0)),
            memory_bytes=tuple(float(rng.randint(1, 10)) for _ in range(width)),
        )
        for i in range(5)
    )
    edges = tuple(
        Edge(src=i, dst=i + 1, cost_s=tuple(row(0.0, 3.0) for _ in range(width))) for i in range(4)
    )
    segment = Segment(
        name="s",
        nodes=(1, 2, 3),
        freed_bytes=tuple(tuple(float(rng.randint(0, 8)) for _ in range(width)) for _ in range(3)),
        recompute_s=tuple(row(0.0, 2.0) for _ in range(3)),
        copies=4,
    )
    return Problem(nodes=nodes, edges=edges, memory_budget_bytes=20.0, segments=(segment,))


def test_another_configuration_solves_fewer_patterns_for_the_same_bound():
    problem = _layers(0.0)
    other = dataclasses.replace(_layers(0.05), segments=problem.segments)
    patterns = recompute_patterns(problem)
    lam = 0.3
    solved: list[Problem] = []

    def counting(p: Problem, *stop: float) -> tuple[tuple[int, ...], float, float]:
        solved.append(p)
        return _free_solver(p)

    pattern_bounds.forget_table()
    pattern_dual(problem, lam, counting, patterns, cache={})
    solved.clear()
    kept = pattern_dual(other, lam, counting, patterns, cache={})
    with_kept = len(solved)
    pattern_bounds.forget_table()
    solved.clear()
    fresh = pattern_dual(other, lam, counting, patterns, cache={})
    assert with_kept < len(solved)
    assert math.isclose(kept.lower, fresh.lower, rel_tol=1e-12)
    assert math.isclose(kept.lower, min(_pattern_optimum(other, lam, p) for p in patterns))


def test_nothing_is_taken_at_another_multiplier_or_for_other_segments():
    problem = _layers(0.0)
    other = dataclasses.replace(_layers(0.05), segments=problem.segments)
    patterns = recompute_patterns(problem)
    pattern_bounds.forget_table()
    pattern_dual(problem, 0.05, _free_solver, patterns, cache={})

    def base(p: Problem, lam: float) -> Problem:
        return priced(dataclasses.replace(p, segments=()), lam)

    assert kept_floors(other, base(other, 0.05), 0.05, patterns) is not None
    assert kept_floors(other, base(other, 0.06), 0.06, patterns) is None
    apart = _layers(0.05)  # equal segments, another object
    assert kept_floors(apart, base(apart, 0.05), 0.05, patterns) is None
    assert kept_floors(problem, base(problem, 0.05), 0.05, patterns) is None  # itself again
    pattern_bounds.forget_table()
    assert kept_floors(other, base(other, 0.05), 0.05, patterns) is None
