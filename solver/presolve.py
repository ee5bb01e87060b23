"""Checks and exact presolve of a Problem, and exact evaluation of a plan.

Presolve works on numpy arrays: each merged edge is a dense (src strategies x dst strategies)
float64 matrix with +inf for a forbidden pair, each node's remaining strategies a boolean mask;
ilp.py (through solver/rows.py) builds its model from the Reduced result (see the presolve
paragraph of its module docstring). Plan evaluation is plain Python with math.fsum.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from solver.checkpointing import recompute_terms
from solver.errors import InfeasibleError
from solver.problem import Problem
from solver.tables import ArrayTable, table_matrix


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class PairEdge:
    """A merged edge that keeps variables. Arrays are +inf where a pair is forbidden."""

    src: int
    dst: int
    cost_s: np.ndarray
    """Cost of every (src strategy, dst strategy) pair, indexed by strategy: the merged
    table of the edges between the two nodes, +inf for a forbidden pair, strategies presolve
    removed included (``allows`` leaves them out). Shared: never write to it."""
    src_allowed: np.ndarray
    """Mask of the src strategies presolve kept."""
    dst_allowed: np.ndarray
    """Mask of the dst strategies presolve kept."""
    all_pairs_allowed: bool
    src_members: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """The src strategies kept, group after group (ascending within a group): src strategies
    whose rows (costs and forbidden pairs over the dst strategies) are identical form a
    group; the ILP links one pair variable per (src group, dst group)."""
    src_starts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    """Group g is ``src_members[src_starts[g]:src_starts[g + 1]]``."""
    dst_members: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """The dst strategies kept, grouped by identical columns, as ``src_members``."""
    dst_starts: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.int64))
    group_cost_s: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    """Cost of each (src group index, dst group index) block; +inf for a forbidden block."""

    @property
    def src_groups(self) -> tuple[tuple[int, ...], ...]:
        """Per src group (in group order): its strategies, ascending."""
        return _split(self.src_members, self.src_starts)

    @property
    def dst_groups(self) -> tuple[tuple[int, ...], ...]:
        """Per dst group (in group order): its strategies, ascending."""
        return _split(self.dst_members, self.dst_starts)

    def allows(self, s: int, t: int) -> bool:
        """Whether the pair (src strategy s, dst strategy t) is allowed and both are kept."""
        return bool(self.src_allowed[s] and self.dst_allowed[t] and np.isfinite(self.cost_s[s, t]))


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
    the segments ``recomputed``, solver/checkpointing.py), summed with math.fsum.

    Raises:
        InfeasibleError: an edge forbids the chosen pair.
    """
    terms = [node.cost_s[c] for node, c in zip(problem.nodes, choices, strict=True)]
    terms += edge_seconds(problem, choices)
    if recomputed:
        terms.append(recompute_terms(problem, choices, recomputed)[0])
    return math.fsum(terms)


def edge_seconds(problem: Problem, choices: Sequence[int]) -> list[float]:
    """Each edge's seconds for the plan ``choices``, in edge order.

    Raises:
        InfeasibleError: an edge forbids the chosen pair.
    """
    terms = []
    for k, edge in enumerate(problem.edges):
        cost = edge.cost_s[choices[edge.src]][choices[edge.dst]]
        if cost is None:
            raise InfeasibleError(
                f"edge {k} ({problem.nodes[edge.src].name!r} -> {problem.nodes[edge.dst].name!r})"
                f" forbids the pair ({choices[edge.src]}, {choices[edge.dst]})"
            )
        terms.append(cost)
    return terms


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
    checked: set[tuple[int, int, int]] = set()  # (id(cost_s), rows, cols): shared tables once
    for k, edge in enumerate(problem.edges):
        if not (0 <= edge.src < num_nodes and 0 <= edge.dst < num_nodes):
            raise ValueError(f"edge {k} ({edge.src} -> {edge.dst}) names a node out of range")
        rows, cols = problem.nodes[edge.src].num_choices, problem.nodes[edge.dst].num_choices
        key = (id(edge.cost_s), rows, cols)
        if key in checked:
            continue
        checked.add(key)
        if isinstance(edge.cost_s, ArrayTable):  # its rows are its matrix's: no tuples made
            shape_ok = edge.cost_s.matrix.shape == (rows, cols)
        else:
            shape_ok = len(edge.cost_s) == rows and all(len(row) == cols for row in edge.cost_s)
        if not shape_ok:
            raise ValueError(f"edge {k}: cost_s must be {rows} x {cols} (src x dst choices)")


