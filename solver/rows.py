"""The sharding ILP's columns and rows, written once for both backends.

The model is the one in solver/ilp.py's module docstring. ``build_rows`` writes it into a
``Sink``: the backend makes each column and returns its key (pulp: an ``LpVariable``;
solver/highs_direct.py: a column index) and takes each row as (key, coefficient) terms with
bounds, None standing for an infinite bound. Columns and rows come in one fixed order: the x
columns (nodes in order), one-hot rows, per kept edge its pair columns and link rows, the
checkpoint columns and rows (solver/segment_rows.py), the transient column T and its rows, the memory
row. The objective comes back as terms, divided by a power of two (exact) so that the solvers'
absolute tolerances act on numbers of order one.

A ``BulkSink`` (solver/highs_direct.py) also takes a block of columns and a CSR block of rows
in one call each: the edge links, most of the model (a pair column per allowed block of every
kept edge: 626k columns for llama3-70b on 8x16x8), are then written per edge with numpy from
presolve's group arrays, the same columns and rows in the same order with the same terms, and
their objective comes back as arrays (``Rows.objective_block``).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from solver.presolve import Reduced
from solver.problem import Problem

K = TypeVar("K", bound=Hashable)

Terms = list[tuple[K, float]]


class Sink(Protocol[K]):
    """Where the rows go: a backend's model under construction."""

    def column(self, name: str, lower: float, upper: float | None, *, integer: bool = False) -> K:
        """A new column with bounds (None: no upper bound); returns its key."""
        ...

    def row(
        self, name: str, terms: Sequence[tuple[K, float]], lower: float | None, upper: float | None
    ) -> None:
        """lower <= sum of terms <= upper (None: that side unbounded); no key twice in terms."""
        ...


@runtime_checkable
class BulkSink(Protocol):
    """A Sink whose columns are consecutive integers and that also takes blocks of them in
    bulk (solver/highs_direct.py): the edge links are then written with numpy, in the same
    order and with the same terms as one ``column``/``row`` call each."""

    def column_block(self, count: int, lower: float, upper: float, *, integer: bool = False) -> int:
        """``count`` new columns (continuous unless ``integer``); returns the first one's
        index."""
        ...

    def row_block(
        self, starts: np.ndarray, index: np.ndarray, value: np.ndarray, lower: float, upper: float
    ) -> None:
        """Rows in CSR form (``starts`` of each row into ``index``/``value``), all with the
        same bounds."""
        ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Rows(Generic[K]):
    """What decoding and the objective need from a built model."""

    x: dict[tuple[int, int], K]
    """(node, strategy) -> column, only for nodes with two or more allowed strategies."""
    objective: list[tuple[K, float]]
    """(column, coefficient) of the scaled objective; no column twice."""
    objective_block: tuple[np.ndarray, np.ndarray] | None = None
    """More of the objective for a BulkSink: (column indices, coefficients) of the edge pair
    columns, scaled, none of them in ``objective``."""
    objective_scale: float
    """Model objective times this is seconds (1.0 for the minimum-peak model: bytes)."""
    segment_bits: tuple[tuple[tuple[K, int], ...], ...] = ()
    """Per Problem.segments entry: (bit, weight) pairs whose sum is the copies recomputed."""


def power_of_two_scale(values: Sequence[float]) -> float:
    """A power of two near the largest magnitude, so dividing by it is exact."""
    largest = max((abs(v) for v in values), default=0.0)
    return (
        1.0
        if largest == 0.0 or not math.isfinite(largest)
        else math.ldexp(1.0, math.frexp(largest)[1])
    )


