"""Recompute patterns as counts over alike layers: the pattern bound for deep tied stacks.

The pattern bound of :mod:`solver.lagrangian` (``pattern_dual``) solves one priced budget-free
problem per recompute pattern, a vector of copies per segment; 8 layers of 4 segments each
have far more patterns than it can afford (``MAX_PATTERNS``). Under a budget with segments the
tie classes choose alike (solver/tying.py), so the problem may be solved on its contraction:
one node per class, the segments that become identical merged into one "kind" with their
copies summed (checkpointing.contract_segments). There a pattern is a vector of counts r per
kind, and for plans x (alike) the pattern relaxation of a count vector r whose recomputed
kind of highest priority is j (priority: the kind's smallest freed bytes, the same rule by
which ``pattern_terms`` picks the segment alive again) is

    L_j(x, r) = F_lam(x) + sum_g r_g (T_g(x) - lam A_g(x)) + lam A_j(x),

linear in r. The segments fall apart into components of their overlap graph (a layer's
nested segments); each component recomputes one of its local patterns (copies per segment
with overlapping segments never both at full copies, as in ``recompute_patterns``: a superset
of what can be laid out), so r is a sum over components of their local patterns mapped onto
kinds. Components whose sets of local kind vectors are equal form a class (the layers that
contract alike). For fixed x and j the minimum of L_j over the count vectors in region j (no
kind above j, at least one j) is

    sum over components of (the cheapest local pattern with no kind above j)
    + the least extra cost of making one component's pattern include j,

so it is attained by a vector where every component of a class takes the same local pattern
p_C, except at most one component that takes a local pattern q containing j. Those vectors
(:func:`count_patterns`) are the patterns: min over them of min_x L_j is at most min over
every allowed (x, r), hence D(lam) stays a lower bound on the budgeted optimum over plans
whose tied layers choose alike, which is what the budgeted MIP solves.

For fixed j, min_x L_j(x, r) is concave in r (a minimum of functions linear in r), so over
the vectors of region j it is attained at a vertex of their convex hull: a vector that is a
convex combination of others of its region is dropped (:func:`_hull_vertices`, one small LP
each).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import numpy as np

from solver import highs_direct
from solver.checkpointing import contract_segments, overlap_components
from solver.problem import Problem, Segment
from solver.tying import Contracted, contract

MAX_COUNT_PATTERNS = 400
"""Above this many count patterns the separable bound is kept."""

MAX_LOCAL_PATTERNS = 64
"""Above this many local patterns in one component the separable bound is kept."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CountPatterns:
    """The contracted problem and its patterns (counts per merged segment)."""

    problem: Problem
    """The tie classes contracted, the segments merged (budget and offset kept)."""
    contracted: Contracted
    """Maps the contracted nodes back to the original ones (tying.expand)."""
    patterns: list[tuple[int, ...]]


def _local_patterns(
    segments: tuple[Segment, ...], members: list[int]
) -> list[dict[int, int]] | None:
    """Copies per member segment, overlapping members never beyond their pairwise row."""
    sets = {k: set(segments[k].footprint or segments[k].nodes) for k in members}
    found: list[dict[int, int]] = [{}]
    for k in members:
        seg = segments[k]
        grown = []
        for head in found:
            for r in range(seg.min_copies, seg.copies + 1):
                if all(
                    head[b] * seg.copies + r * segments[b].copies <= seg.copies * segments[b].copies
                    for b in head
                    if sets[b] & sets[k]
                ):
                    grown.append({**head, k: r})
        found = grown
        if len(found) > MAX_LOCAL_PATTERNS:
            return None
    return found


def count_patterns(problem: Problem) -> CountPatterns | None:
    """The count patterns of a budgeted problem with tie classes and segments (module
    docstring); None where it does not apply or they are too many."""
    if not problem.tied or not problem.segments or problem.memory_budget_bytes is None:
        return None
    contracted = contract(problem)
    merged, groups = contract_segments(problem, contracted.node_map)
    kind = {k: g for g, members in enumerate(groups) for k in members}
    num_kinds = len(merged)
    classes: dict[tuple, int] = {}  # the set of a component's local kind vectors -> components
    for members in overlap_components(problem.segments):
        local = _local_patterns(problem.segments, members)
        if local is None:
            return None
        vectors = set()
        for pattern in local:
            v = [0] * num_kinds
            for k, r in pattern.items():
                v[kind[k]] += r
            vectors.add(tuple(v))
        key = tuple(sorted(vectors))
        classes[key] = classes.get(key, 0) + 1
    smallest = [math.fsum(min(row) for row in seg.freed_bytes) for seg in merged]
    rank = {g: (smallest[g], -g) for g in range(num_kinds)}  # pattern_terms's alive rule
    found: set[tuple[int, ...]] = set()
    items = list(classes.items())
    for j in [None, *range(num_kinds)]:
        above = [g for g in range(num_kinds) if j is not None and rank[g] > rank[j]]
        allowed = [
            [v for v in vectors if all(v[g] == 0 for g in above) and (j is not None or not any(v))]
            for vectors, _ in items
        ]
        if not all(allowed):
            continue
        for special in range(len(items)) if j is not None else [None]:
            specials = [None] if special is None else [v for v in allowed[special] if v[j]]
            for q in specials:
                for choice in itertools.product(*allowed):
                    total = [0] * num_kinds
                    for c, (v, (_, count)) in enumerate(zip(choice, items, strict=True)):
                        times = count - 1 if c == special else count
                        for g in range(num_kinds):
                            total[g] += times * v[g]
                    if q is not None:
                        total = [t + x for t, x in zip(total, q, strict=True)]
                    found.add(tuple(total))
                    if len(found) > MAX_COUNT_PATTERNS:
                        return None
    regions: dict[int | None, list[tuple[int, ...]]] = {}
    for r in found:  # by the kind alive again: the highest ranked recomputed
        on = [g for g in range(num_kinds) if r[g]]
        regions.setdefault(max(on, key=lambda g: rank[g]) if on else None, []).append(r)
    patterns = sorted(v for points in regions.values() for v in _hull_vertices(points))
    inner = dataclasses.replace(contracted.problem, segments=merged)
    return CountPatterns(problem=inner, contracted=contracted, patterns=patterns)


def _hull_vertices(points: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The points that are no convex combination of the others (all of them without
    highspy: keeping more patterns only costs solves)."""
    if len(points) <= 2 or not highs_direct.available():
        return points
    highspy = highs_direct.highspy
    array = np.asarray(sorted(points), dtype=np.float64)
    kept = []
    for k in range(len(array)):
        others = np.delete(array, k, axis=0)
        # theta >= 0, sum theta = 1, sum theta_i q_i = p: feasible iff p is in their hull.
        rows = np.vstack([np.ones(len(others)), others.T])
        target = np.concatenate([[1.0], array[k]])
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.addCols(
            len(others),
            np.zeros(len(others)),
            np.zeros(len(others)),
            np.full(len(others), highspy.kHighsInf),
            0,
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.int32),
            np.zeros(0, dtype=np.float64),
        )
        h.addRows(
            len(rows),
            target,
            target,
            rows.size,
            np.arange(0, rows.size, len(others), dtype=np.int32),
            np.tile(np.arange(len(others), dtype=np.int32), len(rows)),
            rows.ravel(),
        )
        h.run()
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            kept.append(tuple(int(v) for v in array[k]))
    return kept
