"""Lagrangian reduced-cost fixing: strategies no plan better than a known one can use.

For a budgeted Problem (solver/lagrangian.py's notation: node choices x, recomputed copies
r, step time C(x) + R(x, r), peak P(x, r) <= B) and a multiplier lam >= 0, every plan that
fits satisfies

    C(x) + R(x, r) >= C(x) + R(x, r) + lam (P(x, r) - B) >= F_lam(x) + lam (offset + t0 - B)

where F_lam is the budget-free priced problem of :func:`lagrangian.priced` (the separable
segment term), or, for a plan whose recompute vector is the pattern p, the pattern problem
F_lam,p of :func:`lagrangian.pattern_dual`. So for node i and strategy s,

    LB(i, s) = min over x with x_i = s of F_lam(x)            + lam (offset + t0 - B)
             = min over patterns p of (min over x_i = s of F_lam,p(x)) + lam (...)

is at most the step time of every plan that fits and uses s at i. With UB the step time of a
plan that fits, a strategy with LB(i, s) > UB is in no plan better than that one, so in no
optimal plan: it is dropped, and the MIP runs over what stays (:func:`restrict_budgeted`).
Every optimal plan survives, the optimum of the rest is the optimum of the whole, and a lower
bound on the rest (the MIP's) is one on the whole, since the known plan stays in play.

The minima over x_i = s are bounded below by min-marginals of the budget-free problem
(:func:`min_marginals`): tie classes contracted (the budgeted path forces them alike), then
per node the pinned elimination of solver/prune.py on a relaxed graph (exact where the graph
is series-parallel, below the true minimum elsewhere), so LB stays a valid lower bound.
Every node is covered, those that budget-free elimination would remove included.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from solver.count_patterns import CountPatterns
from solver.eliminate import SeriesMemo, _MinPlusGraph
from solver.lagrangian import priced, transient_floor
from solver.pattern_bounds import pattern_terms
from solver.problem import Edge, Node, Problem, SegmentEdge
from solver.tables import ArrayTable, Table, entry_array, sub_table
from solver.tying import contract

_DENSE_ENTRIES = 4_000_000
"""A series clique with at most this many (u, v, w) entries is formed as one 3-D array."""

TOLERANCE = 1e-9
"""Relative slack on UB: sums in another order must not drop a strategy of an optimal plan."""


def _contracted_graph(problem: Problem) -> tuple[_MinPlusGraph, Sequence[int], int]:
    """The min-plus graph of a budget-free ``problem`` with its tie classes contracted (forced
    alike), the original node -> graph node map, and the graph's number of nodes."""
    assert problem.memory_budget_bytes is None and not problem.segments
    if not problem.tied:
        return _MinPlusGraph(problem), range(len(problem.nodes)), len(problem.nodes)
    contracted = contract(problem)
    inner = contracted.problem
    return _MinPlusGraph(inner), contracted.node_map, len(inner.nodes)


def _copy(graph: _MinPlusGraph) -> _MinPlusGraph:
    """A copy to eliminate on (arrays are never written in place, so shared)."""
    out = object.__new__(_MinPlusGraph)
    out.cost = list(graph.cost)
    out.edges = dict(graph.edges)
    out.neighbours = [set(n) for n in graph.neighbours]
    return out


