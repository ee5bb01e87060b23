"""Tie classes under a memory budget as counts: how many members of a class use each strategy.

Notation: contracted nodes j, each a tie class of L_j identical members (an untied node has
L_j = 1), with a member's cost c_j[s] (plus the diagonal of its self-loops), resident bytes
m_j[s] and transient bytes r_j[s]; edge families f: the c_f edges between the same two
contracted nodes with the same cost matrix C_f and the same layer offset between their members
(0 inside a layer, 1 from a layer to the next; None unless both ends are classes of one
size); blocks (g, h) of identical rows / columns of C_f (presolve.group_pairs; the ILP's
groups in solver/ilp.py); M0 = memory_offset_bytes, B = memory_budget_bytes.

Variables (function that adds them)
    n[j,s] in {0..L_j}      members of j using s (0 when a self-loop forbids s)  _add_count_columns
    p[f,g,h] in [0, c_f]    edges of f carrying a pair of block (g, h)           _add_family
    T >= 0, y[j,s] binary   the largest transient; whether class j uses s        _add_memory_rows

Objective
    minimise  sum_j sum_s c_j[s] n[j,s]  +  sum_f sum_{(g,h) allowed} C_f[g][h] p[f,g,h]

Constraints (family: the function that builds it)
    members     sum_s n[j,s] = L_j                                  every j   _add_member_rows
    family      sum_h p[f,g,h] = k sum_{s in g} n[u_f,s]            every f   _add_family
                (likewise per column group h at the other end; "<=" instead of "=" when the
                family covers only some members of that end, or them unequally, as the edges
                between consecutive layers do; k: how often a member occurs in the family)
    family-sum  sum p[f,.,.] = c_f      when neither end is covered exactly   _add_family
    transient   T >= sum_s r_j[s] n[j,s] (L_j = 1);  n[j,s] <= L_j y[j,s] and
                T >= r_j[s] y[j,s] (L_j > 1);  T >= r_j when r_j is one value  _add_memory_rows
    memory      sum_j sum_s m_j[s] n[j,s] + T <= B - M0       if B is not None  _add_memory_rows

Costs and bytes are divided by powers of two (exact). Every untied plan is a point of this
model with the same objective and bytes, so its bound is a lower bound on the untied optimum,
and the model's size does not depend on the number of layers.

The counts found are turned into one strategy per node by solver/realise.py (``realise``),
which keeps each class's multiset of strategies: the plan's bytes are the model's.

Problems with checkpoint segments are not given to this model (solver/shrink.py
``_solve_counts`` forces their classes alike) because it cannot price them exactly: a
segment's freed bytes A(x) and recompute seconds T(x) are sums over ONE layer's nodes under
that layer's joint choices, and its peak term is the largest A over the recomputed copies.
Counts keep only how many members of each class take each strategy (and, per edge family, how
many pairs), not which strategies sit together in one layer, so "r copies recomputed" has no
linear price: it would need counts per (whole-layer assignment, recomputed or not),
exponential in the segment's nodes (a LLaMA block segment has about 70), or a relaxation whose
realised plan may not fit the budget. Splitting each count into recomputed / kept parts is
exact only for one-node segments, which autopar does not propose.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from solver import highs_direct
from solver.errors import InfeasibleError
from solver.presolve import group_pairs, plan_objective_s, plan_peak_memory_bytes
from solver.problem import Problem
from solver.realise import Alignment, realise
from solver.rows import power_of_two_scale

ACCEPT_GAP = 1e-3
"""A decoded mixed plan within this relative distance of the counts bound is kept as is;
otherwise the forced tie is solved too and the better plan kept."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CountsOutcome:
    """A plan from the counts model (see ``solve_counts``)."""

    choices: tuple[int, ...] | None
    """Per original node; None when the counts could not be realised without a forbidden
    pair (the bound still holds)."""
    objective_s: float
    bound_s: float
    """The counts model's bound: a lower bound on the untied optimum."""
    status: str
    num_variables: int
    num_constraints: int
    build_s: float
    solve_s: float
    mixed_classes: int
    """Tie classes whose members chose different strategies."""
    used: tuple[tuple[int, ...], ...] = ()
    """Per original node: the strategies its class uses (an untied node: its choice)."""