def cost_matrix(cost_s: Sequence[Sequence[float | None]]) -> np.ndarray:
    """An edge's cost table as a float64 array, +inf for a forbidden (None) pair (read-only
    when the table holds its matrix: solver/tables.py ArrayTable)."""
    return table_matrix(cost_s)


def reduce_problem(problem: Problem) -> Reduced:
    """Presolve (see the module docstring); raises InfeasibleError when a node loses all.

    Edge tables are dense arrays (+inf forbids a pair) and the strategies still possible are
    boolean masks; the steps and their order are those of ilp.py's presolve paragraph."""
    nodes = problem.nodes
    allowed = [np.ones(n.num_choices, dtype=bool) for n in nodes]
    node_cost = [np.array(n.cost_s, dtype=np.float64) for n in nodes]
    merged = _merge_edges(problem, allowed, node_cost)
    for i in range(len(nodes)):
        _check_left(problem, allowed, i, "its self-edges forbid every strategy")
    _arc_consistency(problem, allowed, merged)
    _prune_dominated(problem, allowed, node_cost, merged)
    index = [np.flatnonzero(a) for a in allowed]
    kept, constant_s = _pair_edges(allowed, index, node_cost, merged)
    return Reduced(
        allowed=tuple(tuple(a.tolist()) for a in index),
        node_cost_s=tuple(
            dict(zip(a.tolist(), cost[a].tolist(), strict=True))
            for cost, a in zip(node_cost, index, strict=True)
        ),
        edges=tuple(kept),
        constant_s=constant_s,
    )


def _merge_edges(
    problem: Problem, allowed: list[np.ndarray], node_cost: list[np.ndarray]
) -> dict[tuple[int, int], np.ndarray]:
    """Parallel edges (either orientation) summed into one table per node pair (u < v, rows
    = u's strategies); a self-loop's diagonal goes into its node (in place on ``allowed``
    and ``node_cost``)."""
    merged: dict[tuple[int, int], np.ndarray] = {}
    converted: dict[int, np.ndarray] = {}  # id(cost_s) -> matrix: shared tables convert once
    for edge in problem.edges:
        matrix = converted.get(id(edge.cost_s))
        if matrix is None:
            matrix = converted[id(edge.cost_s)] = cost_matrix(edge.cost_s)
        if edge.src == edge.dst:  # a self-loop only ever sees the diagonal
            diag = np.diagonal(matrix)
            finite = np.isfinite(diag)
            allowed[edge.src] &= finite
            node_cost[edge.src] += np.where(finite, diag, 0.0)
            continue
        flip = edge.src > edge.dst
        key = (edge.dst, edge.src) if flip else (edge.src, edge.dst)
        previous = merged.get(key)
        table = matrix.T if flip else matrix
        merged[key] = table if previous is None else previous + table  # never written to
    return merged


def _check_left(
    problem: Problem, allowed: list[np.ndarray], i: int, why: str, other: int | None = None
) -> None:
    """Raise InfeasibleError when node i has no strategy left, saying ``why``."""
    nodes = problem.nodes
    if not allowed[i].any():
        raise InfeasibleError(
            f"node {nodes[i].name!r} (index {i}) has no strategy left: {why}; allow at least "
            f"one pair (a non-None cost) for some strategy of every edge",
            nodes=(nodes[i].name,) if other is None else (nodes[i].name, nodes[other].name),
        )