def graph_marginals(graph: _MinPlusGraph, num: int, memo: SeriesMemo) -> list[np.ndarray]:
    """Per graph node, per strategy: a lower bound on the smallest cost of a plan using it,
    exact on series-parallel graphs. ``graph`` is consumed.

    Forward, leaf and series nodes are eliminated as in solver/eliminate.py; where every node
    left has degree 3 or more one is split as in solver/prune.py (a relaxation: its minima
    are at most the original's). Backward, each eliminated node's clique (itself and its one
    or two neighbours) gets its min-marginal from its neighbours' (pair) min-marginal in the
    graph after it was eliminated, less the message it sent, plus its own terms."""
    cost = graph.cost
    alive = set(range(num))
    steps: list[tuple] = []
    alone: dict[int, float] = {}  # per connected component: its last node's smallest cost
    while alive:
        v = min(alive, key=lambda k: (len(graph.neighbours[k]), k))
        if len(graph.neighbours[v]) > 2:
            copy, n1, n2 = graph.split(v)
            steps.append(("split", v, copy, n1, n2))
            v = copy
        else:
            alive.discard(v)
        near = sorted(graph.neighbours[v])
        cv = cost[v]
        if not near:
            steps.append(("alone", v, cv))
            alone[v] = float(np.min(cv))
        elif len(near) == 1:
            (u,) = near
            uv = graph.oriented(u, v)
            message = np.min(uv + cv[None, :], axis=1)
            steps.append(("leaf", v, cv, u, uv, message))
            cost[u] = cost[u] + message
            graph.drop(u, v)
        else:
            u, w = near
            uv, vw = graph.oriented(u, v), graph.oriented(v, w)
            best = memo.series(uv, cv, vw)[0]
            steps.append(("series", v, cv, u, w, uv, vw, best))
            graph.drop(u, v)
            graph.drop(v, w)
            graph.add_edge(u, w, best)
    marginal: dict[int, np.ndarray] = {}
    pairs: dict[tuple[int, int], np.ndarray] = {}

    def pair(a: int, b: int) -> np.ndarray:
        return pairs[a, b] if a < b else pairs[b, a].T

    def put(a: int, b: int, matrix: np.ndarray) -> None:
        if a > b:
            a, b, matrix = b, a, matrix.T
        old = pairs.get((a, b))
        pairs[a, b] = matrix if old is None else np.maximum(old, matrix)

    for step in reversed(steps):
        kind, v = step[0], step[1]
        if kind == "split":  # every plan before the split is one after it, copies alike
            _, v, copy, n1, n2 = step
            put(v, n1, pair(copy, n1))
            put(v, n2, pair(copy, n2))
        elif kind == "alone":
            others = math.fsum(value for k, value in alone.items() if k != v)
            marginal[v] = step[2] + others  # the other components are independent
        elif kind == "leaf":
            _, v, cv, u, uv, message = step
            rest = _less(marginal[u], message)
            table = rest[:, None] + uv + cv[None, :]
            marginal[v] = np.min(table, axis=0)
            put(u, v, table)
        else:
            _, v, cv, u, w, uv, vw, best = step
            rest = _less(pair(u, w), best)
            if rest.size * len(cv) <= _DENSE_ENTRIES:
                sums = rest[:, None, :] + uv[:, :, None] + vw[None, :, :]
                with_u = np.min(sums, axis=2) + cv[None, :]
                with_w = np.min(sums, axis=0) + cv[:, None]
            else:  # one strategy of v at a time: 2-D work arrays only
                with_u, with_w = np.empty_like(uv), np.empty_like(vw)
                for t in range(len(cv)):
                    sums = rest + uv[:, t][:, None] + vw[t][None, :]
                    with_u[:, t] = np.min(sums, axis=1) + cv[t]
                    with_w[t] = np.min(sums, axis=0) + cv[t]
            marginal[v] = np.min(with_u, axis=0)
            put(u, v, with_u)
            put(v, w, with_w)
    return [marginal[i] for i in range(num)]


def _less(total: np.ndarray, message: np.ndarray) -> np.ndarray:
    """``total - message`` where the message is finite (+inf where it is not: no plan)."""
    finite = np.isfinite(message)
    return np.where(finite, total - np.where(finite, message, 0.0), np.inf)


def min_marginals(problem: Problem) -> list[np.ndarray]:
    """Per node of a budget-free ``problem`` without segments (tie classes forced alike), per
    strategy: a lower bound on the smallest cost of a plan that uses it (module docstring)."""
    graph, node_map, num = _contracted_graph(problem)
    found = graph_marginals(graph, num, SeriesMemo())
    return [found[node_map[i]] for i in range(len(problem.nodes))]


def reduced_cost_keep(
    problem: Problem,
    lam: float,
    upper_s: float,
    patterns: list[tuple[int, ...]] | None,
    floors: list[float] | None = None,
) -> list[np.ndarray]:
    """Per node of the budgeted ``problem``: LB(i, .) at the multiplier ``lam`` (module
    docstring), over the recompute ``patterns`` when given (else the separable segment
    term). Patterns whose bound exceeds ``upper_s`` are skipped (+inf): the separable one,
    or ``floors`` (per pattern, a lower bound on its priced optimum at ``lam``, the
    relaxation's)."""
    budget = problem.memory_budget_bytes
    assert budget is not None
    constant = lam * (problem.memory_offset_bytes + transient_floor(problem) - budget)
    if patterns is None:
        return [m + constant for m in min_marginals(priced(problem, lam))]
    limit = upper_s + TOLERANCE * abs(upper_s) - constant
    lowest = [np.full(n.num_choices, math.inf) for n in problem.nodes]
    base, node_map, num = _contracted_graph(priced(dataclasses.replace(problem, segments=()), lam))
    memo, cache = SeriesMemo(), {}
    base_marginals = graph_marginals(_copy(base), num, memo)
    base_low = float(np.min(base_marginals[0]))
    for k, pattern in enumerate(patterns):
        if floors is not None and floors[k] > limit:
            continue  # no plan of this pattern is within UB
        if not any(pattern):
            found = base_marginals
        else:
            lower, _, extra, extra_edges = pattern_terms(problem, lam, pattern, cache)
            if base_low + lower > limit:
                continue
            graph = _copy(base)
            for i, add in extra.items():
                k = node_map[i]
                graph.cost[k] = graph.cost[k] + add
            for (src, dst), add in extra_edges.items():
                graph.add_edge(node_map[src], node_map[dst], np.asarray(add, dtype=float))
            found = graph_marginals(graph, num, memo)
        for i, low in enumerate(lowest):
            np.minimum(low, found[node_map[i]], out=low)
    return [low + constant for low in lowest]


