"""The sharding ILP of solver/ilp.py built for highspy directly, in bulk (no pulp).

Same Problem -> model contract and the same formulation as ``ilp._build`` (read its module
docstring for the notation): binaries x[i,s] for nodes with two or more allowed strategies,
continuous pair variables e[k,g,h] in [0, 1] per allowed block of every kept edge, the
transient variable T and the memory row when a budget is given, the objective divided by a
power of two. Columns and rows are laid out in the same order as pulp's model (nodes in order,
then edges in order), the matrix is assembled as numpy arrays and handed to HiGHS with one
``addCols`` and one ``addRows`` call, so building costs a few numpy passes instead of one
Python object per variable and per coefficient (about half of a solve's time through pulp).

Checkpoint segments (``Problem.segments``) get ilp._add_segments' rows, column for column:
per segment and bit j of its count the binary b, the freed part f and (time model) the
recompute part t, one shared peak column P, a z column per segment edge that neither a fixed
end nor the model's pair columns express, the copies and overlap-clique rows; the memory row
gains P - sum 2^j f and the objective sum 2^j t (same scales as pulp's model, so the same
optimum). ``decode_recomputed`` reads the counts back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from solver.presolve import Reduced
from solver.problem import Problem, SegmentEdge
from solver.recompute import conflict_cliques

try:
    import highspy
except ImportError:  # pragma: no cover - highspy is a dependency; pulp falls back to CBC
    highspy = None


def available() -> bool:
    """Whether highspy can be imported."""
    return highspy is not None


def supports(problem: Problem) -> bool:
    """Whether the direct builder covers every field of ``problem`` (else use pulp)."""
    return highspy is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class DirectModel:
    """A built HiGHS model and what decoding needs."""

    highs: object
    x_index: dict[tuple[int, int], int]
    """(node, strategy) -> column, only for nodes with two or more allowed strategies."""
    segment_bits: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per Problem.segments entry: (column, weight) of the bits whose sum is the copies
    recomputed."""
    objective_scale: float
    num_variables: int
    num_constraints: int


@dataclass(frozen=True, kw_only=True, slots=True)
class DirectOutcome:
    status: str
    """'optimal', 'feasible', 'infeasible' or 'timeout'."""
    bound: float | None
    """The dual bound in model units (finite only)."""
    values: np.ndarray | None
    """Column values (None without a solution)."""


def _power_of_two_scale(values) -> float:
    largest = max((abs(v) for v in values), default=0.0)
    return (
        1.0
        if largest == 0.0 or not math.isfinite(largest)
        else math.ldexp(1.0, math.frexp(largest)[1])
    )


class _Rows:
    """Row-wise sparse matrix under construction (CSR) with row bounds."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.index: list[np.ndarray] = []
        self.value: list[np.ndarray] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.nnz = 0

    def add(self, cols, vals, lower: float, upper: float) -> None:
        cols = np.asarray(cols, dtype=np.int32)
        self.starts.append(self.nnz)
        self.index.append(cols)
        self.value.append(np.asarray(vals, dtype=np.float64))
        self.lower.append(lower)
        self.upper.append(upper)
        self.nnz += len(cols)


class _Cols:
    """Columns added after the x and pair columns: bounds, objective, integrality."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []

    def add(self, lower: float, upper: float, *, integer: bool = False) -> int:
        col = self.first + len(self.lower)
        self.lower.append(lower)
        self.upper.append(upper)
        if integer:
            self.integer.append(col)
        return col


@dataclass(frozen=True, kw_only=True, slots=True)
class _SegmentCols:
    memory: list[tuple[int, float]]
    """(column, bytes per unit) terms of the peak."""
    time: list[tuple[int, float]]
    """(column, seconds per unit) terms of the objective."""
    bits: tuple[tuple[tuple[int, int], ...], ...]


def _choice_terms(
    red: Reduced, x_index: dict[tuple[int, int], int], i: int, values, scale: float
) -> tuple[list[tuple[int, float]], float]:
    """(terms, constant) of sum_s values[s] x[i,s] / scale (ilp._choice_expr)."""
    allowed = red.allowed[i]
    if len(allowed) == 1:
        return [], values[allowed[0]] / scale
    return [(x_index[i, s], values[s] / scale) for s in allowed if values[s]], 0.0