def _arc_consistency(
    problem: Problem, allowed: list[np.ndarray], merged: dict[tuple[int, int], np.ndarray]
) -> None:
    """Arc consistency (AC-3): drop strategies that no allowed pair of some edge supports, and
    revisit the edges of a node whenever it loses one (in place on ``allowed``)."""
    nodes = problem.nodes
    finite = {key: np.isfinite(table) for key, table in merged.items()}
    incident: dict[int, list[tuple[int, int]]] = {}
    for key in merged:
        for i in key:
            incident.setdefault(i, []).append(key)
    queue = deque(sorted(merged))
    queued = set(queue)
    while queue:
        u, v = key = queue.popleft()
        queued.discard(key)
        ok = finite[key] & allowed[u][:, None] & allowed[v][None, :]
        for i, supported in ((u, ok.any(axis=1)), (v, ok.any(axis=0))):
            if np.array_equal(supported, allowed[i]):
                continue
            allowed[i] = supported
            _check_left(
                problem,
                allowed,
                i,
                f"the edges between {nodes[u].name!r} and {nodes[v].name!r} forbid the rest",
                other=v if i == u else u,
            )
            for other in incident[i]:
                if other != key and other not in queued:
                    queue.append(other)
                    queued.add(other)


def _pair_edges(
    allowed: list[np.ndarray],
    index: list[np.ndarray],
    node_cost: list[np.ndarray],
    merged: dict[tuple[int, int], np.ndarray],
) -> tuple[list[PairEdge], float]:
    """The merged edges that keep pair variables, with their groups; the others become
    linear cost on one end (in place on ``node_cost``) or the constant returned."""
    constant_s = 0.0
    kept = []
    for (u, v), table in sorted(merged.items(), key=lambda item: item[0]):
        rows, cols = index[u], index[v]
        sub = table[np.ix_(rows, cols)]
        if len(rows) == 1:  # linear in the other end (arc consistency left it all allowed)
            node_cost[v][cols] += sub[0]
            continue
        if len(cols) == 1:
            node_cost[u][rows] += sub[:, 0]
            continue
        everything = bool(np.isfinite(sub).all())
        if everything and bool((sub == sub[0, 0]).all()):
            constant_s += float(sub[0, 0])
            continue
        row_label, row_first = _line_groups(sub)
        col_label, col_first = _line_groups(sub.T)
        if len(row_first) == 1 or len(col_first) == 1:
            # Every row (or column) is the same: the cost depends on one end only, and arc
            # consistency already removed the strategies a forbidden line would exclude.
            if len(row_first) == 1:
                node_cost[v][cols] += sub[0]
            else:
                node_cost[u][rows] += sub[:, 0]
            continue
        src_members, src_starts = _members(rows, row_label)
        dst_members, dst_starts = _members(cols, col_label)
        kept.append(
            PairEdge(
                src=u,
                dst=v,
                cost_s=table,
                src_allowed=allowed[u].copy(),
                dst_allowed=allowed[v].copy(),
                all_pairs_allowed=everything,
                src_members=src_members,
                src_starts=src_starts,
                dst_members=dst_members,
                dst_starts=dst_starts,
                group_cost_s=sub[np.ix_(row_first, col_first)],
            )
        )
    return kept, constant_s


