"""Repeated-block tying: nodes of structurally identical layers share one set of variables.

A tie class {i_1, ..., i_L} (the same node of L identical layers) is contracted into one node
whose cost and resident bytes per strategy are the members' sums and whose transient bytes are
the members' largest; every edge is re-pointed at the contracted nodes, and edges that land on
the same contracted pair are summed into one matrix (the same matrix object, e.g. the same edge
of each layer as the autopar bridge shares them, is converted once and multiplied by its
count). An edge between two members of one class becomes a self-loop, which presolve reduces to
its diagonal, as the members choose alike. The contracted problem's objective and peak of a
choice equal the original problem's for the expanded choice (every member takes its class's
strategy), so solving it solves the tied problem exactly.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from solver.errors import InfeasibleError
from solver.problem import Edge, Node, Problem


@dataclass(frozen=True, kw_only=True, slots=True)
class Contracted:
    problem: Problem
    """The contracted problem (no tie classes left)."""
    node_map: tuple[int, ...]
    """Original node index -> contracted node index."""


def contract(problem: Problem) -> Contracted:
    """Contract ``problem.tied`` (see the module docstring).

    Raises:
        ValueError: a class names a node out of range, twice, or members whose numbers of
            strategies differ.
    """
    nodes = problem.nodes
    owner: dict[int, int] = {}
    for c, members in enumerate(problem.tied):
        for i in members:
            if not 0 <= i < len(nodes):
                raise ValueError(f"tie class {c} names node {i}, out of range")
            if i in owner:
                raise ValueError(f"node {i} is in tie classes {owner[i]} and {c}; merge them")
            if nodes[i].num_choices != nodes[members[0]].num_choices:
                raise ValueError(
                    f"tie class {c}: nodes {members[0]} and {i} have different numbers of "
                    f"strategies; tie only identical nodes"
                )
            owner[i] = c
    node_map: list[int] = []
    new_nodes: list[Node] = []
    class_index: dict[int, int] = {}
    for i, node in enumerate(nodes):
        tie = owner.get(i)
        if tie is None:
            node_map.append(len(new_nodes))
            new_nodes.append(node)
        elif tie in class_index:
            node_map.append(class_index[tie])
        else:
            class_index[tie] = len(new_nodes)
            node_map.append(len(new_nodes))
            new_nodes.append(_merge_nodes([nodes[j] for j in problem.tied[tie]]))
    counts: dict[tuple[int, int, int], list] = {}
    for edge in problem.edges:
        key = (node_map[edge.src], node_map[edge.dst], id(edge.cost_s))
        entry = counts.get(key)
        if entry is None:
            counts[key] = [edge.cost_s, 1]
        else:
            entry[1] += 1
    # Sum every edge landing on one contracted pair (either orientation) in one array.
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for (src, dst, _), (matrix, count) in counts.items():
        array = (
            np.array(
                [[math.inf if c is None else c for c in row] for row in matrix], dtype=np.float64
            )
            * count
        )
        if src > dst:
            src, dst, array = dst, src, array.T
        pairs[src, dst] = pairs[src, dst] + array if (src, dst) in pairs else array
    new_edges = [
        Edge(
            src=src,
            dst=dst,
            cost_s=tuple(
                tuple(c if math.isfinite(c) else None for c in row) for row in array.tolist()
            ),
        )
        for (src, dst), array in pairs.items()
    ]
    contracted = Problem(
        nodes=tuple(new_nodes),
        edges=tuple(new_edges),
        memory_budget_bytes=problem.memory_budget_bytes,
        memory_offset_bytes=problem.memory_offset_bytes,
    )
    return Contracted(problem=contracted, node_map=tuple(node_map))


def _merge_nodes(members: list[Node]) -> Node:
    first = members[0]
    num = first.num_choices
    transient: tuple[float, ...] = ()
    if any(m.transient_bytes for m in members):
        transient = tuple(
            max(m.transient_bytes[s] if m.transient_bytes else 0.0 for m in members)
            for s in range(num)
        )
    return Node(
        name=f"{first.name}(x{len(members)})",
        cost_s=tuple(sum(m.cost_s[s] for m in members) for s in range(num)),
        memory_bytes=tuple(sum(m.memory_bytes[s] for m in members) for s in range(num)),
        transient_bytes=transient,
    )


def expand(contracted: Contracted, choices: tuple[int, ...]) -> tuple[int, ...]:
    """The contracted problem's choices, one per original node."""
    return tuple(choices[c] for c in contracted.node_map)


