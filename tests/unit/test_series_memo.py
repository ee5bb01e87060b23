"""Series products shared across a sequence of budget-free solves (eliminate.SolveMemo, as the
relaxation's priced solves share them) give the same solutions as solving each alone."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import solver.eliminate
from solver import Edge, InfeasibleError, Node, Problem, solve
from solver.eliminate import SolveMemo, eliminate
from solver.prune import prune
from tests.unit.test_prune import cores, prune_everything  # noqa: F401 (a fixture)


@st.composite
def pattern_sequences(draw: st.DrawFn) -> list[Problem]:
    """A core (what elimination leaves) with a chain of two nodes hung between its first two
    nodes (series eliminations), then variants that add terms to a few nodes, as recompute
    patterns add theirs to the pattern-free priced problem (some variants repeat)."""
    core = draw(cores())
    a, b = core.nodes[0], core.nodes[1]
    k = 3
    chain = [
        Node(
            name=f"c{j}",
            cost_s=tuple(draw(st.integers(0, 3).map(float)) for _ in range(k)),
            memory_bytes=(0.0,) * k,
        )
        for j in range(2)
    ]
    n = len(core.nodes)

    def edge(src: int, dst: int, rows: int, cols: int) -> Edge:
        flat = draw(
            st.lists(st.integers(0, 3).map(float), min_size=rows * cols, max_size=rows * cols)
        )
        return Edge(
            src=src,
            dst=dst,
            cost_s=tuple(tuple(flat[r * cols : (r + 1) * cols]) for r in range(rows)),
        )

    base = Problem(
        nodes=(*core.nodes, *chain),
        edges=(
            *core.edges,
            edge(0, n, a.num_choices, k),
            edge(n, n + 1, k, k),
            edge(n + 1, 1, k, b.num_choices),
        ),
    )
    out = [base]
    for _ in range(draw(st.integers(2, 4))):
        touched = draw(st.sets(st.integers(0, n + 1), max_size=2))
        nodes = list(base.nodes)
        for i in touched:
            extra = draw(st.integers(1, 2))
            nodes[i] = dataclasses.replace(
                nodes[i], cost_s=tuple(c + extra for c in nodes[i].cost_s)
            )
        out.append(dataclasses.replace(base, nodes=tuple(nodes)))
    return out


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(pattern_sequences())
def test_shared_products_solve_as_each_alone(prune_everything, problems) -> None:  # noqa: F811
    memo = SolveMemo()
    for problem in problems:
        assert _outcome(problem, memo) == _outcome(problem, None)
        try:
            want = eliminate(problem)
        except InfeasibleError:
            continue
        reduced = eliminate(problem, memo.eliminate)
        assert reduced.problem == want.problem and reduced.constant_s == want.constant_s
        core = want.problem
        if core.edges and not core.tied:
            assert prune(core, memo.prune) == prune(core)


def _outcome(problem: Problem, memo: SolveMemo | None) -> tuple | str:
    try:
        out = solve(problem, memo=memo)
    except InfeasibleError as error:
        return str(error)
    return out.choices, out.objective_s, out.bound_s


def _count_products(monkeypatch) -> list:
    """The shapes of the series products formed from now on (solver.eliminate.series_min
    wrapped for the test)."""
    formed = []
    original = solver.eliminate.series_min

    def counted(uv, cv, vw):
        formed.append(uv.shape)
        return original(uv, cv, vw)

    monkeypatch.setattr(solver.eliminate, "series_min", counted)
    return formed


def test_a_repeated_solve_forms_no_product_again(prune_everything, monkeypatch) -> None:  # noqa: F811
    """The second of two equal solves takes every product from the memo."""
    formed = _count_products(monkeypatch)
    table = tuple(tuple(float((s + t) % 3) for t in range(3)) for s in range(3))
    nodes = tuple(
        Node(name=f"n{i}", cost_s=(float(i % 2), 1.0, 2.0), memory_bytes=(0.0,) * 3)
        for i in range(6)
    )
    pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3), (0, 4), (4, 5), (5, 1)]
    problem = Problem(nodes=nodes, edges=tuple(Edge(src=u, dst=v, cost_s=table) for u, v in pairs))
    memo = SolveMemo()
    first = solve(problem, memo=memo)
    assert formed
    formed.clear()
    again = solve(problem, memo=memo)
    assert not formed
    assert (again.choices, again.objective_s, again.bound_s) == (
        first.choices,
        first.objective_s,
        first.bound_s,
    )


def test_a_memo_keeps_its_generations_products_and_no_older(monkeypatch) -> None:
    """A SeriesMemo of g generations takes a product formed g - 1 solves before from the memo
    (the very result, bit for bit the product formed again) and forms it again after g
    solves without it; the default SolveMemo keeps PRUNE_GENERATIONS for pruning."""
    import numpy as np

    formed = _count_products(monkeypatch)
    uv = np.array([[0.0, 1.0, -0.0], [2.0, 0.5, 1.0]])
    cv = np.array([0.0, -0.0, 1.0])
    vw = np.array([[1.0, 0.0], [0.0, -0.0], [3.0, 1.0]])
    other = (uv + 1.0, cv, vw)
    for generations in (2, 3, 5):
        memo = solver.eliminate.SeriesMemo(generations)
        first, _ = memo.series(uv, cv, vw)
        for _ in range(generations - 1):  # solves that form other products only
            memo.next_generation()
            memo.series(*other)
        formed.clear()
        again, _ = memo.series(uv.copy(), cv.copy(), vw.copy())
        assert not formed and again is first
        for _ in range(generations):
            memo.next_generation()
            memo.series(*other)
        formed.clear()
        late, _ = memo.series(uv.copy(), cv.copy(), vw.copy())
        assert formed and late is not first and late.tobytes() == first.tobytes()
    assert SolveMemo().prune._generations == solver.eliminate.PRUNE_GENERATIONS