def _segment_edge_terms(
    red: Reduced,
    x_index: dict[tuple[int, int], int],
    edge: SegmentEdge,
    scale: float,
    pair_col: dict[tuple[int, int, int], int],
    pair_index: dict[tuple[int, int], int],
    rows: _Rows,
    cols: _Cols,
) -> tuple[list[tuple[int, float]], float]:
    """Forward seconds of a segment edge as (terms, constant): ilp._segment_edge_expr, case
    for case (a fixed end, the model's pair columns, else one column z and a row per column
    group of identical costs)."""
    if edge.src == edge.dst:
        diagonal = [edge.cost_s[s][s] for s in range(len(edge.cost_s))]
        return _choice_terms(red, x_index, edge.src, diagonal, scale)
    src_allowed, dst_allowed = red.allowed[edge.src], red.allowed[edge.dst]
    if len(src_allowed) == 1:
        row = [edge.cost_s[src_allowed[0]][t] for t in range(len(edge.cost_s[0]))]
        return _choice_terms(red, x_index, edge.dst, row, scale)
    if len(dst_allowed) == 1:
        column = [edge.cost_s[s][dst_allowed[0]] for s in range(len(edge.cost_s))]
        return _choice_terms(red, x_index, edge.src, column, scale)
    k = pair_index.get((min(edge.src, edge.dst), max(edge.src, edge.dst)))
    if k is not None:
        pair = red.edges[k]
        flip = pair.src != edge.src
        terms = []
        for (g, h), _ in sorted(pair.group_cost_s.items()):
            values = {
                edge.cost_s[t][s] if flip else edge.cost_s[s][t]
                for s in pair.src_groups[g]
                for t in pair.dst_groups[h]
                if (s, t) in pair.cost_s
            }
            if len(values) != 1:
                break
            if (value := values.pop()) > 0.0:
                terms.append((pair_col[k, g, h], value / scale))
        else:
            return terms, 0.0
    rows_of: dict[tuple, list[int]] = {}
    cols_of: dict[tuple, list[int]] = {}
    for s in src_allowed:
        rows_of.setdefault(tuple(edge.cost_s[s][t] for t in dst_allowed), []).append(s)
    for t in dst_allowed:
        cols_of.setdefault(tuple(edge.cost_s[s][t] for s in src_allowed), []).append(t)
    inf = highspy.kHighsInf
    z = cols.add(0.0, inf)
    for dst_group in cols_of.values():
        costs = [(g, edge.cost_s[g[0]][dst_group[0]] / scale) for g in rows_of.values()]
        big = max(c for _, c in costs)
        if big <= 0.0:
            continue
        index, value = [z], [1.0]
        for group, c in costs:  # both ends have two or more strategies here
            if c:
                index += [x_index[edge.src, s] for s in group]
                value += [-c] * len(group)
        index += [x_index[edge.dst, t] for t in dst_group]
        value += [-big] * len(dst_group)
        rows.add(index, value, -big, inf)
    return [(z, 1.0)], 0.0


