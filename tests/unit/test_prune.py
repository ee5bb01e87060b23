"""Pruning by bounds (solver/prune.py) is exact: every optimal plan survives, against exhaustive
enumeration; and solve() with pruning on at every size still finds the brute-force optimum."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solver.prune
import solver.shrink
from solver import Edge, InfeasibleError, Node, Problem, brute_force, plan_objective_s, solve
from solver.lagrangian import priced
from solver.prune import prune
from tests.unit.test_lagrangian import budgeted_problems
from tests.unit.test_tying import check, layered_problems

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    # prune_everything's monkeypatch is meant to hold for every example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)


@st.composite
def cores(draw: st.DrawFn) -> Problem:
    """What elimination leaves: 4-6 nodes of 2-4 strategies, each pair of nodes joined with
    probability 2/3 (complete graphs, K4 minors: no node of degree <= 2), small integer or
    real costs (ties are common) and some forbidden pairs."""
    num = draw(st.integers(4, 6))
    number = st.one_of(st.integers(0, 4).map(float), st.floats(0.0, 9.0, allow_nan=False))
    cell = st.one_of(number, number, number, st.none()) if draw(st.booleans()) else number
    nodes = []
    for i in range(num):
        k = draw(st.integers(2, 4))
        nodes.append(
            Node(
                name=f"n{i}", cost_s=tuple(draw(number) for _ in range(k)), memory_bytes=(0.0,) * k
            )
        )
    edges = []
    for u, v in itertools.combinations(range(num), 2):
        if draw(st.integers(0, 2)):
            table = tuple(
                tuple(draw(cell) for _ in range(nodes[v].num_choices))
                for _ in range(nodes[u].num_choices)
            )
            edges.append(Edge(src=u, dst=v, cost_s=table))
    return Problem(nodes=tuple(nodes), edges=tuple(edges))


@st.composite
def cores_with_tails(draw: st.DrawFn) -> Problem:
    """A core (test_prune.cores) with 1-3 more nodes, each joined to one or two earlier
    ones: their leaf and series messages reach nodes that are split later."""
    core = draw(cores())
    nodes, edges = list(core.nodes), list(core.edges)
    number = st.integers(0, 6).map(float)
    for _ in range(draw(st.integers(1, 3))):
        new = len(nodes)
        k = draw(st.integers(1, 3))
        nodes.append(
            Node(
                name=f"t{new}",
                cost_s=tuple(draw(number) for _ in range(k)),
                memory_bytes=(0.0,) * k,
            )
        )
        ends = draw(st.lists(st.integers(0, new - 1), min_size=1, max_size=2, unique=True))
        for u in ends:
            table = tuple(
                tuple(draw(number) for _ in range(k)) for _ in range(nodes[u].num_choices)
            )
            edges.append(Edge(src=u, dst=new, cost_s=table))
    return Problem(nodes=tuple(nodes), edges=tuple(edges))


def every_plan(problem: Problem) -> list[tuple[tuple[int, ...], float]]:
    """Each allowed plan and its exact cost."""
    out = []
    for plan in itertools.product(*(range(n.num_choices) for n in problem.nodes)):
        try:
            out.append((plan, plan_objective_s(problem, plan)))
        except InfeasibleError:
            continue
    return out


@pytest.mark.parametrize("method", ["one-pass", "pinned"])
@SETTINGS
@given(problem=st.one_of(cores(), cores_with_tails()))
def test_pruning_keeps_every_optimal_plan_and_brackets_the_optimum(
    prune_everything, method: str, problem: Problem
) -> None:
    plans = every_plan(problem)
    if not plans:
        return
    optimum = min(cost for _, cost in plans)
    tolerance = 1e-9 * max(1.0, abs(optimum))
    pruned = prune(problem, method=method)
    if pruned is None:
        return
    assert pruned.lower_s <= optimum + tolerance <= pruned.upper_s + 2 * tolerance
    assert math.isclose(plan_objective_s(problem, pruned.upper_plan), pruned.upper_s)
    for plan, cost in plans:
        if cost <= optimum + tolerance:
            assert all(c in k for c, k in zip(plan, pruned.keep, strict=True)), plan
    assert brute_force(pruned.problem)[1] == pytest.approx(optimum, rel=1e-9, abs=1e-9)


def test_a_k4_core_is_pruned_to_its_optimum() -> None:
    """Four nodes joined pairwise (no node elimination can remove), 6 strategies each: a
    resharding-like table (0 on the diagonal, 1 elsewhere) and node costs that make strategy
    0 the best everywhere; the relaxation proves every other strategy worse than the plan."""
    k = 6
    table = tuple(tuple(0.0 if s == t else 1.0 for t in range(k)) for s in range(k))
    nodes = tuple(
        Node(name=f"n{i}", cost_s=(0.0,) + (3.0,) * (k - 1), memory_bytes=(0.0,) * k)
        for i in range(4)
    )
    edges = tuple(Edge(src=u, dst=v, cost_s=table) for u, v in itertools.combinations(range(4), 2))
    problem = Problem(nodes=nodes, edges=edges)
    pruned = prune(problem)
    assert pruned is not None and pruned.keep == ((0,),) * 4
    assert pruned.upper_s == pruned.lower_s == 0.0


@pytest.fixture
def prune_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prune every budget-free core, however small, and never give up (the threshold and the
    give-up rule are speed trade-offs, not what makes pruning exact)."""
    monkeypatch.setattr(solver.shrink, "PRUNE_MIN_ENTRIES", -1)
    monkeypatch.setattr(solver.prune, "GIVE_UP_KEPT", 1.0)


