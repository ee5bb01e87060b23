"""The multiplier search of the Lagrangian relaxation (:mod:`solver.lagrangian`): where to
start, where to step next in a bracket, and the pattern phase's bracketing (torch-free)."""

from __future__ import annotations

import math

from solver.problem import Problem

__all__ = ["first_multiplier", "next_multiplier", "pattern_search"]


def pattern_search(evaluate, lam: float, done, target) -> None:
    """Search the pattern D's maximum from ``lam``. ``evaluate(lam, give_up)`` returns a
    priced plan's value at lam, the slope of that plan's line (above D everywhere: D is the
    minimum of such lines) and whether the evaluation was complete (with ``give_up`` it stops
    as soon as D(lam) is known to be below ``target()``; a complete one's line is a tangent).
    D is concave, so from a line of positive slope at lam the target is reached no nearer
    than where the line meets it (a Polyak step), from one of negative slope no farther, and
    between the two no higher than where they cross. So the search steps there, giving up
    on each multiplier as soon as it cannot reach the target, until done(); once the lines
    prove that D stays below the target it goes on with complete evaluations, for the best
    bound, bracketing the maximum with tangents only (another line's slope does not say on
    which side the maximum lies)."""
    lines: list = [None, None]  # (lam, value, slope) nearest the target, left and right
    tangents: list = [None, None]  # the same from complete evaluations
    give_up = math.isfinite(target())
    while not done():
        value, slope, complete = evaluate(lam, give_up)
        if done():
            return
        side = 0 if slope > 0.0 else 1
        lines[side] = (lam, value, slope)
        if complete:
            tangents[side] = (lam, value, slope)
        step = _step(*lines, target()) if give_up else None
        if give_up and step is None:  # the target is out of reach: the best bound instead
            give_up = False
            if tangents == [None, None]:
                step = lam  # again, completely
        if not give_up and step is None:
            step = _step(*tangents, None)
        if step is None:
            return
        lam = step


def _step(lo, hi, goal: float | None) -> float | None:
    """The next multiplier of :func:`pattern_search` toward ``goal`` (None: toward the
    maximum), or None: the goal is out of reach, or the bracket closed."""
    if hi is None:  # left of the maximum (or of where D may reach the goal) so far
        lam, value, slope = lo
        if goal is None or goal <= value:
            return lam * 4.0 if lam > 0.0 else 1e-12
        # Aimed a little past the goal: where D is one line (the same plan and pattern), the
        # step lands on the goal itself, and rounding must not leave it a hair below.
        aim = goal + 1e-4 * abs(goal)
        return min(lam + (aim - value) / slope, lam * 16.0 if lam > 0.0 else math.inf)
    if lo is None:  # right of it
        lam, value, slope = hi
        if goal is None:
            return lam / 4.0 if lam > 1e-30 else None
        if slope >= 0.0 or value + slope * (0.0 - lam) <= goal:
            return None  # the line stays below the goal on [0, inf)
        return max(lam + (goal + 1e-4 * abs(goal) - value) / slope, lam / 16.0)
    (a, d_a, g_a), (b, d_b, g_b) = lo, hi
    if b - a <= 1e-3 * b:
        return None
    mid = math.sqrt(a * b) if a > 0.0 else b / 8.0
    if g_a <= g_b:
        return None if goal is not None else mid
    cross = (d_b - d_a + g_a * a - g_b * b) / (g_a - g_b)
    if goal is not None and d_a + g_a * (cross - a) < goal:
        return None
    return cross if a + 0.05 * (b - a) < cross < b - 0.05 * (b - a) else mid


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