def build_rows(problem: Problem, red: Reduced, sink: Sink[K], *, minimise_peak: bool) -> Rows[K]:
    """The time model (with the budget row if any) or the minimum-peak model (no budget row;
    minimises M0 + sum m x + T, plus the checkpoint terms, in bytes)."""
    x: dict[tuple[int, int], K] = {}
    if isinstance(sink, BulkSink):
        x = _add_choices_bulk(red, sink)
    else:
        for i, choices in enumerate(red.allowed):
            if len(choices) > 1:
                for s in choices:
                    x[i, s] = sink.column(f"x_{i}_{s}", 0.0, 1.0, integer=True)
        for i, choices in enumerate(red.allowed):
            if len(choices) > 1:
                sink.row(f"onehot_{i}", [(x[i, s], 1.0) for s in choices], 1.0, 1.0)
    edges = (  # edges whose pairs are all allowed cannot change the peak
        [k for k, e in enumerate(red.edges) if not e.all_pairs_allowed]
        if minimise_peak
        else range(len(red.edges))
    )
    pair = _add_edge_links(red, x, edges, sink)
    from solver.segment_rows import add_segments  # it imports this module's Sink

    seg = (
        add_segments(problem, red, x, None if minimise_peak else pair, sink)
        if problem.segments
        else None
    )
    seg_memory = seg.memory if seg else []
    budget = problem.memory_budget_bytes
    peak: Terms[K] = []
    if minimise_peak or budget is not None:
        peak = _add_memory(problem, red, x, None if minimise_peak else budget, seg_memory, sink)
    bits = seg.bits if seg else ()
    if minimise_peak:
        return Rows(x=x, objective=peak, objective_scale=1.0, segment_bits=bits)
    terms = [
        (x[i, s], c)
        for i, costs in enumerate(red.node_cost_s)
        if len(costs) > 1
        for s, c in costs.items()
    ]
    # The pair columns of each edge, in creation order (row-major over the allowed blocks).
    pair_keys = [keys[np.isfinite(red.edges[k].group_cost_s)] for k, keys in pair.items()]
    pair_costs = [red.edges[k].group_cost_s[np.isfinite(red.edges[k].group_cost_s)] for k in pair]
    bulk = isinstance(sink, BulkSink)
    if not bulk:
        terms += [(v, float(c)) for ks, cs in zip(pair_keys, pair_costs) for v, c in zip(ks, cs)]
    seg_time = seg.time if seg else []
    largest_pair = max((float(np.abs(cs).max()) for cs in pair_costs if len(cs)), default=0.0)
    scale = power_of_two_scale(
        [c for _, c in terms] + [c for _, c in seg_time] + ([largest_pair] if bulk else [])
    )
    terms += seg_time
    block = None
    if bulk:
        keys = np.concatenate([np.zeros(0, dtype=np.int64), *pair_keys])
        costs = np.concatenate([np.zeros(0), *pair_costs]) / scale
        block = (keys[costs != 0.0], costs[costs != 0.0])
    return Rows(
        x=x,
        objective=[(v, c / scale) for v, c in terms if c],
        objective_block=block,
        objective_scale=scale,
        segment_bits=bits,
    )


def _add_choices_bulk(red: Reduced, sink: BulkSink) -> dict[tuple[int, int], int]:
    """The x columns and one-hot rows for a BulkSink: one integer column block for every
    node with two or more strategies (nodes in order, strategies ascending) and one CSR
    block of their one-hot rows, the columns and rows one ``column``/``row`` call each would
    make (a priced solve of llama-8l-2048 makes about 900 x columns)."""
    multi = [choices for choices in red.allowed if len(choices) > 1]
    nodes = [i for i, choices in enumerate(red.allowed) if len(choices) > 1]
    sizes = np.array([len(choices) for choices in multi], dtype=np.int64)
    total = int(sizes.sum())
    first = sink.column_block(total, 0.0, 1.0, integer=True)
    columns = range(first, first + total)
    keys = [(i, s) for i, choices in zip(nodes, multi) for s in choices]
    if total:
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        sink.row_block(starts, np.arange(first, first + total), np.ones(total), 1.0, 1.0)
    return dict(zip(keys, columns, strict=True))


def _add_edge_links(
    red: Reduced, x: dict[tuple[int, int], K], edges: Sequence[int], sink: Sink[K]
) -> dict[int, np.ndarray]:
    """Alpa's linearization over grouped strategies. Returns, per edge k, the array of its
    pair columns e[k,g,h] over its (src group, dst group) blocks: int64 with -1 at forbidden
    blocks for a BulkSink, else an object array with None there."""
    if isinstance(sink, BulkSink):
        return _add_edge_links_bulk(red, x, edges, sink)
    pair: dict[int, np.ndarray] = {}
    for k in edges:
        edge = red.edges[k]
        by_src: list[Terms[K]] = [
            [(x[edge.src, s], -1.0) for s in group] for group in edge.src_groups
        ]
        by_dst: list[Terms[K]] = [
            [(x[edge.dst, t], -1.0) for t in group] for group in edge.dst_groups
        ]
        keys = np.full(edge.group_cost_s.shape, None, dtype=object)
        for g, h in zip(*np.nonzero(np.isfinite(edge.group_cost_s)), strict=True):
            var = sink.column(f"e_{k}_{g}_{h}", 0.0, 1.0)
            keys[g, h] = var
            by_src[g].append((var, 1.0))
            by_dst[h].append((var, 1.0))
        pair[k] = keys
        for family, rows in (("src", by_src), ("dst", by_dst)):
            for g, terms in enumerate(rows):
                sink.row(f"{family}_{k}_{g}", terms, 0.0, 0.0)
    return pair


