"""The multiplier search of the Lagrangian relaxation (:mod:`solver.lagrangian`): where to
start, where to step next in a bracket, and the pattern phase's bracketing (torch-free)."""

from __future__ import annotations

import math

from solver.problem import Problem

__all__ = ["first_multiplier", "next_multiplier", "pattern_search"]


def pattern_search(evaluate, lam: float, done) -> None:
    """Bracket the pattern D's maximum from ``lam`` (its subgradient changes sign there:
    ``evaluate`` returns it) in steps of 4, then bisect geometrically until ``done``."""
    lo, hi = 0.0, None
    if evaluate(lam) > 0.0:
        lo = lam
    else:
        hi = lam
    while hi is None and not done():
        lam *= 4.0
        if evaluate(lam) > 0.0:
            lo = lam
        else:
            hi = lam
    while lo == 0.0 and hi is not None and hi > 1e-30 and not done():
        lam = hi / 4.0
        if evaluate(lam) > 0.0:
            lo = lam
        else:
            hi = lam
    while hi is not None and lo > 0.0 and hi - lo > 1e-6 * hi and not done():
        mid = math.sqrt(lo * hi)
        if evaluate(mid) > 0.0:
            lo = mid
        else:
            hi = mid


def next_multiplier(
    tangents: dict[float, tuple[float, float]], lo: float, hi: float, bound: float, tol: float
) -> float | None:
    """The multiplier to try next in the bracket (lo, hi); None when no multiplier can raise
    ``bound`` by more than ``tol``: D is concave, so under its tangents at lo (slope > 0) and
    hi (slope <= 0). Where they cross when that is well inside, else the geometric middle."""
    mid = math.sqrt(lo * hi) if lo > 0.0 else hi / 8.0
    if lo not in tangents or hi not in tangents or tangents[lo][1] <= tangents[hi][1]:
        return mid
    (d_lo, g_lo), (d_hi, g_hi) = tangents[lo], tangents[hi]
    cross = (d_hi - d_lo + g_lo * lo - g_hi * hi) / (g_lo - g_hi)
    if d_lo + g_lo * (cross - lo) - bound <= tol:
        return None
    return cross if lo + 0.05 * (hi - lo) < cross < hi - 0.05 * (hi - lo) else mid


def first_multiplier(problem: Problem) -> float:
    """A multiplier of the right order: the spread of node seconds over the spread of node
    bytes, summed over the graph."""
    seconds = math.fsum(max(n.cost_s) - min(n.cost_s) for n in problem.nodes)
    bytes_ = math.fsum(max(n.memory_bytes) - min(n.memory_bytes) for n in problem.nodes)
    return seconds / bytes_ if seconds > 0.0 and bytes_ > 0.0 else 1e-12
