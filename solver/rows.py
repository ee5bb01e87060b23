"""The sharding ILP's columns and rows, written once for both backends.

The model is the one in solver/ilp.py's module docstring. ``build_rows`` writes it into a
``Sink``: the backend makes each column and returns its key (pulp: an ``LpVariable``;
solver/highs_direct.py: a column index) and takes each row as (key, coefficient) terms with
bounds, None standing for an infinite bound. Columns and rows come in one fixed order: the x
columns (nodes in order), one-hot rows, per kept edge its pair columns and link rows, the
checkpoint columns and rows (``_add_segments``), the transient column T and its rows, the memory
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

from solver.checkpointing import conflict_cliques
from solver.presolve import Reduced
from solver.problem import Problem, SegmentEdge

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
    seg = (
        _add_segments(problem, red, x, None if minimise_peak else pair, sink)
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


@dataclass(frozen=True, kw_only=True, slots=True)
class _SegmentRows(Generic[K]):
    memory: list[tuple[K, float]]
    """(column, bytes per unit) terms of the peak."""
    time: list[tuple[K, float]]
    """(column, seconds per unit) terms of the objective."""
    bits: tuple[tuple[tuple[K, int], ...], ...]


def _choice_terms(
    red: Reduced, x: dict[tuple[int, int], K], i: int, values: Sequence[float], scale: float
) -> tuple[Terms[K], float]:
    """(terms, constant) of sum_s values[s] x[i,s] / scale; only a constant when presolve left
    node i one strategy."""
    allowed = red.allowed[i]
    if len(allowed) == 1:
        return [], values[allowed[0]] / scale
    return [(x[i, s], values[s] / scale) for s in allowed if values[s]], 0.0


def _key(key: object) -> object:
    """A pair column's key as the sink made it (an int for a BulkSink's int64 arrays)."""
    return int(key) if isinstance(key, np.integer) else key


def _merged(terms: Terms[K]) -> Terms[K]:
    """Terms on one column summed (a row names each column once)."""
    out: dict[K, float] = {}
    for c, v in terms:
        out[c] = out.get(c, 0.0) + v
    return list(out.items())


def _segment_edge_terms(
    red: Reduced,
    x: dict[tuple[int, int], K],
    edge: SegmentEdge,
    scale: float,
    name: str,
    pair: dict[int, np.ndarray],
    pair_index: dict[tuple[int, int], int],
    sink: Sink[K],
) -> tuple[Terms[K], float]:
    """Forward seconds of a segment edge as (terms, constant): linear where one end is fixed;
    else through the model's pair columns e[k,g,h] where the forward cost is constant on each
    block; else one column z: with X_g (X_h) the indicator of the src (dst) strategies of row
    group g (column group h) of identical costs c[g][h],

        z >= sum_g c[g][h] X_g - M_h (1 - X_h)   for every h,  M_h = max_g c[g][h]

    is exactly z >= c[g*][h*] at the chosen pair (the other rows are <= 0), and z is pushed
    down by the recompute row it feeds. One column per edge, one row per column group."""
    if edge.src == edge.dst:
        diagonal = [edge.cost_s[s][s] for s in range(len(edge.cost_s))]
        return _choice_terms(red, x, edge.src, diagonal, scale)
    src_allowed, dst_allowed = red.allowed[edge.src], red.allowed[edge.dst]
    if len(src_allowed) == 1:
        row = [edge.cost_s[src_allowed[0]][t] for t in range(len(edge.cost_s[0]))]
        return _choice_terms(red, x, edge.dst, row, scale)
    if len(dst_allowed) == 1:
        column = [edge.cost_s[s][dst_allowed[0]] for s in range(len(edge.cost_s))]
        return _choice_terms(red, x, edge.src, column, scale)
    k = pair_index.get((min(edge.src, edge.dst), max(edge.src, edge.dst)))
    if k is not None:  # the model's pair columns, where the forward cost is constant per block
        kept = red.edges[k]
        flip = kept.src != edge.src
        terms: Terms[K] = []
        for g, h in zip(*np.nonzero(np.isfinite(kept.group_cost_s)), strict=True):
            values = {
                edge.cost_s[t][s] if flip else edge.cost_s[s][t]
                for s in kept.src_groups[g]
                for t in kept.dst_groups[h]
                if kept.allows(s, t)
            }
            if len(values) != 1:
                break
            if (value := values.pop()) > 0.0:
                terms.append((_key(pair[k][g, h]), value / scale))
        else:
            return terms, 0.0
    rows_of: dict[tuple, list[int]] = {}
    cols_of: dict[tuple, list[int]] = {}
    for s in src_allowed:
        rows_of.setdefault(tuple(edge.cost_s[s][t] for t in dst_allowed), []).append(s)
    for t in dst_allowed:
        cols_of.setdefault(tuple(edge.cost_s[s][t] for s in src_allowed), []).append(t)
    z = sink.column(f"{name}_z", 0.0, None)
    for h, dst_group in enumerate(cols_of.values()):
        costs = [(g, edge.cost_s[g[0]][dst_group[0]] / scale) for g in rows_of.values()]
        big = max(c for _, c in costs)
        if big <= 0.0:
            continue
        z_row: Terms[K] = [(z, 1.0)]
        for group, c in costs:  # both ends have two or more strategies here
            if c:
                z_row += [(x[edge.src, s], -c) for s in group]
        z_row += [(x[edge.dst, t], -big) for t in dst_group]
        sink.row(f"{name}_{h}", z_row, -big, None)
    return [(z, 1.0)], 0.0


def _add_segments(
    problem: Problem,
    red: Reduced,
    x: dict[tuple[int, int], K],
    pair: dict[int, np.ndarray] | None,
    sink: Sink[K],
) -> _SegmentRows[K]:
    """Checkpoint rows (solver/checkpointing.py). For segment k with L copies, bits b_j (j <
    bit_length(L)) give the copies recomputed r = sum 2^j b_j <= L, and per bit, exactly
    (A_k, T_k linear in x or through the pair and z columns; P the peak term):

        f_j <= A_k(x),  f_j <= M_A b_j,  P >= f_j        memory  -= 2^j f_j, += P
        t_j >= T_k(x) - M_T (1 - b_j),  t_j >= 0         time    += 2^j t_j

    Each clique C of overlapping segments: sum_{k in C} r_k lcm/L_k <= lcm (all L_k).
    Without ``pair`` (the minimum-peak model) the time rows are left out."""
    segments = problem.segments
    mem_scale = power_of_two_scale([b for seg in segments for row in seg.freed_bytes for b in row])
    time_scale = power_of_two_scale(
        [t for seg in segments for row in seg.recompute_s for t in row]
        + [c for seg in segments for e in seg.edges for row in e.cost_s for c in row]
    )
    peak = sink.column("ckpt_peak", 0.0, None)
    memory: Terms[K] = [(peak, mem_scale)]
    time_terms: Terms[K] = []
    all_bits = []
    pair_index = {(e.src, e.dst): k for k, e in enumerate(red.edges)}
    for k, seg in enumerate(segments):
        freed: Terms[K] = []
        freed_constant = 0.0
        for n, values in zip(seg.nodes, seg.freed_bytes):
            terms, constant = _choice_terms(red, x, n, values, mem_scale)
            freed += terms
            freed_constant += constant
        freed = _merged(freed)
        again: Terms[K] = []
        again_constant = 0.0
        if pair is not None:  # the minimum-peak model prices no time
            for n, values in zip(seg.nodes, seg.recompute_s):
                terms, constant = _choice_terms(red, x, n, values, time_scale)
                again += terms
                again_constant += constant
            for e, edge in enumerate(seg.edges):
                terms, constant = _segment_edge_terms(
                    red, x, edge, time_scale, f"ckpt_{k}_e{e}", pair, pair_index, sink
                )
                again += terms
                again_constant += constant
            again = _merged(again)  # a node's own and its edges' seconds share its columns
        big_freed = math.fsum(max(row) for row in seg.freed_bytes) / mem_scale
        big_time = (
            math.fsum(max(row) for row in seg.recompute_s)
            + math.fsum(max(max(row) for row in e.cost_s) for e in seg.edges)
        ) / time_scale
        bits = []
        for j in range(seg.copies.bit_length()):
            b = sink.column(f"ckpt_b_{k}_{j}", 0.0, 1.0, integer=True)
            f = sink.column(f"ckpt_f_{k}_{j}", 0.0, None)
            sink.row(
                f"ckpt_freed_{k}_{j}",
                [(f, 1.0), *((c, -v) for c, v in freed)],
                None,
                freed_constant,
            )
            sink.row(f"ckpt_on_{k}_{j}", [(f, 1.0), (b, -big_freed)], None, 0.0)
            sink.row(f"ckpt_peak_{k}_{j}", [(peak, 1.0), (f, -1.0)], 0.0, None)
            memory.append((f, -(2**j) * mem_scale))
            bits.append((b, 2**j))
            if pair is not None:
                t = sink.column(f"ckpt_t_{k}_{j}", 0.0, None)
                sink.row(
                    f"ckpt_time_{k}_{j}",
                    [(t, 1.0), *((c, -v) for c, v in again), (b, -big_time)],
                    -big_time + again_constant,
                    None,
                )
                time_terms.append((t, 2**j * time_scale))
        count = [(b, float(w)) for b, w in bits]
        if seg.copies < 2 ** len(bits) - 1:
            sink.row(f"ckpt_copies_{k}", count, None, float(seg.copies))
        if seg.min_copies:
            sink.row(f"ckpt_min_{k}", count, float(seg.min_copies), None)
        all_bits.append(tuple(bits))
    for c, clique in enumerate(conflict_cliques(segments)):
        lcm = math.lcm(*(segments[k].copies for k in clique))
        sink.row(
            f"ckpt_overlap_{c}",
            [(b, float(w * (lcm // segments[k].copies))) for k in clique for b, w in all_bits[k]],
            None,
            float(lcm),
        )
    return _SegmentRows(memory=memory, time=time_terms, bits=tuple(all_bits))
