"""Lower bounds on one problem's pattern optima from another's, kept from its last pattern
evaluation (issue 16: the ZeRO configurations of one search).

The pattern bound of :mod:`solver.lagrangian` (``pattern_dual``) solves, at a multiplier lam,
one priced problem per recompute pattern p: the pattern-free priced problem (the base) plus
the pattern's terms, which the segments alone make (solver/pattern_bounds.py
``pattern_terms``). The ZeRO configurations of one search share their segments object
(contracted alike: solver/checkpointing.py) and differ in a few nodes' seconds and bytes (a
stage changes what a parameter strategy costs and keeps), so two configurations' pattern
problems of a pattern differ only in their bases. For every plan x,

    F_B(x) = F_A(x) + sum over nodes of (c_B - c_A)(x_i) + sum over edges of (E_B - E_A)(x),

so B's optimum is at least A's lower bound plus the least entry of each difference. That is
loose where a node's cheapest difference is at a strategy A would never take: a parameter
whose ZeRO-3 shard saves many priced bytes (llama3-70b b256 fp32, stage 3 against
(3,3,2): -162 ms in all, where the two bounds differ by +0.04 ms). Such a node is a leaf (its
one edge to the op that reads it), so it is folded first: with every other node fixed, the
leaf's best strategy for each strategy t of its neighbour costs

    g(t) = min over s of [c(s) + n_p(s) + E(s, t) + e_p(s, t)]

(n_p, e_p: the pattern's terms on the leaf and its edge, the same in both problems), and
min_x F = min over the other nodes of [the rest + sum over leaves of g]. So B's optimum is at
least A's bound plus, per folded leaf, the least entry of g_B - g_A (a strategy the neighbour
would not take with A's parameter is no longer the worst case: -22 ms on that row), plus the
least differences of the other nodes and edges. A leaf in a tie class is not folded (where
the solver makes a class choose alike, its best strategy is not its own to pick), nor one a
pattern's term adds another edge to (in that pattern's problem).

Stage 3 of that row is bounded at the multipliers where (3,3,2)'s relaxation ended, with the
same segments and patterns: of the 15 count patterns it solved, the kept bounds rule out 11
(the same bound).
"""

from __future__ import annotations

import math

import numpy as np

from solver.pattern_bounds import term_array
from solver.presolve import cost_matrix
from solver.problem import Problem

__all__ = ["forget_lowers", "keep_lowers", "kept_floors"]

TOLERANCE = 1e-9
"""Relative slack on a derived bound: the solver forms its sums in another order."""

_LOWERS: list[tuple] = []
"""The last :func:`keep_lowers` evaluation: (the segments object, held; the multiplier and
patterns; the per-pattern lower bounds; the pattern-free priced problem)."""


def forget_lowers() -> None:
    """Drop the evaluation :func:`keep_lowers` keeps (the end of a search)."""
    _LOWERS.clear()


def keep_lowers(
    problem: Problem, base: Problem, lam: float, patterns: list[tuple[int, ...]], lowers: list
) -> None:
    """Keep one pattern evaluation's lower bounds per pattern (lagrangian.pattern_dual on
    ``problem`` at ``lam``; ``base``: its pattern-free priced problem) for
    :func:`kept_floors`."""
    _LOWERS[:] = [(problem.segments, (lam, tuple(patterns)), list(lowers), base)]