@dataclass(slots=True)
class _Family:
    """Edges between the same two contracted nodes with the same matrix and layer offset."""

    src: int
    dst: int
    matrix: tuple[tuple[float | None, ...], ...]
    offset: int | None
    count: int = 0
    src_members: dict[int, int] = field(default_factory=dict)
    """Original src node -> edges of the family leaving it."""
    dst_members: dict[int, int] = field(default_factory=dict)
    """Original dst node -> edges of the family entering it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _ContractedGraph:
    """The problem seen by the counts model: contracted nodes and edge families."""

    node_map: list[int]
    """Original node index -> contracted node index."""
    groups: list[tuple[int, ...]]
    """Contracted node -> its original nodes (a tie class, or one untied node)."""
    size: list[int]
    """Contracted node -> number of members."""
    extra_cost: list[np.ndarray]
    """Contracted node -> per-strategy cost of its self-loops' diagonals."""
    banned: list[set[int]]
    """Contracted node -> strategies a self-loop forbids."""
    families: dict[tuple, _Family]


@dataclass(slots=True)
class _CountsModel:
    """The counts model's columns and rows (CSR), handed to HiGHS in bulk."""

    col_lower: list[float] = field(default_factory=list)
    col_upper: list[float] = field(default_factory=list)
    col_cost: list[float] = field(default_factory=list)
    integer: list[int] = field(default_factory=list)
    row_start: list[int] = field(default_factory=list)
    row_index: list[int] = field(default_factory=list)
    row_value: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)

    def column(self, lower: float, upper: float, cost: float, *, integer: bool = False) -> int:
        """Add a column; returns its index."""
        col = len(self.col_lower)
        if integer:
            self.integer.append(col)
        self.col_lower.append(lower)
        self.col_upper.append(upper)
        self.col_cost.append(cost)
        return col

    def row(self, cols: list[int], vals: list[float], lo: float, hi: float) -> None:
        """Add the row lo <= sum vals * cols <= hi."""
        self.row_start.append(len(self.row_index))
        self.row_index.extend(cols)
        self.row_value.extend(vals)
        self.row_lower.append(lo)
        self.row_upper.append(hi)


def _identical_members(problem: Problem) -> bool:
    """Whether every tie class's members have the same costs and bytes."""
    for members in problem.tied:
        first = problem.nodes[members[0]]
        for i in members[1:]:
            node = problem.nodes[i]
            if (node.cost_s, node.memory_bytes, node.transient_bytes) != (
                first.cost_s,
                first.memory_bytes,
                first.transient_bytes,
            ):
                return False
    return True


def solve_counts(
    problem: Problem, *, time_limit_s: float | None, gap: float, msg: bool
) -> CountsOutcome | None:
    """Tie classes under a budget as counts (the module docstring's model), realised.

    Returns None when the problem is outside this model (highspy missing, no tie classes,
    members with different costs, a self-loop on a member of a class) or when no counts fit;
    ``choices`` is None when the realised plan still uses a forbidden pair or exceeds the
    budget. The caller then forces the classes alike.
    """
    if not highs_direct.available() or not problem.tied or not _identical_members(problem):
        return None
    start = time.perf_counter()
    graph = _contracted_graph(problem)
    if graph is None:
        return None
    model = _CountsModel()
    n_col = _add_count_columns(model, problem, graph)
    _add_member_rows(model, n_col, graph.size)
    alignments: list[Alignment] = []
    for family in graph.families.values():
        entry = _add_family(model, family, n_col, graph.size)
        if entry is not None:
            alignments.append(entry)
    if problem.memory_budget_bytes is not None:
        _add_memory_rows(model, problem, graph, n_col)
    return _solve_and_realise(
        problem, graph, model, n_col, alignments, start, time_limit_s=time_limit_s, gap=gap, msg=msg
    )


def _contracted_graph(problem: Problem) -> _ContractedGraph | None:
    """Contracted nodes and edge families; None when a self-loop joins a class's members."""
    nodes = problem.nodes
    owner: dict[int, int] = {}
    position: dict[int, int] = {}
    for c, members in enumerate(problem.tied):
        for k, i in enumerate(members):
            owner[i] = c
            position[i] = k
    node_map: list[int] = []
    groups: list[tuple[int, ...]] = []
    class_node: dict[int, int] = {}
    for i in range(len(nodes)):
        c = owner.get(i)
        if c is None:
            node_map.append(len(groups))
            groups.append((i,))
        elif c in class_node:
            node_map.append(class_node[c])
        else:
            class_node[c] = len(groups)
            node_map.append(len(groups))
            groups.append(problem.tied[c])
    size = [len(g) for g in groups]
    extra_cost = [np.zeros(nodes[g[0]].num_choices) for g in groups]
    banned: list[set[int]] = [set() for _ in groups]
    families: dict[tuple, _Family] = {}
    for edge in problem.edges:
        u, v = node_map[edge.src], node_map[edge.dst]
        if edge.src == edge.dst:
            if size[u] > 1:
                return None
            for s in range(nodes[edge.src].num_choices):
                diag = edge.cost_s[s][s]
                if diag is None:
                    banned[u].add(s)
                else:
                    extra_cost[u][s] += diag
            continue
        offset = None
        if size[u] > 1 and size[v] > 1 and size[u] == size[v]:
            offset = position[edge.dst] - position[edge.src]
        key = (u, v, id(edge.cost_s), offset)
        family = families.get(key)
        if family is None:
            family = families[key] = _Family(src=u, dst=v, matrix=edge.cost_s, offset=offset)
        family.count += 1
        family.src_members[edge.src] = family.src_members.get(edge.src, 0) + 1
        family.dst_members[edge.dst] = family.dst_members.get(edge.dst, 0) + 1
    return _ContractedGraph(
        node_map=node_map,
        groups=groups,
        size=size,
        extra_cost=extra_cost,
        banned=banned,
        families=families,
    )


