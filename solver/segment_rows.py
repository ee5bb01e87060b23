"""The checkpoint columns and rows of the sharding ILP (solver/rows.py ``build_rows`` calls
``add_segments``; the model is solver/checkpointing.py's, the rows are listed in
``add_segments``'s docstring).

Large segment rows are written through defined columns. A segment of L copies gets
bit_length(L) bits, and each bit had its own copy of the segment's freed-bytes row A_k(x) and
recompute-seconds row T_k(x): on the llama3-70b b256 bf16 row's fixed MIP (105 contracted
nodes, 6 merged segments of up to 80 copies, 71 nodes each with their edges' pair columns)
that was 5.2 million nonzeros in 9,000 rows, and HiGHS's branch and bound ran out of 8 GB.
Where the repeated terms would be many (:data:`DEFINE_MIN_TERMS`), one column a_k = A_k(x)
and one tau_k = T_k(x) are defined by one row each and the bits' rows name them instead: the
same model (a_k, tau_k are fixed by x), its LP the same, with terms + bits nonzeros instead of
terms x bits. Those rows also get the big-M constants from the strategies presolve left
(not from every strategy) and the valid rows t_j >= T_min b_j (a recomputed copy costs at
least the segment's cheapest seconds), which only cut LP points: the integer points are the
same. Small models (every stored plan's) are written as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic

import numpy as np

from solver.checkpointing import conflict_cliques
from solver.presolve import Reduced
from solver.problem import Problem, SegmentEdge
from solver.rows import K, Sink, Terms, power_of_two_scale

DEFINE_MIN_TERMS = 20_000
"""A segment whose bits would repeat at least this many terms (terms x bits, its freed and
its time rows) gets the defined columns a_k, tau_k (module docstring)."""


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


def add_segments(
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
        low_time = 0.0
        if (len(freed) + len(again)) * seg.copies.bit_length() >= DEFINE_MIN_TERMS:
            freed, freed_constant = _defined(sink, f"ckpt_a_{k}", freed, freed_constant)
            big_freed, low_time, big_time = _allowed_bounds(seg, red, mem_scale, time_scale)
            if pair is not None:
                again, again_constant = _defined(sink, f"ckpt_tau_{k}", again, again_constant)
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
                if low_time > 0.0:  # a recomputed copy costs at least its cheapest seconds
                    sink.row(f"ckpt_least_{k}_{j}", [(t, 1.0), (b, -low_time)], 0.0, None)
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


def _defined(sink: Sink[K], name: str, terms: Terms[K], constant: float) -> tuple[Terms[K], float]:
    """One column c = constant + sum of ``terms`` (its columns are >= 0 and those with a
    negative coefficient, x and pair columns, <= 1: hence its lower bound), as (terms,
    constant) naming c alone."""
    lower = constant + math.fsum(min(0.0, v) for _, v in terms)
    column = sink.column(name, lower, None)
    sink.row(name, [(column, 1.0), *((c, -v) for c, v in terms)], constant, constant)
    return [(column, 1.0)], 0.0


def _allowed_bounds(
    seg, red: Reduced, mem_scale: float, time_scale: float
) -> tuple[float, float, float]:
    """(largest freed bytes, smallest and largest recompute seconds) of one copy of ``seg``
    over the strategies presolve left (scaled): the big-M constants and T_min."""
    allowed = red.allowed
    big_freed = math.fsum(
        max(row[s] for s in allowed[n]) for n, row in zip(seg.nodes, seg.freed_bytes)
    )
    low = [min(row[s] for s in allowed[n]) for n, row in zip(seg.nodes, seg.recompute_s)]
    high = [max(row[s] for s in allowed[n]) for n, row in zip(seg.nodes, seg.recompute_s)]
    for e in seg.edges:
        if e.src == e.dst:
            values = [e.cost_s[s][s] for s in allowed[e.src]]
        else:
            values = [e.cost_s[s][t] for s in allowed[e.src] for t in allowed[e.dst]]
        low.append(min(values))
        high.append(max(values))
    return big_freed / mem_scale, math.fsum(low) / time_scale, math.fsum(high) / time_scale
