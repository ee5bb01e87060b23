"""The order in which the budgeted search bounds its ZeRO configurations, chosen so that one
configuration's bound derives the others' (issue 16, llama3-70b fp32).

A bound on configuration A's Lagrangian dual at a multiplier lam gives one on B's at the same
lam with no solve (solver/derived_bounds.py):

    D_B(lam) >= D_A(lam) + shift(A -> B),
    shift(A -> B) = sum_i min_s [p_B,i(s) - p_A,i(s)] + lam (offset_B - offset_A),

with p_i(s) = t_i(s) + lam m_i(s) the priced costs. Where shift(A -> B) >= 0, B's bound is at
least A's: bounding A first, B is skipped whenever A is, at the price of A's evaluation alone.
The ZeRO stages trade a parameter's bytes for gather seconds, so at a multiplier where a stage
pays its seconds back in priced bytes the configuration with that stage has priced costs
nowhere above the one without it (llama3-70b b256 fp32: (2,2,3)'s pattern D equals (2,2,2)'s,
25017.996 ms, while (2,2,2)'s derives only 22755.124 ms for (2,2,3); each pattern D takes
20-25 s idle).

:func:`derive_first` orders the configurations still to bound: the one from which the most
others derive at a shift >= 0 first (ties: the lower budget-free bound first, the order the
search had). This only orders the search; every bound used stays one of the search's own
(valid at any multiplier, whatever the order), so the plan stays within the gap of its bound,
and at gap 0 the search takes no bounds and this is not called.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from autopar.planner.configurations import ConfigurationSolver, Solved
from autopar.planner.problem import ZeroConfig
from solver.derived_bounds import Reference, reference


def shifts(priced: Sequence[Reference]) -> np.ndarray:
    """``out[a, b]``: shift(a -> b) (module docstring) between configurations whose problems
    priced at one multiplier are ``priced`` (solver.derived_bounds references with bound 0);
    -inf on the diagonal and where a and b differ in more than node seconds and bytes."""
    out = np.full((len(priced), len(priced)), -math.inf)
    for a, ref in enumerate(priced):
        for b, other in enumerate(priced):
            if a != b:
                out[a, b] = _shift(ref, other)
    return out


def _shift(ref: Reference, other: Reference) -> float:
    """shift(ref -> other) at ``ref.multiplier`` from their priced costs (both made by
    solver.derived_bounds.reference at that multiplier with bound 0)."""
    if (
        ref.multiplier != other.multiplier
        or ref.budget_bytes != other.budget_bytes
        or not np.array_equal(ref.starts, other.starts)
        or ref.transients != other.transients
        or ref.tied != other.tied
        or ref.edges != other.edges
        or ref.segments != other.segments
    ):
        return -math.inf
    with np.errstate(invalid="ignore"):
        delta = np.where(np.isfinite(other.priced), other.priced - ref.priced, np.inf)
    lowest = np.minimum.reduceat(delta, ref.starts[:-1]) if delta.size else np.zeros(0)
    return math.fsum([*lowest.tolist(), ref.multiplier * (other.offset_bytes - ref.offset_bytes)])


def shift_table(
    configurations: ConfigurationSolver,
    zeros: Sequence[ZeroConfig],
    budget: float,
    multiplier: float,
) -> np.ndarray:
    """:func:`shifts` of ``zeros``' budgeted problems priced at ``multiplier``, each problem
    released once its reference is taken."""
    priced = []
    for zero in zeros:
        priced.append(reference(configurations.budgeted_problem(zero, budget), multiplier, 0.0))
        configurations.release(zero, budget)
    return shifts(priced)


def greedy_order(table: np.ndarray) -> list[int]:
    """The indices of ``table`` (:func:`shifts`) in bounding order: each time, of those left,
    the one with the most others left at a shift >= 0 from it (ties: the lower index)."""
    left = list(range(len(table)))
    order = []
    while left:
        pick = max(left, key=lambda a: (sum(table[a, b] >= 0.0 for b in left if b != a), -a))
        order.append(pick)
        left.remove(pick)
    return order


def derive_first(
    configurations: ConfigurationSolver,
    pairs: Sequence[tuple[ZeroConfig, Solved]],
    budget: float,
    multiplier: float,
    report: Callable[[str], None] = lambda line: None,
    followers: dict[ZeroConfig, set[ZeroConfig]] | None = None,
) -> list[tuple[ZeroConfig, Solved]]:
    """``pairs`` (configurations with their budget-free solves, in the search's order) with
    those whose budget-free plan does not fit reordered so that the configuration from which
    the most of the others derive a bound at a shift >= 0 comes first (module docstring),
    greedily: after each pick, the next is the one deriving the most of those left. Those
    whose budget-free plan fits keep their places at the front (they are solved by it).
    ``followers``: filled with, per configuration reordered, those it derives at a shift >= 0."""
    fitting = [p for p in pairs if p[1].evaluation.peak_memory_bytes <= budget]
    rest = [p for p in pairs if p[1].evaluation.peak_memory_bytes > budget]
    if len(rest) < 2 or not multiplier >= 0.0:
        return list(pairs)
    start = time.perf_counter()
    table = shift_table(configurations, [zero for zero, _ in rest], budget, multiplier)
    order = greedy_order(table)
    if followers is not None:
        for a, (zero, _) in enumerate(rest):
            followers[zero] = {rest[b][0] for b in range(len(rest)) if table[a, b] >= 0.0}
    names = configurations.space.mesh.axis_names
    report(
        "bound order (configurations deriving others' bounds at a shift >= 0 first): "
        + ", ".join(
            f"{rest[a][0].label(names)} ({int(sum(table[a, b] >= 0.0 for b in order[i + 1 :]))})"
            for i, a in enumerate(order)
        )
        + f", {time.perf_counter() - start:.1f} s"
    )
    return fitting + [rest[k] for k in order]
