"""Lower bounds on the recompute patterns' priced optima from the patterns already solved.

In the pattern bound of :mod:`solver.lagrangian` (``pattern_dual``), pattern p's priced
problem is the pattern-free one plus its terms e_p (per node and per edge of its recomputed
segments). For any two patterns p and q and every plan x,

    F + e_p (x) = F + e_q (x) + (e_p - e_q)(x)  >=  v_q + sum over nodes and edges of
                                                    min over their entries of (e_p - e_q)

with v_q a lower bound on q's optimum, so once q is solved every other pattern's lower bound
may rise to that. Against the pattern-free problem (q = nothing recomputed) this is the bound
``pattern_dual`` started from; against a solved pattern that differs from p in a few segments
it is much closer, so fewer patterns need their own solve (torch-free). Also here: the
terms themselves (``pattern_terms``) and the chord of a pattern's values across multipliers.
"""

from __future__ import annotations

import math

import numpy as np

from solver.problem import Problem

__all__ = ["PatternTerms", "chord_floor", "pattern_terms"]


def _segment_arrays(problem: Problem, k: int, cache: dict | None) -> tuple:
    """Segment k's rows as arrays: per node (node, recompute seconds, freed bytes), per edge
    ((src, dst), seconds), and its smallest freed bytes; kept in ``cache`` when given."""
    if cache is not None and k in cache:
        return cache[k]
    seg = problem.segments[k]
    rows = [
        (n, np.asarray(again, dtype=float), np.asarray(freed, dtype=float))
        for n, freed, again in zip(seg.nodes, seg.freed_bytes, seg.recompute_s, strict=True)
    ]
    edges = [((e.src, e.dst), np.asarray(e.cost_s, dtype=float)) for e in seg.edges]
    smallest = math.fsum(min(row) for row in seg.freed_bytes)
    if cache is not None:
        cache[k] = (rows, edges, smallest)
    return rows, edges, smallest


def pattern_terms(
    problem: Problem, lam: float, pattern: tuple[int, ...], cache: dict | None = None
):
    """What one recompute pattern adds to the pattern-free priced problem (module
    docstring): per node and per edge, and a separable lower bound of their sum; also the
    segment j whose bytes alive again are priced (None: nothing recomputed). ``cache``: a
    dict kept across calls on one problem (the segments as arrays)."""
    on = [k for k, r in enumerate(pattern) if r]
    arrays = {k: _segment_arrays(problem, k, cache) for k in on}
    alive = max(on, key=lambda k: arrays[k][2]) if on else None
    extra: dict[int, np.ndarray] = {}
    extra_edges: dict[tuple[int, int], np.ndarray] = {}
    for k in on:
        r = pattern[k]
        rows, edges, _ = arrays[k]
        for n, again, freed in rows:
            term = r * (again - lam * freed)
            if k == alive:
                term = term + lam * freed
            extra[n] = extra.get(n, 0.0) + term
        for key, seconds in edges:
            extra_edges[key] = extra_edges.get(key, 0.0) + r * seconds
    lower = math.fsum(float(np.min(v)) for v in extra.values()) + math.fsum(
        float(np.min(m)) for m in extra_edges.values()
    )
    return lower, alive, extra, extra_edges


class PatternTerms:
    """Every pattern's terms as one row of a matrix (nodes and edges side by side, zero where
    a pattern adds nothing), and the start of each node's or edge's entries in a row."""

    def __init__(self, terms: list[tuple[dict, dict]]) -> None:
        sizes: dict[tuple, int] = {}
        for extra, extra_edges in terms:
            for n, v in extra.items():
                sizes[("n", n)] = np.size(v)
            for key, m in extra_edges.items():
                sizes[("e", key)] = np.size(m)
        keys = sorted(sizes)
        start, offsets, at = {}, [], 0
        for key in keys:
            start[key] = at
            offsets.append(at)
            at += sizes[key]
        self.width = at
        self.offsets = np.asarray(offsets, dtype=np.intp)
        self.rows = np.zeros((len(terms), self.width))
        for k, (extra, extra_edges) in enumerate(terms):
            for n, v in extra.items():
                at = start[("n", n)]
                self.rows[k, at : at + sizes[("n", n)]] = np.ravel(v)
            for key, m in extra_edges.items():
                at = start[("e", key)]
                self.rows[k, at : at + sizes[("e", key)]] = np.ravel(m)

    def floors(self, solved: int, value: float) -> np.ndarray:
        """Per pattern: a lower bound on its optimum, given ``value`` <= pattern ``solved``'s."""
        if not self.width:
            return np.full(len(self.rows), value)
        diff = self.rows - self.rows[solved]
        return value + np.minimum.reduceat(diff, self.offsets, axis=1).sum(axis=1)


def chord_floor(seen: dict[float, list[float]], lam: float) -> list[float] | None:
    """Each pattern's value is concave in lam (a minimum of functions affine in lam), so
    between two multipliers already evaluated it is at least the chord of their lower bounds:
    per pattern, the highest chord over every pair around ``lam`` (the nearest pair's can be
    weak where one end's evaluation gave up early: its bounds are then loose)."""
    lefts = [a for a in seen if a < lam]
    rights = [b for b in seen if b > lam]
    if not lefts or not rights:
        return None
    floor = np.full(len(seen[lefts[0]]), -np.inf)
    for a in lefts:
        low = np.asarray(seen[a])
        for b in rights:
            t = (lam - a) / (b - a)
            np.maximum(floor, (1.0 - t) * low + t * np.asarray(seen[b]), out=floor)
    return floor.tolist()
