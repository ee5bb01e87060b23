"""Tying, elimination and edge compression in the solver: exact against exhaustive search."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import (
    Edge,
    InfeasibleBudgetError,
    InfeasibleError,
    Node,
    Problem,
    brute_force,
    plan_objective_s,
    solve,
)
from solver.eliminate import back_substitute, eliminate
from solver.tying import contract


def agree(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


@st.composite
def layered_problems(draw: st.DrawFn) -> Problem:
    """A chain of 2-4 identical 2-node layers between an input node and an output node, with
    random extra edges, forbidden pairs and budgets; every layer's nodes are tied."""
    number = st.one_of(st.integers(0, 5).map(float), st.floats(0.0, 9.0, allow_nan=False))
    num_layers = draw(st.integers(2, 4))
    ka, kb = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    a_cost = tuple(draw(number) for _ in range(ka))
    b_cost = tuple(draw(number) for _ in range(kb))
    a_mem = tuple(float(draw(st.integers(0, 4))) for _ in range(ka))
    b_mem = tuple(float(draw(st.integers(0, 4))) for _ in range(kb))
    k_io = draw(st.integers(1, 3))
    cell = st.one_of(st.none(), number, number)
    ab = tuple(tuple(draw(cell) for _ in range(kb)) for _ in range(ka))
    ba = tuple(tuple(draw(cell) for _ in range(ka)) for _ in range(kb))
    nodes = [
        Node(name="in", cost_s=tuple(draw(number) for _ in range(k_io)), memory_bytes=(0.0,) * k_io)
    ]
    edges = []
    for layer in range(num_layers):
        a, b = len(nodes), len(nodes) + 1
        nodes.append(Node(name=f"a{layer}", cost_s=a_cost, memory_bytes=a_mem))
        nodes.append(Node(name=f"b{layer}", cost_s=b_cost, memory_bytes=b_mem))
        edges.append(Edge(src=a, dst=b, cost_s=ab))
        if layer:
            edges.append(Edge(src=a - 1, dst=a, cost_s=ba))
    first_in = tuple(tuple(draw(cell) for _ in range(ka)) for _ in range(k_io))
    edges.append(Edge(src=0, dst=1, cost_s=first_in))
    for _ in range(draw(st.integers(0, 2))):  # a skip edge breaks the chain structure
        u, v = sorted(
            draw(st.lists(st.integers(0, len(nodes) - 1), min_size=2, max_size=2, unique=True))
        )
        edges.append(
            Edge(
                src=u,
                dst=v,
                cost_s=tuple(
                    tuple(draw(cell) for _ in range(nodes[v].num_choices))
                    for _ in range(nodes[u].num_choices)
                ),
            )
        )
    tied = (
        tuple(1 + 2 * layer for layer in range(num_layers)),
        tuple(2 + 2 * layer for layer in range(num_layers)),
    )
    budget = draw(st.one_of(st.none(), st.integers(0, 20).map(float)))
    return Problem(nodes=tuple(nodes), edges=tuple(edges), memory_budget_bytes=budget, tied=tied)


def untied(problem: Problem) -> Problem:
    return Problem(
        nodes=problem.nodes,
        edges=problem.edges,
        memory_budget_bytes=problem.memory_budget_bytes,
        memory_offset_bytes=problem.memory_offset_bytes,
    )


def check(problem: Problem) -> None:
    """With a budget, tie classes choose alike and the optimum is the best tied plan. Without
    one, elimination first solves the chains exactly, untied, and ties what remains: the plan
    is no worse than the best tied plan and no better than the best plan at all."""
    free = problem.memory_budget_bytes is None
    try:
        best, objective = brute_force(problem)
    except InfeasibleBudgetError as expected:
        with pytest.raises(InfeasibleBudgetError) as caught:
            solve(problem)
        assert agree(caught.value.min_budget_bytes, expected.min_budget_bytes)
        return
    except InfeasibleError:
        try:
            brute_force(untied(problem))
        except InfeasibleError:
            with pytest.raises(InfeasibleError):
                solve(problem)
            return
        if free:  # elimination may find an untied plan where no tied one exists
            return
        with pytest.raises(InfeasibleError):
            solve(problem)
        return
    sol = solve(problem)
    assert sol.objective_s == plan_objective_s(problem, sol.choices)
    if free:
        lowest = brute_force(untied(problem))[1]
        assert sol.objective_s <= objective * (1 + 1e-6) + 1e-9
        assert sol.objective_s >= lowest * (1 - 1e-6) - 1e-9
    else:
        assert agree(sol.objective_s, objective), (sol.choices, best, objective)
        for members in problem.tied:
            assert len({sol.choices[i] for i in members}) == 1
        assert sol.peak_memory_bytes <= problem.memory_budget_bytes
    assert sol.bound_s <= sol.objective_s * (1 + 1e-9) + 1e-12


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layered_problems())
def test_tied_solve_matches_brute_force_over_tied_plans(problem: Problem) -> None:
    check(problem)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layered_problems())