def _add_edge_links_bulk(
    red: Reduced, x: dict[tuple[int, int], int], edges: Sequence[int], sink: BulkSink
) -> dict[int, np.ndarray]:
    """_add_edge_links for a BulkSink: the same columns and rows (same order, same terms in
    each row) written as one block of columns and two blocks of rows per edge."""
    x_col: dict[int, np.ndarray] = {}  # node -> column per strategy (-1: no column)

    def columns_of(node: int) -> np.ndarray:
        cols = x_col.get(node)
        if cols is None:
            choices = red.allowed[node]
            cols = x_col[node] = np.full(max(choices) + 1, -1, dtype=np.int64)
            cols[list(choices)] = [x[node, s] for s in choices]
        return cols

    pair: dict[int, np.ndarray] = {}
    for k in edges:
        edge = red.edges[k]
        g_of, h_of = np.nonzero(np.isfinite(edge.group_cost_s))  # row-major: sorted blocks
        first = sink.column_block(len(g_of), 0.0, 1.0)
        cols = np.arange(first, first + len(g_of), dtype=np.int64)
        keys = np.full(edge.group_cost_s.shape, -1, dtype=np.int64)
        keys[g_of, h_of] = cols
        pair[k] = keys
        for members, starts, node, side in (
            (edge.src_members, edge.src_starts, edge.src, g_of),
            (edge.dst_members, edge.dst_starts, edge.dst, h_of),
        ):
            _link_rows(sink, members, starts, columns_of(node), side, cols)
    return pair


def _link_rows(
    sink: BulkSink,
    members: np.ndarray,
    starts: np.ndarray,
    x_cols: np.ndarray,
    block_group: np.ndarray,
    block_cols: np.ndarray,
) -> None:
    """One row per group g (``members[starts[g]:starts[g + 1]]``, presolve.PairEdge): -x of
    g's strategies (in group order), then +e of the blocks of group g (ascending column):
    sum e = sum x."""
    num_groups = len(starts) - 1
    member_group = np.repeat(np.arange(num_groups), np.diff(starts))
    row = np.concatenate([member_group, block_group])
    part = np.concatenate([np.zeros(len(members), np.int8), np.ones(len(block_cols), np.int8)])
    index = np.concatenate([x_cols[members], block_cols])
    order = np.lexsort((np.arange(len(index)), part, row))  # stable within a row
    value = np.concatenate([np.full(len(members), -1.0), np.ones(len(block_cols))])
    row_starts = np.searchsorted(row[order], np.arange(num_groups))
    sink.row_block(row_starts, index[order], value[order], 0.0, 0.0)


def _add_memory(
    problem: Problem,
    red: Reduced,
    x: dict[tuple[int, int], K],
    budget: float | None,
    extra: Sequence[tuple[K, float]],
    sink: Sink[K],
) -> Terms[K]:
    """Transient rows and (with a budget) the memory row; returns the scaled peak terms.
    ``extra`` adds (column, bytes per unit) terms to the peak (checkpoint segments)."""
    nodes = problem.nodes
    scale = power_of_two_scale(
        [problem.memory_offset_bytes, budget or 0.0]
        + [c for _, c in extra]
        + [b for n in nodes for b in n.memory_bytes]
        + [b for n in nodes for b in n.transient_bytes]
    )
    fixed_bytes = problem.memory_offset_bytes
    fixed_transient = 0.0
    resident: Terms[K] = []
    for i, choices in enumerate(red.allowed):
        node = nodes[i]
        if len(choices) == 1:
            fixed_bytes += node.memory_bytes[choices[0]]
        else:
            resident += [
                (x[i, s], node.memory_bytes[s] / scale) for s in choices if node.memory_bytes[s]
            ]
        transients = [node.transient_bytes[s] for s in choices] if node.transient_bytes else []
        if len(set(transients)) == 1:  # the same whatever the choice: a lower bound on T
            fixed_transient = max(fixed_transient, transients[0])
    transient = sink.column("transient", fixed_transient / scale, None)
    for i, choices in enumerate(red.allowed):
        node = nodes[i]
        transients = [node.transient_bytes[s] for s in choices] if node.transient_bytes else []
        if len(choices) > 1 and len(set(transients)) > 1:
            terms = [(x[i, s], -b / scale) for s, b in zip(choices, transients) if b]
            sink.row(f"transient_{i}", [(transient, 1.0), *terms], 0.0, None)
    peak = [*resident, (transient, 1.0), *((v, c / scale) for v, c in extra)]
    if budget is not None:
        sink.row("memory", peak, None, (budget - fixed_bytes) / scale)
    return peak
