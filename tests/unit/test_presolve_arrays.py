"""Array presolve and bulk model building (solver/presolve.py, solver/rows.py) against their
definitions: dominance found in one pass equals the sequential search, equal-row groups equal
the dict grouping (a kept edge's group arrays hold group_pairs' groups), and the bulk HiGHS
writer builds the model that one call per column and row builds."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import highs_direct
from solver.presolve import _dominated_rows, _line_groups, group_pairs, reduce_problem
from solver.problem import Edge, Node, Problem, Segment, SegmentEdge
from solver.rows import BulkSink, build_rows

VALUES = st.sampled_from([0.0, -0.0, 0.5, 1.0, 2.0, np.inf])


def _sequential_dominated(features: np.ndarray) -> set[int]:
    """The definition, row by row: another live row is <= everywhere and (< somewhere or
    earlier)."""
    dead: set[int] = set()
    for k in range(len(features)):
        for j in range(len(features)):
            if j == k or j in dead:
                continue
            if np.all(features[j] <= features[k]) and (np.any(features[j] < features[k]) or j < k):
                dead.add(k)
                break
    return dead


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 7).flatmap(
        lambda rows: st.integers(1, 9).flatmap(
            lambda cols: st.lists(
                st.lists(VALUES, min_size=cols, max_size=cols), min_size=rows, max_size=rows
            )
        )
    )
)
def test_dominated_rows_match_the_sequential_definition(table: list[list[float]]) -> None:
    features = np.array(table, dtype=np.float64)
    assert set(np.flatnonzero(_dominated_rows(features)).tolist()) == _sequential_dominated(
        features
    )


def test_line_groups_treat_signed_zeros_and_infinities_as_equal() -> None:
    matrix = np.array([[0.0, np.inf], [-0.0, np.inf], [0.0, 1.0], [0.0, np.inf]])
    labels, first = _line_groups(matrix)
    assert labels.tolist() == [0, 0, 1, 0] and first == [0, 2]


class _RecordingSink:
    """A plain Sink (one call per column and row) with integer keys."""

    def __init__(self) -> None:
        self.bounds: list[tuple[float, float | None, bool]] = []
        self.rows: list[tuple[list[tuple[int, float]], float | None, float | None]] = []

    def column(self, name: str, lower: float, upper: float | None, *, integer: bool = False) -> int:
        self.bounds.append((lower, upper, integer))
        return len(self.bounds) - 1

    def row(self, name, terms, lower, upper) -> None:
        self.rows.append(([(int(c), v) for c, v in terms], lower, upper))


def _problem(seed: int) -> Problem:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(2, 7, size=5)
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(rng.choice([0.0, 1.0, 2.0], size=n).tolist()),
            memory_bytes=tuple(rng.choice([1.0, 2.0, 4.0], size=n).tolist()),
        )
        for i, n in enumerate(sizes)
    )
    edges = []
    for u, v in ((0, 1), (1, 2), (2, 3), (3, 4), (0, 4), (2, 0)):
        placement_src = rng.integers(0, 3, size=sizes[u])  # few distinct rows and columns
        placement_dst = rng.integers(0, 3, size=sizes[v])
        price = rng.choice([0.0, 0.5, 1.0, 3.0, None], size=(3, 3))
        edges.append(
            Edge(
                src=u,
                dst=v,
                cost_s=tuple(
                    tuple(price[a, b] for b in placement_dst) for a in placement_src.tolist()
                ),
            )
        )
    segment = Segment(
        name="s",
        nodes=(1, 2),
        freed_bytes=(tuple([1.0] * sizes[1]), tuple([2.0] * sizes[2])),
        recompute_s=(tuple([0.1] * sizes[1]), tuple([0.2] * sizes[2])),
        edges=(
            SegmentEdge(
                src=1,
                dst=2,
                cost_s=tuple(
                    tuple(0.0 if c is None else c for c in row) for row in edges[1].cost_s
                ),
            ),
        ),
    )
    return Problem(
        nodes=nodes,
        edges=tuple(edges),
        memory_budget_bytes=14.0 if seed % 2 else None,
        segments=(segment,) if seed % 3 == 0 else (),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.booleans())
def test_bulk_edge_links_build_the_model_of_one_call_per_row(seed: int, peak: bool) -> None:
    problem = _problem(seed)
    try:
        red = reduce_problem(problem)
    except ValueError:  # forbidden pairs left a node nothing: nothing to build
        return
    plain = _RecordingSink()
    assert not isinstance(plain, BulkSink)
    rows = build_rows(problem, red, plain, minimise_peak=peak)
    bulk = highs_direct._HighsSink()
    assert isinstance(bulk, BulkSink)
    bulk_rows = build_rows(problem, red, bulk, minimise_peak=peak)
    assert bulk.num_cols == len(plain.bounds) and bulk.num_rows == len(plain.rows)
    inf = highs_direct.highspy.kHighsInf
    joined = highs_direct._joined  # concatenation that allows an empty model
    lower = joined(bulk.col_lower, np.float64)
    upper = joined(bulk.col_upper, np.float64)
    assert lower.tolist() == [b[0] for b in plain.bounds]
    assert upper.tolist() == [inf if b[1] is None else b[1] for b in plain.bounds]
    assert bulk.integer == [c for c, b in enumerate(plain.bounds) if b[2]]
    starts = np.concatenate([*bulk.starts, [bulk.num_nonzeros]])
    index, value = joined(bulk.index, np.int64), joined(bulk.value, np.float64)
    row_lower, row_upper = joined(bulk.row_lower, np.float64), joined(bulk.row_upper, np.float64)
    for r, (terms, lo, hi) in enumerate(plain.rows):
        span = slice(starts[r], starts[r + 1])
        assert list(zip(index[span].tolist(), value[span].tolist(), strict=True)) == terms
        assert row_lower[r] == (-inf if lo is None else lo)
        assert row_upper[r] == (inf if hi is None else hi)
    dense_plain = np.zeros(bulk.num_cols)
    for c, v in rows.objective:
        dense_plain[c] += v
    dense_bulk = np.zeros(bulk.num_cols)
    for c, v in bulk_rows.objective:
        dense_bulk[c] += v
    if bulk_rows.objective_block is not None:
        np.add.at(dense_bulk, *bulk_rows.objective_block)
    assert dense_bulk.tolist() == dense_plain.tolist()
    assert bulk_rows.objective_scale == rows.objective_scale


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000))
def test_kept_edges_group_strategies_as_the_dict_grouping(seed: int) -> None:
    """PairEdge's group arrays (members in group order, group starts) hold the groups that
    group_pairs finds by identical rows and columns: in order of first appearance, each
    ascending, with the same block costs."""
    problem = _problem(seed)
    try:
        red = reduce_problem(problem)
    except ValueError:  # forbidden pairs left a node nothing
        return
    for edge in red.edges:
        rows, cols = red.allowed[edge.src], red.allowed[edge.dst]
        pairs = {
            (s, t): float(edge.cost_s[s, t])
            for s in rows
            for t in cols
            if np.isfinite(edge.cost_s[s, t])
        }
        src_groups, dst_groups, block_cost = group_pairs(list(rows), list(cols), pairs)
        assert edge.src_groups == src_groups
        assert edge.dst_groups == dst_groups
        assert edge.src_starts[-1] == len(rows) and edge.dst_starts[-1] == len(cols)
        finite = np.isfinite(edge.group_cost_s)
        assert {(int(g), int(h)) for g, h in zip(*np.nonzero(finite))} == set(block_cost)
        for (g, h), cost in block_cost.items():
            assert edge.group_cost_s[g, h] == cost