def test_untied_budget_free_solve_with_elimination_matches_brute_force(problem: Problem) -> None:
    check(Problem(nodes=problem.nodes, edges=problem.edges))


def chain(num_nodes: int, k: int) -> Problem:
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(float((i * 7 + s * 3) % 5) for s in range(k)),
            memory_bytes=(1.0,) * k,
        )
        for i in range(num_nodes)
    )
    reshard = tuple(tuple(0.0 if s == t else 1.5 for t in range(k)) for s in range(k))
    edges = tuple(Edge(src=i, dst=i + 1, cost_s=reshard) for i in range(num_nodes - 1))
    return Problem(nodes=nodes, edges=edges)


def test_a_budget_free_chain_is_solved_by_elimination_alone() -> None:
    problem = chain(7, 3)
    elim = eliminate(problem)
    assert elim.kept == ()
    sol = solve(problem)
    assert sol.num_variables == 0 and sol.details["eliminated_nodes"] == 7.0
    assert back_substitute(elim, ()) == sol.choices
    assert agree(sol.objective_s, brute_force(problem)[1])


def test_a_budget_keeps_every_node_in_the_model() -> None:
    problem = chain(5, 3)
    budgeted = Problem(nodes=problem.nodes, edges=problem.edges, memory_budget_bytes=100.0)
    sol = solve(budgeted)
    assert "eliminated_nodes" not in sol.details and sol.num_variables > 0
    assert agree(sol.objective_s, brute_force(budgeted)[1])


def test_edge_compression_links_one_variable_per_block_of_identical_rows_and_columns() -> None:
    # 6 x 6 strategies but only 2 distinct output and 3 distinct input placements.
    rows = [0, 0, 0, 1, 1, 1]
    cols = [0, 1, 2, 0, 1, 2]
    base = ((0.0, 2.0, 5.0), (3.0, 0.0, None))
    matrix = tuple(tuple(base[rows[s]][cols[t]] for t in range(6)) for s in range(6))
    nodes = (
        Node(name="u", cost_s=(1.0, 1.1, 1.2, 1.3, 1.4, 1.5), memory_bytes=(1.0,) * 6),
        Node(name="v", cost_s=(2.0, 1.0, 0.5, 2.5, 1.5, 0.7), memory_bytes=(1.0,) * 6),
    )
    problem = Problem(
        nodes=nodes, edges=(Edge(src=0, dst=1, cost_s=matrix),), memory_budget_bytes=100.0
    )
    sol = solve(problem)
    # x: 6 + 6; pair blocks: 2 x 3 minus the forbidden one (instead of 36 - 12 pairs).
    assert sol.num_variables == 12 + 5 + 1  # + the transient variable of the memory row
    assert agree(sol.objective_s, brute_force(problem)[1])


def test_contracted_costs_and_bytes_are_the_members_sums() -> None:
    problem = Problem(
        nodes=(
            Node(name="a0", cost_s=(1.0, 2.0), memory_bytes=(3.0, 1.0), transient_bytes=(1.0, 5.0)),
            Node(name="a1", cost_s=(1.0, 2.0), memory_bytes=(3.0, 1.0), transient_bytes=(2.0, 4.0)),
            Node(name="x", cost_s=(0.0,), memory_bytes=(0.0,)),
        ),
        edges=(
            Edge(src=2, dst=0, cost_s=((0.5, 1.0),)),
            Edge(src=2, dst=1, cost_s=((0.5, 1.0),)),
        ),
        tied=((0, 1),),
    )
    contracted = contract(problem)
    merged = contracted.problem.nodes[0]
    assert merged.cost_s == (2.0, 4.0) and merged.memory_bytes == (6.0, 2.0)
    assert merged.transient_bytes == (2.0, 5.0)
    assert contracted.node_map == (0, 0, 1)
    assert contracted.problem.edges[0].cost_s == ((1.0,), (2.0,))  # two edges, summed


def test_tie_classes_must_be_disjoint_and_alike() -> None:
    nodes = (
        Node(name="a", cost_s=(1.0, 2.0), memory_bytes=(0.0, 0.0)),
        Node(name="b", cost_s=(1.0,), memory_bytes=(0.0,)),
    )
    with pytest.raises(ValueError, match="different numbers of strategies"):
        solve(Problem(nodes=nodes, tied=((0, 1),)))
    with pytest.raises(ValueError, match="merge them"):
        solve(Problem(nodes=nodes, tied=((0,), (0,))))
