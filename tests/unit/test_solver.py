"""The ILP against hand-worked answers and against exhaustive search (solver/ is torch-free)."""

from __future__ import annotations

import math
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pulp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import (
    Edge,
    InfeasibleBudgetError,
    InfeasibleError,
    Node,
    Problem,
    SolverTimeoutError,
    brute_force,
    plan_objective_s,
    plan_peak_memory_bytes,
    solve,
)

REL_TOL = 1e-6
ABS_TOL = 1e-9
BACKENDS = ["highs", "cbc"]


def node(
    name: str,
    cost: tuple[float, ...],
    memory: tuple[float, ...] | None = None,
    transient: tuple[float, ...] = (),
) -> Node:
    return Node(
        name=name, cost_s=cost, memory_bytes=memory or (0.0,) * len(cost), transient_bytes=transient
    )


def agree(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


# ---------------------------------------------------------------- hand-worked answers


@pytest.mark.parametrize("backend", BACKENDS)
def test_resharding_cost_forces_a_consistent_chain(backend: str) -> None:
    # Alone, the middle node prefers strategy 1 (saves 1 s), but switching costs 5 s per edge.
    nodes = (node("a", (1.0, 3.0)), node("b", (2.0, 1.0)), node("c", (1.0, 3.0)))
    reshard = ((0.0, 5.0), (5.0, 0.0))
    problem = Problem(
        nodes=nodes, edges=(Edge(src=0, dst=1, cost_s=reshard), Edge(src=1, dst=2, cost_s=reshard))
    )
    sol = solve(problem, backend=backend)
    assert sol.choices == (0, 0, 0)
    assert sol.objective_s == 4.0
    assert sol.status == "optimal" and sol.gap == 0.0 and agree(sol.bound_s, 4.0)
    assert sol.backend == backend


@pytest.mark.parametrize("backend", BACKENDS)
def test_forbidden_pair_is_never_chosen(backend: str) -> None:
    nodes = (node("a", (0.0, 5.0)), node("b", (0.0, 2.0)))
    edge = Edge(src=0, dst=1, cost_s=((None, 0.5), (0.0, 0.0)))
    sol = solve(Problem(nodes=nodes, edges=(edge,)), backend=backend)
    assert sol.choices == (0, 1)  # (0, 0) would cost 0 but is forbidden
    assert sol.objective_s == 2.5


@pytest.mark.parametrize("backend", BACKENDS)
def test_budget_forces_the_more_expensive_strategy(backend: str) -> None:
    nodes = (node("a", (1.0, 2.0), (10.0, 4.0)), node("b", (1.0, 1.5), (10.0, 4.0)))
    free = solve(Problem(nodes=nodes), backend=backend)
    assert free.choices == (0, 0) and free.peak_memory_bytes == 20.0
    tight = solve(Problem(nodes=nodes, memory_budget_bytes=15.0), backend=backend)
    assert tight.choices == (0, 1)  # cheaper of the two ways to drop 6 bytes
    assert tight.objective_s == 2.5 and tight.peak_memory_bytes == 14.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_transient_memory_counts_the_largest_not_the_sum(backend: str) -> None:
    # Strategy 0 is cheap with 60 transient bytes; two of them fit a 100-byte budget only if
    # transients are counted as a maximum (they are never alive together).
    nodes = (
        node("a", (1.0, 5.0), (0.0, 0.0), (60.0, 0.0)),
        node("b", (1.0, 5.0), (0.0, 0.0), (60.0, 0.0)),
    )
    sol = solve(
        Problem(nodes=nodes, memory_budget_bytes=100.0, memory_offset_bytes=30.0), backend=backend
    )
    assert sol.choices == (0, 0)
    assert sol.peak_memory_bytes == 90.0
    # 30 offset + 60 transient > 80: both must drop their transient.
    tight = solve(
        Problem(nodes=nodes, memory_budget_bytes=80.0, memory_offset_bytes=30.0), backend=backend
    )
    assert tight.choices == (1, 1) and tight.peak_memory_bytes == 30.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_too_small_budget_reports_the_smallest_that_fits(backend: str) -> None:
    nodes = (
        node("a", (1.0, 2.0), (10.0, 4.0), (0.0, 7.0)),
        node("b", (1.0, 2.0), (10.0, 5.0)),
    )
    problem = Problem(nodes=nodes, memory_budget_bytes=12.0, memory_offset_bytes=1.0)
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(problem, backend=backend)
    assert caught.value.min_budget_bytes == 16.0  # offset 1 + 10 + 5, versus 1 + 4 + 5 + 7
    assert caught.value.proven and "16 bytes" in str(caught.value)
    assert isinstance(caught.value, ValueError)
    with pytest.raises(InfeasibleBudgetError) as oracle:
        brute_force(problem)
    assert oracle.value.min_budget_bytes == 16.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_edges_that_forbid_everything_are_structural_not_budget(backend: str) -> None:
    # Three nodes that must pairwise differ with two strategies each: no arc is inconsistent on
    # its own, so only the ILP finds out.
    nodes = tuple(node(n, (1.0, 1.0), (1.0, 1.0)) for n in "abc")
    differ = ((None, 0.0), (0.0, None))
    edges = tuple(Edge(src=s, dst=d, cost_s=differ) for s, d in ((0, 1), (1, 2), (0, 2)))
    for budget in (None, 100.0, 0.5):
        problem = Problem(nodes=nodes, edges=edges, memory_budget_bytes=budget)
        with pytest.raises(InfeasibleError) as caught:
            solve(problem, backend=backend)
        assert not isinstance(caught.value, InfeasibleBudgetError)
    with pytest.raises(InfeasibleError, match="no strategy left"):
        solve(
            Problem(
                nodes=nodes[:2], edges=(Edge(src=0, dst=1, cost_s=((None, None), (None, None))),)
            ),
            backend=backend,
        )


@pytest.mark.parametrize("backend", BACKENDS)
def test_parallel_and_reversed_edges_add_up(backend: str) -> None:
    nodes = (node("a", (0.0, 0.0)), node("b", (0.0, 0.0)), node("c", (0.0, 1.0, 2.0)))
    self_loop = ((1.0, 0.0, 0.0), (0.0, 5.0, 0.0), (0.0, 0.0, None))  # only the diagonal counts
    edges = (
        Edge(src=0, dst=1, cost_s=((3.0, 0.0), (0.5, 3.0))),
        Edge(src=1, dst=0, cost_s=((0.0, 2.0), (7.0, 0.0))),  # a=0, b=1 reads [1][0] = 7
        Edge(src=0, dst=1, cost_s=((None, 1.0), (1.0, 1.0))),
        Edge(src=2, dst=2, cost_s=self_loop),
    )
    problem = Problem(nodes=nodes, edges=edges)
    sol = solve(problem, backend=backend)
    best, objective = brute_force(problem)
    # (a, b): (0, 1) costs 0 + 7 + 1, (1, 0) costs 0.5 + 2 + 1, (1, 1) 3 + 0 + 1; c=0 pays 1.
    assert sol.choices == best == (1, 0, 0)
    assert sol.objective_s == objective == 3.5 + 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_the_lowest_strategy_index_every_time(backend: str) -> None:
    nodes = tuple(node(f"n{i}", (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)) for i in range(5))
    flat = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    diagonal = ((0.0, 1.0, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 0.0))
    edges = (
        Edge(src=0, dst=1, cost_s=flat),
        Edge(src=1, dst=2, cost_s=diagonal),
        Edge(src=2, dst=4, cost_s=diagonal),
    )
    problem = Problem(nodes=nodes, edges=edges, memory_budget_bytes=10.0)
    first = solve(problem, backend=backend)
    assert first.choices == (0, 0, 0, 0, 0)
    assert solve(problem, backend=backend).choices == first.choices
    assert first.details["presolved_edges"] == 1.0  # the flat edge is a constant


def test_fixed_nodes_need_no_variables() -> None:
    nodes = (node("a", (2.0,), (3.0,), (4.0,)), node("b", (1.0,), (3.0,)))
    problem = Problem(nodes=nodes, edges=(Edge(src=0, dst=1, cost_s=((0.5,),)),))
    sol = solve(problem)
    assert sol.choices == (0, 0) and sol.objective_s == 3.5 and sol.peak_memory_bytes == 10.0
    assert sol.num_variables == 0 and sol.bound_s == 3.5
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(Problem(nodes=nodes, memory_budget_bytes=9.0))
    assert caught.value.min_budget_bytes == 10.0


def test_bad_input_is_refused_with_the_fix() -> None:
    nodes = (node("a", (1.0, 2.0)), node("b", (1.0,)))
    with pytest.raises(ValueError, match="2 x 1"):
        solve(Problem(nodes=nodes, edges=(Edge(src=0, dst=1, cost_s=((0.0, 0.0),)),)))
    with pytest.raises(ValueError, match="out of range"):
        solve(Problem(nodes=nodes, edges=(Edge(src=0, dst=2, cost_s=((0.0,), (0.0,))),)))
    with pytest.raises(ValueError, match="highs, cbc"):
        solve(Problem(nodes=nodes), backend="gurobi")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gap_still_returns_a_plan_within_it(backend: str) -> None:
    nodes = tuple(node(f"n{i}", (1.0 + i % 3, 2.0, 1.5 + i % 2)) for i in range(10))
    reshard = ((0.0, 1.0, 1.0), (1.0, 0.0, 1.0), (1.0, 1.0, 0.0))
    problem = Problem(
        nodes=nodes, edges=tuple(Edge(src=i, dst=i + 1, cost_s=reshard) for i in range(9))
    )
    sol = solve(problem, backend=backend, gap=0.05)
    assert sol.status == "optimal" and sol.gap <= 0.05
    assert sol.bound_s <= sol.objective_s == plan_objective_s(problem, sol.choices)
    assert sol.objective_s <= brute_force(problem)[1] * 1.05


def test_a_time_limit_gives_a_plan_with_a_bound_or_says_it_found_none() -> None:
    # Random costs and a binding memory row: too hard to prove optimal in 0.2 s on a busy CPU,
    # so either outcome is allowed; both must be well formed.
    rng = random.Random(0)
    nodes = tuple(
        node(
            f"n{i}",
            tuple(rng.uniform(1.0, 9.0) for _ in range(6)),
            tuple(float(rng.randint(1, 50)) for _ in range(6)),
        )
        for i in range(150)
    )
    edges = tuple(
        Edge(
            src=i,
            dst=i + 1,
            cost_s=tuple(
                tuple(0.0 if s == t else rng.uniform(1.0, 20.0) for t in range(6)) for s in range(6)
            ),
        )
        for i in range(149)
    )
    budget = sum(sum(n.memory_bytes) / 6 for n in nodes)
    problem = Problem(nodes=nodes, edges=edges, memory_budget_bytes=budget)
    try:
        sol = solve(problem, time_limit_s=0.2)
    except SolverTimeoutError as error:
        assert "raise time_limit_s" in str(error)
        return
    assert sol.status in ("feasible", "optimal")
    assert sol.bound_s <= sol.objective_s == plan_objective_s(problem, sol.choices)
    assert sol.peak_memory_bytes <= budget and 0.0 <= sol.gap


def test_missing_highs_falls_back_to_cbc_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pulp.HiGHS, "available", lambda self: False)
    sol = solve(Problem(nodes=(node("a", (2.0, 1.0)),)), backend="highs")
    assert sol.backend == "cbc" and sol.details["highs_unavailable"] == 1.0
    assert sol.choices == (1,)


