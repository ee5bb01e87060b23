"""Checks and exact presolve of a Problem, and exact evaluation of a plan.

Everything here is plain Python on the Problem; ilp.py builds its model from the Reduced result
(see the presolve paragraph of its module docstring).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from solver.errors import InfeasibleError
from solver.problem import Problem
from solver.recompute import recompute_terms


@dataclass(frozen=True, kw_only=True, slots=True)
class PairEdge:
    """A merged edge that keeps variables: cost of each allowed (src, dst) strategy pair."""

    src: int
    dst: int
    cost_s: dict[tuple[int, int], float]
    all_pairs_allowed: bool
    src_groups: tuple[tuple[int, ...], ...] = ()
    """Src strategies whose rows (costs and forbidden pairs over the dst strategies) are
    identical, grouped; the ILP links one pair variable per (src group, dst group)."""
    dst_groups: tuple[tuple[int, ...], ...] = ()
    """Dst strategies whose columns are identical, grouped."""
    group_cost_s: dict[tuple[int, int], float] = field(default_factory=dict)
    """Cost of each allowed (src group index, dst group index) block."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reduced:
    """The problem after presolve: what the model is built from."""

    allowed: tuple[tuple[int, ...], ...]
    """Per node: the strategies still possible, ascending."""
    node_cost_s: tuple[dict[int, float], ...]
    """Per node: cost per allowed strategy, including edges folded into it."""
    edges: tuple[PairEdge, ...]
    constant_s: float


def plan_objective_s(
    problem: Problem, choices: tuple[int, ...], recomputed: tuple[int, ...] = ()
) -> float:
    """Exact step time of a plan: node costs plus edge costs (plus the recompute seconds of
    the segments ``recomputed``, solver/recompute.py), summed with math.fsum.

    Raises:
        InfeasibleError: an edge forbids the chosen pair.
    """
    terms = [node.cost_s[c] for node, c in zip(problem.nodes, choices, strict=True)]
    for k, edge in enumerate(problem.edges):
        cost = edge.cost_s[choices[edge.src]][choices[edge.dst]]
        if cost is None:
            raise InfeasibleError(
                f"edge {k} ({problem.nodes[edge.src].name!r} -> {problem.nodes[edge.dst].name!r})"
                f" forbids the pair ({choices[edge.src]}, {choices[edge.dst]})"
            )
        terms.append(cost)
    if recomputed:
        terms.append(recompute_terms(problem, choices, recomputed)[0])
    return math.fsum(terms)


def plan_peak_memory_bytes(
    problem: Problem, choices: tuple[int, ...], recomputed: tuple[int, ...] = ()
) -> float:
    """Exact peak bytes of a plan: offset + resident memory + the largest transient (>= 0),
    less what the ``recomputed`` segments free plus one of them alive again."""
    largest_transient = max(
        (
            n.transient_bytes[c]
            for n, c in zip(problem.nodes, choices, strict=True)
            if n.transient_bytes
        ),
        default=0.0,
    )
    resident = [n.memory_bytes[c] for n, c in zip(problem.nodes, choices, strict=True)]
    if recomputed:
        _, freed, again = recompute_terms(problem, choices, recomputed)
        resident += [-freed, again]
    return math.fsum([problem.memory_offset_bytes, *resident, max(largest_transient, 0.0)])


def validate(problem: Problem) -> None:
    """Raise ValueError for an edge that names a missing node or has a mis-shaped matrix."""
    num_nodes = len(problem.nodes)
    for k, edge in enumerate(problem.edges):
        if not (0 <= edge.src < num_nodes and 0 <= edge.dst < num_nodes):
            raise ValueError(f"edge {k} ({edge.src} -> {edge.dst}) names a node out of range")
        rows, cols = problem.nodes[edge.src].num_choices, problem.nodes[edge.dst].num_choices
        if len(edge.cost_s) != rows or any(len(row) != cols for row in edge.cost_s):
            raise ValueError(f"edge {k}: cost_s must be {rows} x {cols} (src x dst choices)")