def kept_floors(
    problem: Problem,
    base: Problem,
    lam: float,
    patterns: list[tuple[int, ...]],
    terms: list[tuple],
) -> list[float] | None:
    """Lower bounds per pattern of ``problem``'s pattern problems at ``lam`` (``base``: its
    pattern-free priced problem; ``terms``: pattern_bounds.pattern_terms of each pattern)
    from the evaluation kept (module docstring), where that was on the very same segments
    object, multiplier and patterns and its base has ``base``'s shape (strategy counts,
    edges' ends, tie classes) and other seconds; else None (nothing kept, or the same
    problem evaluated again: a relaxation at its bound's multiplier, whose recorded solves
    serve it, and whose path the kept bounds would change)."""
    if not _LOWERS or _LOWERS[0][0] is not problem.segments:
        return None
    _, key, lowers, other = _LOWERS[0]
    if key != (lam, tuple(patterns)) or not _same_shape(base, other):
        return None
    nodes = [
        i
        for i, (mine, theirs) in enumerate(zip(base.nodes, other.nodes, strict=True))
        if mine.cost_s is not theirs.cost_s
        and not np.array_equal(np.asarray(mine.cost_s), np.asarray(theirs.cost_s))
    ]
    edges = [
        k
        for k, (mine, theirs) in enumerate(zip(base.edges, other.edges, strict=True))
        if mine.cost_s is not theirs.cost_s
        and not np.array_equal(cost_matrix(mine.cost_s), cost_matrix(theirs.cost_s))
    ]
    if not nodes and not edges:
        return None
    leaves = _leaves(base, nodes)
    folded_edges = set(leaves.values())
    plain = [_node_difference(base, other, i) for i in nodes if i not in leaves]
    plain += [_edge_difference(base, other, k) for k in edges if k not in folded_edges]
    held: dict = {}
    pairs = {(e.src, e.dst) for e in base.edges}
    floors = []
    for value, (_, _, extra, extra_edges) in zip(lowers, terms, strict=True):
        # A pattern's term on a pair the base has no edge for adds one (pattern_problem): a
        # leaf there is not one in that pattern's problem.
        touched = {end for key in extra_edges if key not in pairs for end in key}
        parts = list(plain)
        for i, k in leaves.items():
            if i in touched:
                parts.append(_node_difference(base, other, i))
                parts.append(_edge_difference(base, other, k))
            else:
                edge = base.edges[k]
                parts.append(
                    _fold_difference(
                        base, other, i, k, extra.get(i), extra_edges.get((edge.src, edge.dst)), held
                    )
                )
        bound = value + math.fsum(parts)
        floors.append(bound - TOLERANCE * abs(bound) if math.isfinite(bound) else -math.inf)
    return floors


def _same_shape(a: Problem, b: Problem) -> bool:
    """The same nodes' strategy counts (so edge shapes), edges' ends and tie classes."""
    return (
        len(a.nodes) == len(b.nodes)
        and len(a.edges) == len(b.edges)
        and a.tied == b.tied
        and all(x.num_choices == y.num_choices for x, y in zip(a.nodes, b.nodes, strict=True))
        and all((x.src, x.dst) == (y.src, y.dst) for x, y in zip(a.edges, b.edges, strict=True))
    )


def _leaves(base: Problem, nodes: list[int]) -> dict[int, int]:
    """Of ``nodes``, those with exactly one edge (to another node: a self pair counts twice)
    and in no tie class: each with that edge's index."""
    count: dict[int, int] = {}
    edge_of: dict[int, int] = {}
    for k, e in enumerate(base.edges):
        for end in (e.src, e.dst):
            count[end] = count.get(end, 0) + 1
            edge_of[end] = k
    tied = {i for members in base.tied for i in members}
    return {i: edge_of[i] for i in nodes if count.get(i) == 1 and i not in tied}


def _least(mine: np.ndarray, theirs: np.ndarray) -> float:
    """The least entry of ``mine - theirs`` where ``mine`` is finite (a strategy forbidden
    here is never chosen: it lowers nothing; one forbidden there only gives -inf, a valid,
    useless bound)."""
    if mine.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):  # inf - inf: forbidden in both
        return float(np.min(np.where(np.isfinite(mine), mine - theirs, np.inf)))


def _node_difference(base: Problem, other: Problem, i: int) -> float:
    return _least(np.asarray(base.nodes[i].cost_s), np.asarray(other.nodes[i].cost_s))


def _edge_difference(base: Problem, other: Problem, k: int) -> float:
    return _least(cost_matrix(base.edges[k].cost_s), cost_matrix(other.edges[k].cost_s))


def _fold_difference(
    base: Problem,
    other: Problem,
    i: int,
    k: int,
    node_term: np.ndarray | None,
    edge_term: np.ndarray | None,
    held: dict,
) -> float:
    """The least entry of g_B - g_A for leaf ``i`` on edge ``k`` with a pattern's terms
    (module docstring); kept in ``held`` by the terms' identity (patterns share them)."""
    key = (i, id(node_term), id(edge_term))
    found = held.get(key)
    if found is None:
        folded = []
        for problem in (base, other):
            cost = np.asarray(problem.nodes[i].cost_s, dtype=float)
            if node_term is not None:
                cost = cost + node_term
            table = cost_matrix(problem.edges[k].cost_s)
            if edge_term is not None:
                table = table + term_array(edge_term)
            if problem.edges[k].src == i:  # rows are the leaf's strategies
                folded.append(np.min(cost[:, None] + table, axis=0))
            else:
                folded.append(np.min(table + cost[None, :], axis=1))
        found = held[key] = (_least(folded[0], folded[1]), node_term, edge_term)
    return found[0]
