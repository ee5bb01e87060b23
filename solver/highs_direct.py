"""The sharding ILP of solver/ilp.py built for highspy directly, in bulk (no pulp).

Same Problem -> model contract and the same formulation as ``ilp._build`` (read its module
docstring for the notation): binaries x[i,s] for nodes with two or more allowed strategies,
continuous pair variables e[k,g,h] in [0, 1] per allowed block of every kept edge, the
transient variable T and the memory row when a budget is given, the objective divided by a
power of two. Columns and rows are laid out in the same order as pulp's model (nodes in order,
then edges in order), the matrix is assembled as numpy arrays and handed to HiGHS with one
``addCols`` and one ``addRows`` call, so building costs a few numpy passes instead of one
Python object per variable and per coefficient (about half of a solve's time through pulp).

Problems with fields this builder does not know (``Problem.segments``, checkpoint segments)
are refused: ``supports`` says so and ilp.py keeps the pulp path for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from solver.presolve import Reduced
from solver.problem import Problem

try:
    import highspy
except ImportError:  # pragma: no cover - highspy is a dependency; pulp falls back to CBC
    highspy = None


def available() -> bool:
    """Whether highspy can be imported."""
    return highspy is not None


def supports(problem: Problem) -> bool:
    """Whether the direct builder covers every field of ``problem`` (else use pulp)."""
    return highspy is not None and not getattr(problem, "segments", ())


@dataclass(frozen=True, kw_only=True, slots=True)
class DirectModel:
    """A built HiGHS model and what decoding needs."""

    highs: object
    x_index: dict[tuple[int, int], int]
    """(node, strategy) -> column, only for nodes with two or more allowed strategies."""
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
    for k in edges:  # Alpa's linearization over grouped strategies
        edge = red.edges[k]
        blocks = sorted(edge.group_cost_s)
        first = num_x + len(pair_cost)
        pair_cost += [edge.group_cost_s[b] for b in blocks]
        by_src: list[list[int]] = [[] for _ in edge.src_groups]
        by_dst: list[list[int]] = [[] for _ in edge.dst_groups]
        for n, (g, h) in enumerate(blocks):
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
    num_cols = num_x + num_pairs
    lower = [0.0] * num_cols
    upper = [1.0] * num_cols
    objective = np.zeros(num_cols)
    budget = problem.memory_budget_bytes
    with_memory = minimise_peak or budget is not None
    if with_memory:
        mem_scale = _power_of_two_scale(
            [problem.memory_offset_bytes, budget or 0.0]
            + [b for n in nodes for b in n.memory_bytes]
            + [b for n in nodes for b in n.transient_bytes]
        )
        fixed_bytes = problem.memory_offset_bytes
        fixed_transient = 0.0
        resident_cols: list[int] = []
        resident_vals: list[float] = []
        t_col = num_cols
        num_cols += 1
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
            elif len(choices) > 1 and transients:
                terms = [(x_index[i, s], -b / mem_scale) for s, b in zip(choices, transients) if b]
                rows.add(
                    [t_col, *(c for c, _ in terms)],
                    [1.0, *(v for _, v in terms)],
                    0.0,
                    inf,
                )
        lower.append(fixed_transient / mem_scale)
        upper.append(inf)
        objective = np.append(objective, 0.0)
        if budget is not None and not minimise_peak:
            rows.add(
                [*resident_cols, t_col],
                [*resident_vals, 1.0],
                -inf,
                (budget - fixed_bytes) / mem_scale,
            )
        if minimise_peak:
            objective[resident_cols] = resident_vals
            objective[t_col] = 1.0
    scale = 1.0
    if not minimise_peak:
        for i, costs in enumerate(red.node_cost_s):
            if len(costs) > 1:
                for s, c in costs.items():
                    cost[x_index[i, s]] = c
        terms = np.array(cost + pair_cost, dtype=np.float64)
        scale = _power_of_two_scale(terms.tolist())
        objective[: num_x + num_pairs] = terms / scale
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.addCols(
        num_cols,
        objective,
        np.array(lower, dtype=np.float64),
        np.array(upper, dtype=np.float64),
        0,
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.float64),
    )
    if rows.starts:
        h.addRows(
            len(rows.starts),
            np.array(rows.lower, dtype=np.float64),
            np.array(rows.upper, dtype=np.float64),
            rows.nnz,
            np.array(rows.starts, dtype=np.int32),
            np.concatenate(rows.index).astype(np.int32),
            np.concatenate(rows.value),
        )
    if num_x:
        h.changeColsIntegrality(
            num_x,
            np.arange(num_x, dtype=np.int32),
            np.full(num_x, highspy.HighsVarType.kInteger.value, dtype=np.uint8),
        )
    return DirectModel(
        highs=h,
        x_index=x_index,
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