def fix(
    problem: Problem,
    lam: float,
    plan: tuple[int, ...] | None,
    upper_s: float,
    patterns: list[tuple[int, ...]] | None,
    counted: CountPatterns | None = None,
    floors: list[float] | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Per node, the strategies (ascending) whose LB at ``lam`` is within ``upper_s``: the
    step time of a plan that fits (``plan``, whose own strategies always stay), or less (a
    cutoff: then a node may keep none, and no plan costs ``upper_s`` or less). ``counted``:
    the LB over count patterns on the contracted problem instead (solver/count_patterns.py;
    a bound over plans whose tie classes choose alike, as the budgeted MIP's are).
    ``floors``: per pattern, a lower bound on its priced optimum at ``lam``."""
    if counted is None:
        lower = reduced_cost_keep(problem, lam, upper_s, patterns, floors)
    else:
        found = reduced_cost_keep(counted.problem, lam, upper_s, counted.patterns, floors)
        lower = [found[k] for k in counted.contracted.node_map]
    limit = upper_s + TOLERANCE * abs(upper_s)
    keep = []
    for low, c in zip(lower, plan or (None,) * len(lower), strict=True):
        mask = low <= limit
        if c is not None:
            mask[c] = True
        keep.append(mask)
    for members in problem.tied:  # a class offers one set: the union (never loses a plan)
        union = np.logical_or.reduce([keep[i] for i in members])
        for i in members:
            keep[i] = union
    return tuple(tuple(int(s) for s in np.flatnonzero(mask)) for mask in keep)


def restrict_budgeted(problem: Problem, keep: tuple[tuple[int, ...], ...]) -> Problem:
    """``problem`` (budget, tie classes and segments kept) with node i offered only
    ``keep[i]`` (ascending; members of a tie class must keep the same strategies)."""
    index = [np.asarray(k, dtype=np.intp) for k in keep]
    arrays: dict[int, np.ndarray] = {}  # id(table) -> its entries: shared tables convert once
    sliced: dict[tuple[int, tuple[int, ...], tuple[int, ...]], Table] = {}
    sliced_matrices: dict[tuple[int, tuple[int, ...], tuple[int, ...]], np.ndarray] = {}

    def table(rows: Table, src: int, dst: int) -> Table:
        key = (id(rows), keep[src], keep[dst])
        if isinstance(rows, ArrayTable):  # sliced as a matrix: no tuples made
            matrix = sliced_matrices.get(key)
            if matrix is None:
                matrix = sliced_matrices[key] = rows.matrix[np.ix_(keep[src], keep[dst])]
                matrix.flags.writeable = False
            return ArrayTable(matrix)  # an object per edge, as below
        found = sliced.get(key)
        if found is None:
            entries = arrays.get(id(rows))
            if entries is None:
                entries = arrays[id(rows)] = entry_array(rows)
            found = sliced[key] = sub_table(entries, keep[src], keep[dst])
        # Each edge gets its own table object (its rows shared), as one built entry by entry:
        # tie contraction sums tables by identity, so sharing them would change its floats.
        return tuple(list(found))

    edges = tuple(
        Edge(src=e.src, dst=e.dst, cost_s=table(e.cost_s, e.src, e.dst)) for e in problem.edges
    )
    segments = tuple(
        dataclasses.replace(
            seg,
            freed_bytes=tuple(
                tuple(np.asarray(row)[index[n]].tolist())
                for n, row in zip(seg.nodes, seg.freed_bytes, strict=True)
            ),
            recompute_s=tuple(
                tuple(np.asarray(row)[index[n]].tolist())
                for n, row in zip(seg.nodes, seg.recompute_s, strict=True)
            ),
            edges=tuple(
                SegmentEdge(src=e.src, dst=e.dst, cost_s=table(e.cost_s, e.src, e.dst))
                for e in seg.edges
            ),
        )
        for seg in problem.segments
    )
    nodes: tuple[Node, ...] = tuple(
        n.restricted(k) for n, k in zip(problem.nodes, keep, strict=True)
    )
    return dataclasses.replace(problem, nodes=nodes, edges=edges, segments=segments)