def _merged(terms: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Terms on one column summed (HiGHS refuses a row naming a column twice)."""
    out: dict[int, float] = {}
    for c, v in terms:
        out[c] = out.get(c, 0.0) + v
    return list(out.items())


def _add_segments(
    problem: Problem,
    red: Reduced,
    x_index: dict[tuple[int, int], int],
    pair_col: dict[tuple[int, int, int], int] | None,
    rows: _Rows,
    cols: _Cols,
) -> _SegmentCols:
    """ilp._add_segments' rows on columns (read its docstring); without ``pair_col`` (the
    minimum-peak model) no time rows."""
    inf = highspy.kHighsInf
    segments = problem.segments
    mem_scale = _power_of_two_scale([b for seg in segments for row in seg.freed_bytes for b in row])
    time_scale = _power_of_two_scale(
        [t for seg in segments for row in seg.recompute_s for t in row]
        + [c for seg in segments for e in seg.edges for row in e.cost_s for c in row]
    )
    peak = cols.add(0.0, inf)
    memory: list[tuple[int, float]] = [(peak, mem_scale)]
    time_terms: list[tuple[int, float]] = []
    all_bits = []
    pair_index = {(e.src, e.dst): k for k, e in enumerate(red.edges)}
    for seg in segments:
        freed: list[tuple[int, float]] = []
        freed_constant = 0.0
        for n, row in zip(seg.nodes, seg.freed_bytes):
            terms, constant = _choice_terms(red, x_index, n, row, mem_scale)
            freed += terms
            freed_constant += constant
        again: list[tuple[int, float]] = []
        again_constant = 0.0
        if pair_col is not None:  # the minimum-peak model prices no time
            for n, row in zip(seg.nodes, seg.recompute_s):
                terms, constant = _choice_terms(red, x_index, n, row, time_scale)
                again += terms
                again_constant += constant
            for edge in seg.edges:
                terms, constant = _segment_edge_terms(
                    red, x_index, edge, time_scale, pair_col, pair_index, rows, cols
                )
                again += terms
                again_constant += constant
            again = _merged(again)  # a node's own and its edges' seconds share its columns
        freed = _merged(freed)
        big_freed = math.fsum(max(row) for row in seg.freed_bytes) / mem_scale
        big_time = (
            math.fsum(max(row) for row in seg.recompute_s)
            + math.fsum(max(max(row) for row in e.cost_s) for e in seg.edges)
        ) / time_scale
        bits = []
        for j in range(seg.copies.bit_length()):
            b = cols.add(0.0, 1.0, integer=True)
            f = cols.add(0.0, inf)
            # f <= A(x); f <= M_A b; P >= f
            rows.add(
                [f, *(c for c, _ in freed)], [1.0, *(-v for _, v in freed)], -inf, freed_constant
            )
            rows.add([f, b], [1.0, -big_freed], -inf, 0.0)
            rows.add([peak, f], [1.0, -1.0], 0.0, inf)
            memory.append((f, -(2**j) * mem_scale))
            bits.append((b, 2**j))
            if pair_col is not None:  # t >= T(x) - M_T (1 - b)
                t = cols.add(0.0, inf)
                rows.add(
                    [t, *(c for c, _ in again), b],
                    [1.0, *(-v for _, v in again), -big_time],
                    -big_time + again_constant,
                    inf,
                )
                time_terms.append((t, 2**j * time_scale))
        bit_cols = [c for c, _ in bits]
        weights = [float(w) for _, w in bits]
        if seg.copies < 2 ** len(bits) - 1:
            rows.add(bit_cols, weights, -inf, float(seg.copies))
        if seg.min_copies:
            rows.add(bit_cols, weights, float(seg.min_copies), inf)
        all_bits.append(tuple(bits))
    for clique in conflict_cliques(segments):
        lcm = math.lcm(*(segments[k].copies for k in clique))
        rows.add(
            [b for k in clique for b, _ in all_bits[k]],
            [float(w * (lcm // segments[k].copies)) for k in clique for _, w in all_bits[k]],
            -inf,
            float(lcm),
        )
    return _SegmentCols(memory=memory, time=time_terms, bits=tuple(all_bits))


def _check(status, call: str) -> None:
    """HiGHS reports a refused call (a bad index, a column twice in a row) only by status."""
    if status == highspy.HighsStatus.kError:
        raise RuntimeError(
            f"HiGHS refused {call} while building the sharding model (a bug in "
            f"solver/highs_direct.py); pass backend='cbc' to plan meanwhile"
        )


def build(problem: Problem, red: Reduced, *, minimise_peak: bool) -> DirectModel:
    """The time model (with the budget row if any) or the minimum-peak model (no budget)."""
    inf = highspy.kHighsInf
    nodes = problem.nodes
    x_index: dict[tuple[int, int], int] = {}
    for i, choices in enumerate(red.allowed):
        if len(choices) > 1:
            for s in choices:
                x_index[i, s] = len(x_index)
    num_x = len(x_index)
    rows = _Rows()
    cost: list[float] = [0.0] * num_x
    for i, choices in enumerate(red.allowed):  # one-hot
        if len(choices) > 1:
            rows.add([x_index[i, s] for s in choices], np.ones(len(choices)), 1.0, 1.0)
    edges = (
        [k for k, e in enumerate(red.edges) if not e.all_pairs_allowed]
        if minimise_peak
        else range(len(red.edges))
    )
    pair_cost: list[float] = []
    pair_col: dict[tuple[int, int, int], int] = {}
    for k in edges:  # Alpa's linearization over grouped strategies
        edge = red.edges[k]
        blocks = sorted(edge.group_cost_s)
        first = num_x + len(pair_cost)
        pair_cost += [edge.group_cost_s[b] for b in blocks]
        by_src: list[list[int]] = [[] for _ in edge.src_groups]
        by_dst: list[list[int]] = [[] for _ in edge.dst_groups]
        for n, (g, h) in enumerate(blocks):
            pair_col[k, g, h] = first + n
            by_src[g].append(first + n)
            by_dst[h].append(first + n)
        for groups, node, pairs in (
            (edge.src_groups, edge.src, by_src),
            (edge.dst_groups, edge.dst, by_dst),
        ):
            for group, pair_cols in zip(groups, pairs, strict=True):
                xs = [x_index[node, s] for s in group]
                rows.add(
                    [*xs, *pair_cols],
                    np.concatenate([-np.ones(len(xs)), np.ones(len(pair_cols))]),
                    0.0,
                    0.0,
                )
    num_pairs = len(pair_cost)
    cols = _Cols(num_x + num_pairs)
    seg = (
        _add_segments(problem, red, x_index, None if minimise_peak else pair_col, rows, cols)
        if problem.segments
        else None
    )
    seg_memory = seg.memory if seg else []
    budget = problem.memory_budget_bytes
    with_memory = minimise_peak or budget is not None
    objective_terms: list[tuple[int, float]] = []
    """(column, coefficient in final units) of the objective beyond x and pairs."""
    if with_memory:
        mem_scale = _power_of_two_scale(
            [problem.memory_offset_bytes, budget or 0.0]
            + [c for _, c in seg_memory]
            + [b for n in nodes for b in n.memory_bytes]
            + [b for n in nodes for b in n.transient_bytes]
        )
        fixed_bytes = problem.memory_offset_bytes
        fixed_transient = 0.0
        resident_cols: list[int] = []
        resident_vals: list[float] = []
        for i, choices in enumerate(red.allowed):
            node = nodes[i]
            if len(choices) == 1:
                fixed_bytes += node.memory_bytes[choices[0]]
            else:
                for s in choices:
                    if node.memory_bytes[s]:
                        resident_cols.append(x_index[i, s])
                        resident_vals.append(node.memory_bytes[s] / mem_scale)
            transients = [node.transient_bytes[s] for s in choices] if node.transient_bytes else []
            if len(set(transients)) == 1:
                fixed_transient = max(fixed_transient, transients[0])
        t_col = cols.add(fixed_transient / mem_scale, inf)
        for i, choices in enumerate(red.allowed):
            node = nodes[i]
            transients = [node.transient_bytes[s] for s in choices] if node.transient_bytes else []
            if len(choices) > 1 and len(set(transients)) > 1:
                terms = [(x_index[i, s], -b / mem_scale) for s, b in zip(choices, transients) if b]
                rows.add(
                    [t_col, *(c for c, _ in terms)],
                    [1.0, *(v for _, v in terms)],
                    0.0,
                    inf,
                )
        peak_cols = [*resident_cols, t_col, *(c for c, _ in seg_memory)]
        peak_vals = [*resident_vals, 1.0, *(v / mem_scale for _, v in seg_memory)]
        if budget is not None and not minimise_peak:
            rows.add(peak_cols, peak_vals, -inf, (budget - fixed_bytes) / mem_scale)
        if minimise_peak:
            objective_terms = list(zip(peak_cols, peak_vals))
    num_cols = cols.first + len(cols.lower)
    objective = np.zeros(num_cols)
    scale = 1.0
    if minimise_peak:
        for c, v in objective_terms:
            objective[c] += v
    else:
        for i, costs in enumerate(red.node_cost_s):
            if len(costs) > 1:
                for s, c in costs.items():
                    cost[x_index[i, s]] = c
        seg_time = seg.time if seg else []
        terms = np.array(cost + pair_cost, dtype=np.float64)
        scale = _power_of_two_scale(terms.tolist() + [c for _, c in seg_time])
        objective[: num_x + num_pairs] = terms / scale
        for c, v in seg_time:
            objective[c] = v / scale
    lower = np.concatenate([np.zeros(num_x + num_pairs), np.array(cols.lower, dtype=np.float64)])
    upper = np.concatenate([np.ones(num_x + num_pairs), np.array(cols.upper, dtype=np.float64)])
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    _check(
        h.addCols(
            num_cols,
            objective,
            lower,
            upper,
            0,
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.float64),
        ),
        "addCols",
    )
    if rows.starts:
        _check(
            h.addRows(
                len(rows.starts),
                np.array(rows.lower, dtype=np.float64),
                np.array(rows.upper, dtype=np.float64),
                rows.nnz,
                np.array(rows.starts, dtype=np.int32),
                np.concatenate(rows.index).astype(np.int32),
                np.concatenate(rows.value),
            ),
            "addRows",
        )
    integer = np.concatenate(
        [np.arange(num_x, dtype=np.int32), np.array(cols.integer, dtype=np.int32)]
    )
    if len(integer):
        _check(
            h.changeColsIntegrality(
                len(integer),
                integer,
                np.full(len(integer), highspy.HighsVarType.kInteger.value, dtype=np.uint8),
            ),
            "changeColsIntegrality",
        )
    return DirectModel(
        highs=h,
        x_index=x_index,
        segment_bits=seg.bits if seg else (),
        objective_scale=scale,
        num_variables=num_cols,
        num_constraints=len(rows.starts),
    )


def run(
    model: DirectModel,
    *,
    time_limit_s: float | None,
    gap: float,
    abs_gap: float | None,
    msg: bool,
) -> DirectOutcome:
    """Solve; the status words are ilp._Outcome's."""
    h = model.highs
    if not model.num_variables:
        return DirectOutcome(status="optimal", bound=0.0, values=np.zeros(0))
    h.setOptionValue("output_flag", bool(msg))
    h.setOptionValue("mip_rel_gap", float(gap))
    if abs_gap is not None:
        h.setOptionValue("mip_abs_gap", float(abs_gap))
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(time_limit_s))
    h.run()
    status = h.getModelStatus()
    ms = highspy.HighsModelStatus
    info = h.getInfo()
    if status in (ms.kInfeasible, ms.kUnboundedOrInfeasible):
        return DirectOutcome(status="infeasible", bound=None, values=None)
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if status == ms.kOptimal and has_solution:
        kind = "optimal"
    elif has_solution and status in (ms.kTimeLimit, ms.kInterrupt, ms.kIterationLimit):
        kind = "feasible"
    elif time_limit_s is not None and status in (ms.kTimeLimit, ms.kInterrupt):
        return DirectOutcome(status="timeout", bound=None, values=None)
    else:
        raise RuntimeError(f"highs stopped without a plan: {h.modelStatusToString(status)}")
    bound = info.mip_dual_bound
    if kind == "optimal" and gap == 0.0:  # proven: the bound is the objective itself
        bound = info.objective_function_value
    values = np.asarray(h.getSolution().col_value, dtype=np.float64)
    return DirectOutcome(status=kind, bound=bound if math.isfinite(bound) else None, values=values)


def decode(red: Reduced, model: DirectModel, values: np.ndarray) -> tuple[int, ...]:
    """Chosen strategy per node: the largest x, lowest index on ties (as ilp._decode)."""
    choices = []
    for i, allowed in enumerate(red.allowed):
        if len(allowed) == 1:
            choices.append(allowed[0])
        else:
            choices.append(max(allowed, key=lambda s: (values[model.x_index[i, s]], -s)))
    return tuple(choices)


def decode_recomputed(model: DirectModel, values: np.ndarray) -> tuple[int, ...]:
    """Copies recomputed per Problem.segments entry (bits above one half, as ilp's decode)."""
    return tuple(sum(w for c, w in bits if values[c] > 0.5) for bits in model.segment_bits)