def test_pruning_gives_up_when_the_first_bound_drops_little() -> None:
    """Every strategy alike: the first node keeps all of them, so nothing is pruned (None)."""
    table = ((1.0, 1.0), (1.0, 1.0))
    nodes = tuple(Node(name=f"n{i}", cost_s=(1.0, 1.0), memory_bytes=(0.0, 0.0)) for i in range(4))
    edges = tuple(Edge(src=u, dst=v, cost_s=table) for u, v in itertools.combinations(range(4), 2))
    assert prune(Problem(nodes=nodes, edges=edges)) is None


@SETTINGS
@given(cores())
def test_solve_with_pruning_matches_brute_force(prune_everything, problem: Problem) -> None:
    try:
        _, optimum = brute_force(problem)
    except InfeasibleError:
        with pytest.raises(InfeasibleError):
            solve(problem)
        return
    sol = solve(problem)
    assert sol.objective_s == pytest.approx(optimum, rel=1e-9, abs=1e-9)
    assert sol.objective_s == plan_objective_s(problem, sol.choices)
    assert sol.bound_s <= sol.objective_s and sol.gap == 0.0


@settings(SETTINGS, max_examples=30)
@given(layered_problems())
def test_tied_layers_with_pruning_are_bracketed_as_before(prune_everything, problem) -> None:
    """Tie classes, with and without a budget (test_tying's checks, pruning on)."""
    check(problem)


@SETTINGS
@given(budgeted_problems(), st.floats(0.0, 2.0))
def test_priced_problems_with_pruning_match_brute_force(prune_everything, problem, scale) -> None:
    """The Lagrangian relaxation's budget-free problems (ties, checkpoint segments priced into
    the nodes) are where pruning runs under a budget: exact there."""
    free = priced(problem, scale * 0.5)
    try:
        _, optimum = brute_force(free)
    except InfeasibleError:
        return
    sol = solve(free)
    assert sol.objective_s <= optimum + 1e-9 * max(1.0, abs(optimum))  # elimination may untie
    assert sol.bound_s <= sol.objective_s


@SETTINGS
@given(budgeted_problems(), st.sampled_from([0.0, 0.01]))
def test_budgeted_solve_with_pruning_fits_within_its_gap(prune_everything, problem, gap) -> None:
    try:
        _, optimum = brute_force(problem)
    except InfeasibleError:
        return
    try:
        sol = solve(problem, gap=gap)
    except InfeasibleError:  # only plans whose tied nodes differ fit: counts may say none
        return
    tolerance = 1e-9 * max(1.0, abs(optimum))
    assert sol.peak_memory_bytes <= problem.memory_budget_bytes + 1e-9
    assert sol.bound_s <= optimum + tolerance
    assert sol.objective_s * (1 - gap) <= optimum + tolerance
    if gap == 0.0:
        assert sol.objective_s == pytest.approx(optimum, rel=1e-9, abs=1e-9)