def reduce_problem(problem: Problem) -> Reduced:
    """Presolve (see the module docstring); raises InfeasibleError when a node loses all."""
    nodes = problem.nodes
    allowed = [set(range(n.num_choices)) for n in nodes]
    node_cost = [dict(enumerate(n.cost_s)) for n in nodes]
    merged: dict[tuple[int, int], dict[tuple[int, int], float | None]] = {}
    for edge in problem.edges:
        if edge.src == edge.dst:  # a self-loop only ever sees the diagonal
            for s in range(nodes[edge.src].num_choices):
                diag = edge.cost_s[s][s]
                if diag is None:
                    allowed[edge.src].discard(s)
                else:
                    node_cost[edge.src][s] += diag
            continue
        flip = edge.src > edge.dst
        key = (edge.dst, edge.src) if flip else (edge.src, edge.dst)
        table = merged.setdefault(key, {})
        for s, row in enumerate(edge.cost_s):
            for t, cost in enumerate(row):
                pair = (t, s) if flip else (s, t)
                previous = table.get(pair, 0.0)
                table[pair] = None if cost is None or previous is None else previous + cost

    def check(i: int, why: str) -> None:
        if not allowed[i]:
            raise InfeasibleError(
                f"node {nodes[i].name!r} (index {i}) has no strategy left: {why}; allow at least "
                f"one pair (a non-None cost) for some strategy of every edge"
            )

    for i in range(len(nodes)):
        check(i, "its self-edges forbid every strategy")
    # Arc consistency (AC-3): drop strategies that no allowed pair of some edge supports, and
    # revisit the edges of a node whenever it loses one.
    incident: dict[int, list[tuple[int, int]]] = {}
    for key in merged:
        for i in key:
            incident.setdefault(i, []).append(key)
    queue = deque(sorted(merged))
    queued = set(queue)
    while queue:
        u, v = key = queue.popleft()
        queued.discard(key)
        ok = [
            (s, t)
            for (s, t), c in merged[key].items()
            if c is not None and s in allowed[u] and t in allowed[v]
        ]
        for i, supported in ((u, {s for s, _ in ok}), (v, {t for _, t in ok})):
            if supported == allowed[i]:
                continue
            allowed[i] &= supported
            check(i, f"the edges between {nodes[u].name!r} and {nodes[v].name!r} forbid the rest")
            for other in incident[i]:
                if other != key and other not in queued:
                    queue.append(other)
                    queued.add(other)

    _prune_dominated(problem, allowed, node_cost, merged)
    constant_s = 0.0
    kept = []
    for (u, v), table in sorted(merged.items()):
        pairs = {(s, t): c for (s, t), c in table.items() if s in allowed[u] and t in allowed[v]}
        allowed_pairs = {p: c for p, c in pairs.items() if c is not None}
        if len(allowed[u]) == 1 or len(allowed[v]) == 1:  # linear in the other end
            for (s, t), c in allowed_pairs.items():
                if len(allowed[u]) == 1:
                    node_cost[v][t] += c
                else:
                    node_cost[u][s] += c
            continue
        everything = len(allowed_pairs) == len(pairs)
        costs = set(allowed_pairs.values())
        if everything and len(costs) == 1:
            constant_s += costs.pop()
            continue
        src_groups, dst_groups, group_cost = _group_pairs(
            sorted(allowed[u]), sorted(allowed[v]), allowed_pairs
        )
        if len(src_groups) == 1 or len(dst_groups) == 1:
            # Every row (or column) is the same: the cost depends on one end only, and arc
            # consistency already removed the strategies a forbidden line would exclude.
            if len(src_groups) == 1:
                s0 = src_groups[0][0]
                for t in allowed[v]:
                    node_cost[v][t] += allowed_pairs[s0, t]
            else:
                t0 = dst_groups[0][0]
                for s in allowed[u]:
                    node_cost[u][s] += allowed_pairs[s, t0]
            continue
        kept.append(
            PairEdge(
                src=u,
                dst=v,
                cost_s=allowed_pairs,
                all_pairs_allowed=everything,
                src_groups=src_groups,
                dst_groups=dst_groups,
                group_cost_s=group_cost,
            )
        )
    return Reduced(
        allowed=tuple(tuple(sorted(a)) for a in allowed),
        node_cost_s=tuple({s: cost[s] for s in sorted(a)} for cost, a in zip(node_cost, allowed)),
        edges=tuple(kept),
        constant_s=constant_s,
    )