# --------------------------------------------------------------------------------------------
# Counts per strategy under a memory budget

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
    src_members: dict[int, int] | None = None
    dst_members: dict[int, int] | None = None


def _identical_members(problem: Problem) -> bool:
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
    """Tie classes under a budget as counts: how many members use each strategy.

    Every tie class becomes one integer n[c,s] in [0, L] per strategy (sum L), an untied node
    one binary per strategy; node costs and resident bytes are linear in n (members are
    identical). Edges are grouped into families: the same two contracted nodes, the same cost
    matrix and the same layer offset between their members (0 inside a layer, 1 from a layer
    to the next); a family of c edges gets pair variables p[s,t] >= 0 (blocks of identical
    rows/columns, as in the ILP) counting its edges by pair, whose row sums equal the members
    using s times how often each member occurs in the family (or are at most that, with
    sum c, when the family covers only some members, as the edges between consecutive layers
    do). Transients: T >= r[s] y[c,s] with y binary, n[c,s] <= L y[c,s]. Every untied plan is a
    point of this model with the same objective and bytes, so its bound is a lower bound on the
    untied optimum, and the model's size does not depend on the number of layers.

    The counts are realised layer by layer: each class's members take its multiset of
    strategies (so resident bytes and the largest transient are exactly the model's: the plan
    fits), aligned along the families inside a layer with their pair counts, then members of a
    class swap strategies while that lowers the edges' cost (which keeps the bytes). Returns
    None when the problem is outside this model (members with different costs, a self-loop on
    a member) or when no counts fit; ``choices`` is None when the realised plan still uses a
    forbidden pair. The caller then forces the classes alike.

    Problems with checkpoint segments are not given to this model (ilp._solve_counts forces
    their classes alike) because it cannot price them exactly: a segment's freed bytes A(x)
    and recompute seconds T(x) are sums over ONE layer's nodes under that layer's joint
    choices, and its peak term is the largest A over the recomputed copies. Counts keep only
    how many members of each class take each strategy (and, per edge family, how many pairs),
    not which strategies sit together in one layer, so "r copies recomputed" has no linear
    price: it would need counts per (whole-layer assignment, recomputed or not), exponential
    in the segment's nodes (a LLaMA block segment has about 70), or a relaxation whose
    realised plan may not fit the budget. Splitting each count into recomputed / kept parts
    is exact only for one-node segments, which autopar does not propose.
    """
    from solver import highs_direct
    from solver.presolve import _group_pairs, plan_objective_s, plan_peak_memory_bytes

    if not highs_direct.available() or not problem.tied or not _identical_members(problem):
        return None
    import highspy

    start = time.perf_counter()
    nodes = problem.nodes
    budget = problem.memory_budget_bytes
    owner: dict[int, int] = {}
    position: dict[int, int] = {}
    for c, members in enumerate(problem.tied):
        for k, i in enumerate(members):
            owner[i] = c
            position[i] = k
    node_map: list[int] = []
    groups: list[tuple[int, ...]] = []  # contracted node -> its original nodes
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
            family = families[key] = _Family(
                src=u, dst=v, matrix=edge.cost_s, offset=offset, src_members={}, dst_members={}
            )
        family.count += 1
        family.src_members[edge.src] = family.src_members.get(edge.src, 0) + 1
        family.dst_members[edge.dst] = family.dst_members.get(edge.dst, 0) + 1

    inf = highspy.kHighsInf
    col_lower: list[float] = []
    col_upper: list[float] = []
    col_cost: list[float] = []
    integer: list[int] = []
    n_col: list[list[int]] = []
    for j, g in enumerate(groups):
        node = nodes[g[0]]
        cols = []
        for s in range(node.num_choices):
            cols.append(len(col_lower))
            integer.append(len(col_lower))
            col_lower.append(0.0)
            col_upper.append(0.0 if s in banned[j] else float(size[j]))
            col_cost.append(node.cost_s[s] + extra_cost[j][s])
        n_col.append(cols)
    row_start: list[int] = []
    row_index: list[int] = []
    row_value: list[float] = []
    row_lower: list[float] = []
    row_upper: list[float] = []

    def add_row(cols, vals, lo: float, hi: float) -> None:
        row_start.append(len(row_index))
        row_index.extend(cols)
        row_value.extend(vals)
        row_lower.append(lo)
        row_upper.append(hi)

    for j, cols in enumerate(n_col):  # every member chooses one strategy
        add_row(cols, [1.0] * len(cols), float(size[j]), float(size[j]))
    within: list[tuple[_Family, tuple, tuple, dict, int]] = []  # for the realisation
    for family in families.values():
        rows_n, cols_n = len(family.matrix), len(family.matrix[0])
        pairs = {
            (s, t): c
            for s, row in enumerate(family.matrix)
            for t, c in enumerate(row)
            if c is not None
        }
        src_groups, dst_groups, block_cost = _group_pairs(
            list(range(rows_n)), list(range(cols_n)), pairs
        )
        first = len(col_lower)
        blocks = sorted(block_cost)
        for b in blocks:
            col_lower.append(0.0)
            col_upper.append(float(family.count))
            col_cost.append(block_cost[b])
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
                add_row(
                    [*xs, *pair_cols],
                    [-multiple] * len(xs) + [1.0] * len(pair_cols),
                    0.0 if exact else -inf,
                    0.0,
                )
        if not exact_sides:
            add_row(
                [first + k for k in range(len(blocks))],
                [1.0] * len(blocks),
                float(family.count),
                float(family.count),
            )
        if family.offset == 0 and exact_sides == 2:
            within.append(
                (
                    family,
                    src_groups,
                    dst_groups,
                    dict(zip(blocks, range(first, first + len(blocks)))),
                    first,
                )
            )
    num_cols_before_memory = len(col_lower)
    mem_scale = 1.0
    if budget is not None:
        mem_scale = _power_of_two(
            [problem.memory_offset_bytes, budget]
            + [b for n in nodes for b in n.memory_bytes]
            + [b for n in nodes for b in n.transient_bytes]
        )
        t_col = len(col_lower)
        fixed_transient = 0.0
        col_lower.append(0.0)
        col_upper.append(inf)
        col_cost.append(0.0)
        memory_cols: list[int] = []
        memory_vals: list[float] = []
        for j, g in enumerate(groups):
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
            elif size[j] == 1:
                add_row([t_col, *n_col[j]], [1.0, *(-b / mem_scale for b in transient)], 0.0, inf)
            else:
                for s, b in enumerate(transient):
                    if b <= 0.0:
                        continue
                    y = len(col_lower)
                    integer.append(y)
                    col_lower.append(0.0)
                    col_upper.append(1.0)
                    col_cost.append(0.0)
                    add_row([n_col[j][s], y], [1.0, -float(size[j])], -inf, 0.0)
                    add_row([t_col, y], [1.0, -b / mem_scale], 0.0, inf)
        col_lower[t_col] = fixed_transient / mem_scale
        add_row(
            [*memory_cols, t_col],
            [*memory_vals, 1.0],
            -inf,
            (budget - problem.memory_offset_bytes) / mem_scale,
        )
    del num_cols_before_memory
    cost_scale = _power_of_two(col_cost)
    h = highspy.Highs()
    h.setOptionValue("output_flag", bool(msg))
    num_cols = len(col_lower)
    h.addCols(
        num_cols,
        np.array(col_cost, dtype=np.float64) / cost_scale,
        np.array(col_lower, dtype=np.float64),
        np.array(col_upper, dtype=np.float64),
        0,
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.int32),
        np.zeros(0, dtype=np.float64),
    )
    h.addRows(
        len(row_start),
        np.array(row_lower, dtype=np.float64),
        np.array(row_upper, dtype=np.float64),
        len(row_index),
        np.array(row_start, dtype=np.int32),
        np.array(row_index, dtype=np.int32),
        np.array(row_value, dtype=np.float64),
    )
    h.changeColsIntegrality(
        len(integer),
        np.array(integer, dtype=np.int32),
        np.full(len(integer), highspy.HighsVarType.kInteger.value, dtype=np.uint8),
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
    counts = [[int(round(values[c])) for c in cols] for cols in n_col]
    if any(sum(cnt) != size[j] for j, cnt in enumerate(counts)):
        return None
    assigned = _realise(groups, counts, within, values)
    choices = [0] * len(nodes)
    for j, g in enumerate(groups):
        for k, i in enumerate(g):
            choices[i] = assigned[j][k]
    _swap_members(problem, choices)
    bound = info.mip_dual_bound * cost_scale if math.isfinite(info.mip_dual_bound) else -math.inf
    realised: tuple[int, ...] | None = tuple(choices)
    try:
        objective = plan_objective_s(problem, tuple(choices))
    except InfeasibleError:
        realised, objective = None, math.inf
    if budget is not None and plan_peak_memory_bytes(problem, tuple(choices)) > budget * (
        1 + 1e-12
    ):
        realised, objective = None, math.inf
    return CountsOutcome(
        choices=realised,
        objective_s=objective,
        bound_s=min(objective, bound),
        status=kind,
        num_variables=num_cols,
        num_constraints=len(row_start),
        build_s=built - start,
        solve_s=time.perf_counter() - built,
        mixed_classes=sum(1 for j, cnt in enumerate(counts) if size[j] > 1 and max(cnt) < size[j]),
        used=tuple(
            tuple(s for s, c in enumerate(counts[node_map[i]]) if c > 0) for i in range(len(nodes))
        ),
    )


def _realise(groups, counts, within, values) -> list[list[int]]:
    """Members' strategies per contracted node: each class's multiset of strategies, aligned
    along the families inside a layer (breadth first) by their pair counts."""
    assigned: list[list[int] | None] = [None] * len(groups)
    adjacent: dict[int, list] = {}
    for entry in within:
        family = entry[0]
        adjacent.setdefault(family.src, []).append(entry)
        adjacent.setdefault(family.dst, []).append(entry)
    for j, cnt in enumerate(counts):
        if assigned[j] is not None:
            continue
        assigned[j] = [s for s, c in enumerate(cnt) for _ in range(c)]
        queue = [j]
        while queue:
            a = queue.pop(0)
            for family, src_groups, dst_groups, block_col, _ in adjacent.get(a, []):
                forward = family.src == a
                b = family.dst if forward else family.src
                if assigned[b] is not None:
                    continue
                mine, theirs = (src_groups, dst_groups) if forward else (dst_groups, src_groups)
                my_group = {s: g for g, grp in enumerate(mine) for s in grp}
                their_group = {t: h for h, grp in enumerate(theirs) for t in grp}
                left = {
                    (g, h) if forward else (h, g): int(round(values[col]))
                    for (g, h), col in block_col.items()
                }
                remaining = dict(enumerate(counts[b]))
                out = []
                for s in assigned[a]:
                    g = my_group[s]
                    pick = None
                    for t in sorted(t for t, c in remaining.items() if c > 0):
                        if left.get((g, their_group[t]) if forward else (g, their_group[t]), 0) > 0:
                            pick = t
                            break
                    if pick is None:
                        finite = [
                            t
                            for t, c in remaining.items()
                            if c > 0
                            and (family.matrix[s][t] if forward else family.matrix[t][s])
                            is not None
                        ]
                        pool = finite or [t for t, c in remaining.items() if c > 0]
                        pick = min(
                            pool,
                            key=lambda t: (
                                (family.matrix[s][t] if forward else family.matrix[t][s])
                                if (family.matrix[s][t] if forward else family.matrix[t][s])
                                is not None
                                else math.inf,
                                t,
                            ),
                        )
                    else:
                        key = (g, their_group[pick])
                        left[key] -= 1
                    remaining[pick] -= 1
                    out.append(pick)
                assigned[b] = out
                queue.append(b)
    return [list(a) for a in assigned]  # type: ignore[arg-type]


_FORBIDDEN = 1e30
"""Stand-in cost of a forbidden pair while swapping (repairs come first)."""

_MAX_SWAP_PASSES = 4


def _swap_members(problem: Problem, choices: list[int]) -> None:
    """Exchange the strategies of two members of a class while that lowers the edges' cost
    (a forbidden pair counts as _FORBIDDEN, so swaps first repair them). A swap keeps every
    class's multiset of strategies, hence its node costs, resident bytes and transients: the
    plan stays within the budget. In place."""
    incident: dict[int, list[int]] = {}
    for k, edge in enumerate(problem.edges):
        incident.setdefault(edge.src, []).append(k)
        if edge.dst != edge.src:
            incident.setdefault(edge.dst, []).append(k)
    edges = problem.edges

    def cost(ks) -> float:
        total = 0.0
        for k in ks:
            c = edges[k].cost_s[choices[edges[k].src]][choices[edges[k].dst]]
            total += _FORBIDDEN if c is None else c
        return total

    for _ in range(_MAX_SWAP_PASSES):
        improved = False
        for members in problem.tied:
            if len({choices[i] for i in members}) == 1:
                continue
            for x in range(len(members)):
                for y in range(x + 1, len(members)):
                    a, b = members[x], members[y]
                    if choices[a] == choices[b]:
                        continue
                    ks = sorted(set(incident.get(a, ())) | set(incident.get(b, ())))
                    before = cost(ks)
                    choices[a], choices[b] = choices[b], choices[a]
                    after = cost(ks)
                    if after < before - 1e-12 * abs(before):
                        improved = True
                    else:
                        choices[a], choices[b] = choices[b], choices[a]
        if not improved:
            break


def _power_of_two(values) -> float:
    largest = max((abs(v) for v in values), default=0.0)
    return (
        1.0
        if largest == 0.0 or not math.isfinite(largest)
        else math.ldexp(1.0, math.frexp(largest)[1])
    )


def restrict(problem: Problem, keep: tuple[tuple[int, ...], ...]) -> Problem:
    """``problem`` without ties, each node offered only the strategies ``keep[i]`` (ascending):
    solving it realises a counts plan exactly where members may differ (the counts model's
    plan is one of its points), with every layer free to take either of its class's
    strategies within the budget."""
    nodes = tuple(
        Node(
            name=node.name,
            cost_s=tuple(node.cost_s[s] for s in k),
            memory_bytes=tuple(node.memory_bytes[s] for s in k),
            transient_bytes=tuple(node.transient_bytes[s] for s in k)
            if node.transient_bytes
            else (),
        )
        for node, k in zip(problem.nodes, keep, strict=True)
    )
    edges = tuple(
        Edge(
            src=e.src,
            dst=e.dst,
            cost_s=tuple(tuple(e.cost_s[s][t] for t in keep[e.dst]) for s in keep[e.src]),
        )
        for e in problem.edges
    )
    return Problem(
        nodes=nodes,
        edges=edges,
        memory_budget_bytes=problem.memory_budget_bytes,
        memory_offset_bytes=problem.memory_offset_bytes,
    )