def test_solver_imports_neither_torch_nor_autopar() -> None:
    code = "import sys, solver; assert not {'torch', 'autopar'} & set(sys.modules), sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


def test_brute_force_refuses_huge_problems() -> None:
    nodes = tuple(node(f"n{i}", (1.0,) * 8) for i in range(7))
    with pytest.raises(ValueError, match="too many"):
        brute_force(Problem(nodes=nodes))


def test_budget_error_survives_pickling() -> None:
    error = InfeasibleBudgetError(min_budget_bytes=3.0, budget_bytes=2.0)
    copy = pickle.loads(pickle.dumps(error))
    assert copy.min_budget_bytes == 3.0 and str(copy) == str(error)


# ---------------------------------------------------------------- against brute force


@st.composite
def problems(draw: st.DrawFn) -> Problem:
    """2-6 nodes, 1-4 strategies, DAG edges (parallel ones too), None entries, budgets."""
    cost_unit = draw(st.sampled_from([1.0, 1e-6, 1e3]))
    byte_unit = draw(st.sampled_from([1.0, 2.0**30]))
    # Small integers make ties and exactly-met budgets common; floats exercise rounding.
    number = st.one_of(st.integers(0, 6).map(float), st.floats(0.0, 10.0, allow_nan=False))
    num_nodes = draw(st.integers(2, 6))
    nodes = []
    for i in range(num_nodes):
        k = draw(st.integers(1, 4))
        with_transient = draw(st.booleans())
        nodes.append(
            Node(
                name=f"n{i} :-[x]",  # names are not identifiers
                cost_s=tuple(draw(number) * cost_unit for _ in range(k)),
                memory_bytes=tuple(draw(st.integers(0, 8)) * byte_unit for _ in range(k)),
                transient_bytes=tuple(draw(st.integers(0, 12)) * byte_unit for _ in range(k))
                if with_transient
                else (),
            )
        )
    pairs = st.lists(st.integers(0, num_nodes - 1), min_size=2, max_size=2, unique=True).map(sorted)
    cell = st.one_of(
        st.none(), number.map(lambda c: c * cost_unit), number.map(lambda c: c * cost_unit)
    )
    edges = tuple(
        Edge(
            src=src,
            dst=dst,
            cost_s=tuple(
                tuple(draw(cell) for _ in range(nodes[dst].num_choices))
                for _ in range(nodes[src].num_choices)
            ),
        )
        for src, dst in draw(st.lists(pairs, max_size=7))
    )
    offset = draw(st.integers(0, 4)) * byte_unit
    budget = draw(st.one_of(st.none(), st.integers(0, 40).map(lambda b: b * byte_unit)))
    return Problem(
        nodes=tuple(nodes), edges=edges, memory_budget_bytes=budget, memory_offset_bytes=offset
    )