def _line_groups(matrix: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Identical rows of ``matrix`` (equal values, -0.0 == 0.0, inf == inf): the group label
    of each row, groups numbered by first appearance, and each group's first row."""
    # -0.0 + 0.0 is 0.0, so (without nan) rows are equal exactly when their bytes are.
    normal = np.ascontiguousarray(matrix + 0.0)
    rows = normal.view(np.dtype((np.void, normal.dtype.itemsize * normal.shape[1])))[:, 0]
    _, first, inverse = np.unique(rows, return_index=True, return_inverse=True)
    order = np.argsort(first)  # unique (sorted) index -> rank by first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse.reshape(-1)], first[order].tolist()


def _members(strategies: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The strategies ordered by group label (ascending within a group) and where each group
    starts in that order (one more entry: the end)."""
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels)
    starts = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    return strategies[order].astype(np.int64, copy=False), starts


def _split(members: np.ndarray, starts: np.ndarray) -> tuple[tuple[int, ...], ...]:
    ordered = members.tolist()
    bounds = starts.tolist()
    return tuple(tuple(ordered[a:b]) for a, b in zip(bounds, bounds[1:]))


def group_pairs(
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

_FIRST_CHUNK = 4
_LARGEST_CHUNK = 256
_PAIR_ELEMENTS = 1 << 22
"""Features compared per step while candidate (dominator, dominated) pairs are filtered: few
at first (most pairs fail on cost or bytes), more as the candidates thin out, and at most
_PAIR_ELEMENTS comparisons at a time (bounded memory)."""


def _prune_dominated(
    problem: Problem,
    allowed: list[np.ndarray],
    node_cost: list[np.ndarray],
    merged: dict[tuple[int, int], np.ndarray],
) -> None:
    """Remove dominated strategies, exactly (in place on the ``allowed`` masks).

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
    memory = [np.array(n.memory_bytes, dtype=np.float64) for n in nodes]
    # A node is looked at again only once a neighbour has lost a strategy since its last look:
    # otherwise its rows are those it kept, none of which another row dominated.
    stale = set(range(len(nodes)))
    for _ in range(_DOMINANCE_ROUNDS):
        changed = False
        for i, node in enumerate(nodes):
            if i not in stale or i in fixed or np.count_nonzero(allowed[i]) < 2:
                continue
            stale.discard(i)
            strategies = np.flatnonzero(allowed[i])
            columns = [node_cost[i][strategies, None], memory[i][strategies, None]]
            if node.transient_bytes:
                transient = np.array(node.transient_bytes, dtype=np.float64)
                columns.append(transient[strategies, None])
            for key in incident.get(i, ()):
                table = merged[key]
                if key[0] == i:
                    columns.append(table[np.ix_(strategies, allowed[key[1]])])
                else:
                    columns.append(table[np.ix_(allowed[key[0]], strategies)].T)
            dead = _dominated_rows(np.hstack(columns))
            if dead.any():
                allowed[i][strategies[dead]] = False
                changed = True
                stale.update(v if u == i else u for u, v in incident.get(i, ()))
        if not changed:
            break


def _dominated_rows(features: np.ndarray) -> np.ndarray:
    """Mask of the rows k for which another row j is <= everywhere and (< somewhere or j < k).

    That relation is a strict partial order (irreflexive, transitive), so every dominated row
    has an undominated dominator: the rows to drop do not depend on the order they are found
    in. Candidate pairs (j, k) are filtered one feature at a time on the whole square while
    many survive, then a chunk of features at a time on the survivors."""
    num = len(features)
    varying = features[:, np.any(features != features[:1], axis=0)]  # the rest tell none apart
    no_worse = ~np.eye(num, dtype=bool)
    start = 0
    while start < varying.shape[1] and 4 * np.count_nonzero(no_worse) > no_worse.size:
        column = varying[:, start]
        no_worse &= column[:, None] <= column[None, :]
        start += 1
    j, k = np.nonzero(no_worse)
    chunk = _FIRST_CHUNK
    while start < varying.shape[1] and len(j):
        width = max(1, min(chunk, _PAIR_ELEMENTS // len(j)))
        block = varying[:, start : start + width]
        keep = np.all(block[j] <= block[k], axis=1)
        j, k = j[keep], k[keep]
        start, chunk = start + width, min(2 * chunk, _LARGEST_CHUNK)
    wins = j < k  # no worse and earlier; a later row must be better somewhere
    later = ~wins
    if later.any():
        wins[later] = np.any(varying[j[later]] < varying[k[later]], axis=1)
    dead = np.zeros(num, dtype=bool)
    dead[k[wins]] = True
    return dead