def _group_pairs(
    rows: list[int], cols: list[int], pairs: dict[tuple[int, int], float]
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...], dict[tuple[int, int], float]]:
    """Exact edge compression: group identical rows and identical columns of a cost matrix.

    An edge's cost depends only on the producer's output placement and the consumer's input
    placement, so many strategies of either end share a row or a column. Within a block of
    (row group, column group) every entry is equal (equal rows, then equal columns), so one
    pair variable per block, linked to the sum of its group's x, is the same model.
    """
    row_key: dict[tuple[float | None, ...], list[int]] = {}
    for s in rows:
        row_key.setdefault(tuple(pairs.get((s, t)) for t in cols), []).append(s)
    col_key: dict[tuple[float | None, ...], list[int]] = {}
    for t in cols:
        col_key.setdefault(tuple(pairs.get((s, t)) for s in rows), []).append(t)
    src_groups = tuple(tuple(g) for g in row_key.values())
    dst_groups = tuple(tuple(g) for g in col_key.values())
    group_cost = {}
    for g, src_group in enumerate(src_groups):
        for h, dst_group in enumerate(dst_groups):
            cost = pairs.get((src_group[0], dst_group[0]))
            if cost is not None:
                group_cost[g, h] = cost
    return src_groups, dst_groups, group_cost


_DOMINANCE_ROUNDS = 2


def _prune_dominated(
    problem: Problem,
    allowed: list[set[int]],
    node_cost: list[dict[int, float]],
    merged: dict[tuple[int, int], dict[tuple[int, int], float | None]],
) -> None:
    """Remove dominated strategies, exactly (in place).

    Strategy s of node i is dominated by s' when s' is no worse in cost, resident bytes and
    transient bytes, and its cost to every allowed strategy of every neighbour is no higher
    (a forbidden pair only under s' where s also forbids it). Any plan using s then does at
    least as well with s' (same pairs allowed, objective and peak no higher), so an optimum
    without s exists. Between equal strategies the lower index stays. Nodes named by a
    checkpoint segment are left alone (their segment rows depend on the strategy too)."""
    nodes = problem.nodes
    fixed = {i for seg in getattr(problem, "segments", ()) for i in seg.nodes}
    incident: dict[int, list[tuple[int, int]]] = {}
    for key in merged:
        incident.setdefault(key[0], []).append(key)
        incident.setdefault(key[1], []).append(key)
    for _ in range(_DOMINANCE_ROUNDS):
        changed = False
        for i, node in enumerate(nodes):
            if len(allowed[i]) < 2 or i in fixed:
                continue
            strategies = sorted(allowed[i])
            columns = [
                [node_cost[i][s] for s in strategies],
                [node.memory_bytes[s] for s in strategies],
            ]
            if node.transient_bytes:
                columns.append([node.transient_bytes[s] for s in strategies])
            for key in incident.get(i, ()):
                table = merged[key]
                if key[0] == i:
                    for t in sorted(allowed[key[1]]):
                        columns.append([_finite(table.get((s, t))) for s in strategies])
                else:
                    for t in sorted(allowed[key[0]]):
                        columns.append([_finite(table.get((t, s))) for s in strategies])
            features = np.array(columns, dtype=np.float64).T  # strategies x features
            dead = _dominated_rows(features)
            if dead:
                allowed[i] -= {strategies[k] for k in dead}
                changed = True
        if not changed:
            break


def _finite(cost: float | None) -> float:
    return math.inf if cost is None else cost


def _dominated_rows(features: np.ndarray) -> set[int]:
    """Rows k for which another live row is <= everywhere and (< somewhere or lower index)."""
    dead: set[int] = set()
    num = len(features)
    for k in range(num):
        others = [j for j in range(num) if j != k and j not in dead]
        if not others:
            continue
        block = features[others]
        no_worse = np.all(block <= features[k], axis=1)
        if not no_worse.any():
            continue
        better = np.any(block < features[k], axis=1)
        earlier = np.array(others) < k
        if np.any(no_worse & (better | earlier)):
            dead.add(k)
    return dead