def _add_count_columns(
    model: _CountsModel, problem: Problem, graph: _ContractedGraph
) -> list[list[int]]:
    """The integers n[j,s]; returns their columns per contracted node."""
    n_col: list[list[int]] = []
    for j, g in enumerate(graph.groups):
        node = problem.nodes[g[0]]
        n_col.append(
            [
                model.column(
                    0.0,
                    0.0 if s in graph.banned[j] else float(graph.size[j]),
                    node.cost_s[s] + graph.extra_cost[j][s],
                    integer=True,
                )
                for s in range(node.num_choices)
            ]
        )
    return n_col


def _add_member_rows(model: _CountsModel, n_col: list[list[int]], size: list[int]) -> None:
    """Every member chooses one strategy: sum_s n[j,s] = L_j."""
    for j, cols in enumerate(n_col):
        model.row(cols, [1.0] * len(cols), float(size[j]), float(size[j]))


def _add_family(
    model: _CountsModel, family: _Family, n_col: list[list[int]], size: list[int]
) -> Alignment | None:
    """The pair columns p[f,g,h] of one family and the rows linking them to the counts.

    Returns what ``realise`` needs when the family lies inside a layer and covers both ends
    exactly, else None."""
    rows_n, cols_n = len(family.matrix), len(family.matrix[0])
    pairs = {
        (s, t): c for s, row in enumerate(family.matrix) for t, c in enumerate(row) if c is not None
    }
    src_groups, dst_groups, block_cost = group_pairs(
        list(range(rows_n)), list(range(cols_n)), pairs
    )
    first = len(model.col_lower)
    blocks = sorted(block_cost)
    for b in blocks:
        model.column(0.0, float(family.count), block_cost[b])
    by_src: list[list[int]] = [[] for _ in src_groups]
    by_dst: list[list[int]] = [[] for _ in dst_groups]
    for k, (g, h) in enumerate(blocks):
        by_src[g].append(first + k)
        by_dst[h].append(first + k)
    exact_sides = 0
    for node, members, side_groups, side_pairs in (
        (family.src, family.src_members, src_groups, by_src),
        (family.dst, family.dst_members, dst_groups, by_dst),
    ):
        counts = set(members.values())
        exact = len(members) == size[node] and len(counts) == 1
        multiple = float(max(counts))
        exact_sides += exact
        for group, pair_cols in zip(side_groups, side_pairs, strict=True):
            xs = [n_col[node][s] for s in group]
            model.row(
                [*xs, *pair_cols],
                [-multiple] * len(xs) + [1.0] * len(pair_cols),
                0.0 if exact else -math.inf,
                0.0,
            )
    if not exact_sides:
        model.row(
            [first + k for k in range(len(blocks))],
            [1.0] * len(blocks),
            float(family.count),
            float(family.count),
        )
    if family.offset == 0 and exact_sides == 2:
        return Alignment(
            src=family.src,
            dst=family.dst,
            matrix=family.matrix,
            src_groups=src_groups,
            dst_groups=dst_groups,
            block_col=dict(zip(blocks, range(first, first + len(blocks)))),
        )
    return None


