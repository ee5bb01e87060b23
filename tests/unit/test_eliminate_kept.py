"""Elimination's reduced problem, built with numpy (eliminate._kept_nodes and the edge tables),
equals the one-by-one construction it replaced, and the budget-free solve through it (ties
included) equals brute force; forbidden pairs make leaf elimination leave infinite costs, so
nodes that keep only some of their strategies are covered."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import Edge, Node, Problem, solve
from solver.brute_force import brute_force
from solver.eliminate import eliminate
from solver.errors import InfeasibleError
from tests.unit.test_solver import problems

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def reference_nodes(problem: Problem, elim) -> list:
    """The reduced nodes read one strategy at a time (the construction before numpy)."""
    out = []
    for k, i in enumerate(elim.kept):
        node, finite = problem.nodes[i], elim.strategies[k]
        out.append(
            (
                tuple(node.memory_bytes[s] for s in finite),
                tuple(node.transient_bytes[s] for s in finite) if node.transient_bytes else (),
            )
        )
    return out


@SETTINGS
@given(problems(), st.booleans())
def test_reduced_problem_and_budget_free_optimum_match_brute_force(problem, tie) -> None:
    problem = dataclasses.replace(problem, memory_budget_bytes=None)
    if tie:  # tie the first two nodes when they offer as many strategies
        a, b = problem.nodes[:2]
        if a.num_choices == b.num_choices:
            problem = dataclasses.replace(problem, tied=((0, 1),))
    try:
        elim = eliminate(problem)
    except InfeasibleError:
        return
    for k, (node, (memory, transient)) in enumerate(
        zip(elim.problem.nodes, reference_nodes(problem, elim), strict=True)
    ):
        assert node.memory_bytes == memory and node.transient_bytes == transient
        assert all(type(c) is float and np.isfinite(c) for c in node.cost_s)
        assert len(node.cost_s) == len(elim.strategies[k])
    if problem.tied:
        return  # budget-free ties are solved relaxed (eliminated members untied)
    try:
        _, objective = brute_force(problem)
    except InfeasibleError:
        return
    sol = solve(problem)
    assert abs(sol.objective_s - objective) <= 1e-9 * max(1.0, abs(objective))


@st.composite
def cores_with_a_leaf(draw: st.DrawFn) -> Problem:
    """A K4 core (never eliminated) whose node 0 has a leaf forbidding some of its
    strategies outright (whole rows None), so that node keeps only some of them; bytes are
    distinct per strategy, so a wrong index shows."""
    number = st.integers(0, 9).map(float)
    sizes = [draw(st.integers(2, 4)) for _ in range(5)]
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(draw(number) for _ in range(k)),
            memory_bytes=tuple(float(10 * i + s) for s in range(k)),
            transient_bytes=tuple(float(100 * i + s) for s in range(k)),
        )
        for i, k in enumerate(sizes)
    )
    edges = [
        Edge(
            src=a,
            dst=b,
            cost_s=tuple(tuple(draw(number) for _ in range(sizes[b])) for _ in range(sizes[a])),
        )
        for a in range(4)
        for b in range(a + 1, 4)
    ]
    banned = draw(st.sets(st.integers(0, sizes[0] - 1), min_size=1, max_size=sizes[0] - 1))
    edges.append(
        Edge(
            src=0,
            dst=4,
            cost_s=tuple(
                tuple(None if s in banned else draw(number) for _ in range(sizes[4]))
                for s in range(sizes[0])
            ),
        )
    )
    return Problem(nodes=nodes, edges=tuple(edges))


@SETTINGS
@given(cores_with_a_leaf())
def test_a_core_node_keeping_some_strategies_keeps_their_bytes(problem) -> None:
    elim = eliminate(problem)
    assert (
        0 in elim.kept and len(elim.strategies[elim.kept.index(0)]) < problem.nodes[0].num_choices
    )
    for node, (memory, transient) in zip(
        elim.problem.nodes, reference_nodes(problem, elim), strict=True
    ):
        assert node.memory_bytes == memory and node.transient_bytes == transient
    _, objective = brute_force(problem)
    sol = solve(problem)
    assert abs(sol.objective_s - objective) <= 1e-9 * max(1.0, abs(objective))