def check_against_brute_force(problem: Problem, backend: str) -> None:
    try:
        best, objective = brute_force(problem)
    except InfeasibleBudgetError as expected:
        with pytest.raises(InfeasibleBudgetError) as caught:
            solve(problem, backend=backend)
        assert agree(caught.value.min_budget_bytes, expected.min_budget_bytes)
        return
    except InfeasibleError:
        with pytest.raises(InfeasibleError) as caught:
            solve(problem, backend=backend)
        assert not isinstance(caught.value, InfeasibleBudgetError)
        return
    sol = solve(problem, backend=backend)
    assert sol.status == "optimal"
    assert agree(sol.objective_s, objective), (sol, best, objective)
    assert sol.objective_s == plan_objective_s(problem, sol.choices)  # raises on a forbidden pair
    assert sol.peak_memory_bytes == plan_peak_memory_bytes(problem, sol.choices)
    if problem.memory_budget_bytes is not None:
        assert sol.peak_memory_bytes <= problem.memory_budget_bytes
    assert sol.bound_s <= sol.objective_s and sol.gap <= REL_TOL


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_highs_matches_brute_force(problem: Problem) -> None:
    check_against_brute_force(problem, "highs")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_cbc_matches_brute_force(problem: Problem) -> None:
    check_against_brute_force(problem, "cbc")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_same_problem_same_choices(problem: Problem) -> None:
    try:
        first = solve(problem)
    except InfeasibleError:
        return
    assert solve(problem).choices == first.choices