def _add_memory_rows(
    model: _CountsModel, problem: Problem, graph: _ContractedGraph, n_col: list[list[int]]
) -> None:
    """The column T, the transient rows (with the binaries y) and the memory row."""
    nodes = problem.nodes
    budget = problem.memory_budget_bytes
    assert budget is not None
    mem_scale = power_of_two_scale(
        [problem.memory_offset_bytes, budget]
        + [b for n in nodes for b in n.memory_bytes]
        + [b for n in nodes for b in n.transient_bytes]
    )
    t_col = model.column(0.0, math.inf, 0.0)
    fixed_transient = 0.0
    memory_cols: list[int] = []
    memory_vals: list[float] = []
    for j, g in enumerate(graph.groups):
        node = nodes[g[0]]
        for s in range(node.num_choices):
            if node.memory_bytes[s]:
                memory_cols.append(n_col[j][s])
                memory_vals.append(node.memory_bytes[s] / mem_scale)
        transient = node.transient_bytes
        if not transient:
            continue
        if len(set(transient)) == 1:
            fixed_transient = max(fixed_transient, transient[0])
        elif graph.size[j] == 1:
            model.row(
                [t_col, *n_col[j]], [1.0, *(-b / mem_scale for b in transient)], 0.0, math.inf
            )
        else:
            for s, b in enumerate(transient):
                if b <= 0.0:
                    continue
                y = model.column(0.0, 1.0, 0.0, integer=True)
                model.row([n_col[j][s], y], [1.0, -float(graph.size[j])], -math.inf, 0.0)
                model.row([t_col, y], [1.0, -b / mem_scale], 0.0, math.inf)
    model.col_lower[t_col] = fixed_transient / mem_scale
    model.row(
        [*memory_cols, t_col],
        [*memory_vals, 1.0],
        -math.inf,
        (budget - problem.memory_offset_bytes) / mem_scale,
    )


def _solve_and_realise(
    problem: Problem,
    graph: _ContractedGraph,
    model: _CountsModel,
    n_col: list[list[int]],
    alignments: list[Alignment],
    start: float,
    *,
    time_limit_s: float | None,
    gap: float,
    msg: bool,
) -> CountsOutcome | None:
    """Hand the model to HiGHS, run it, and realise and evaluate the counts it found."""
    import highspy

    cost_scale = power_of_two_scale(model.col_cost)
    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(msg))
    num_cols = len(model.col_lower)
    h.addCols(
        num_cols,
        np.array(model.col_cost, dtype=np.float64) / cost_scale,
        np.array(model.col_lower, dtype=np.float64),
        np.array(model.col_upper, dtype=np.float64),
        0,
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.float64),
    )
    h.addRows(
        len(model.row_start),
        np.array(model.row_lower, dtype=np.float64),
        np.array(model.row_upper, dtype=np.float64),
        len(model.row_index),
        np.array(model.row_start, dtype=np.int32),
        np.array(model.row_index, dtype=np.int32),
        np.array(model.row_value, dtype=np.float64),
    )
    h.changeColsIntegrality(
        len(model.integer),
        np.array(model.integer, dtype=np.int32),
        np.full(len(model.integer), highspy.HighsVarType.kInteger.value, dtype=np.uint8),
    )
    h.setOptionValue("mip_rel_gap", float(gap))
    if gap == 0.0:
        h.setOptionValue("mip_abs_gap", 1e-9)
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(time_limit_s))
    built = time.perf_counter()
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if info.primal_solution_status != 2:  # infeasible, or no plan within the time limit
        return None
    kind = "optimal" if status == highspy.HighsModelStatus.kOptimal else "feasible"
    values = np.asarray(h.getSolution().col_value)
    size = graph.size
    counts = [[int(round(values[c])) for c in cols] for cols in n_col]
    if any(sum(cnt) != size[j] for j, cnt in enumerate(counts)):
        return None
    choices = realise(problem, graph.groups, counts, alignments, values)
    bound = info.mip_dual_bound * cost_scale if math.isfinite(info.mip_dual_bound) else -math.inf
    realised: tuple[int, ...] | None = choices
    try:
        objective = plan_objective_s(problem, choices)
    except InfeasibleError:
        realised, objective = None, math.inf
    budget = problem.memory_budget_bytes
    if budget is not None and plan_peak_memory_bytes(problem, choices) > budget * (1 + 1e-12):
        realised, objective = None, math.inf
    return CountsOutcome(
        choices=realised,
        objective_s=objective,
        bound_s=min(objective, bound),
        status=kind,
        num_variables=num_cols,
        num_constraints=len(model.row_start),
        build_s=built - start,
        solve_s=time.perf_counter() - built,
        mixed_classes=sum(1 for j, cnt in enumerate(counts) if size[j] > 1 and max(cnt) < size[j]),
        used=tuple(
            tuple(s for s, c in enumerate(counts[graph.node_map[i]]) if c > 0)
            for i in range(len(problem.nodes))
        ),
    )
