"""Lagrangian relaxation of the memory budget: a lower bound and plans in budget-free solves.

For a budgeted Problem with node choices x and recomputed copies r (solver/checkpointing.py),

    min  C(x) + R(x, r)     s.t.  P(x, r) <= B

where C is the node and edge seconds, R the recompute seconds and P the peak bytes. Pricing
every byte at a multiplier lam >= 0 gives, for any plan that fits,

    C(x) + R(x, r) >= C(x) + R(x, r) + lam (P(x, r) - B) >= D(lam)

and D(lam) is computed by ONE budget-free solve (solver/shrink.py: exact elimination and tie
contraction, about a second on llama3-8b) once P and R are replaced by a lower bound
separable over the nodes:

- the largest transient max_i t_i(x_i) >= t0 = max_i min_s t_i(s) (a constant);
- one recomputed segment's bytes alive again in backward (>= 0) are dropped;
- a segment k recomputed r_k times adds r_k (T_k(x) - lam A_k(x)) (seconds spent again less
  the priced bytes freed); its edge seconds (>= 0) are dropped and the rest is split over its
  nodes, v_kn(s) = recompute_s - lam freed_bytes. The segments holding a node n overlap
  pairwise, so their overlap clique bounds sum_k (r_k - m_k) / L_k <= 1 (m_k = min_copies,
  L_k = copies), hence  sum_k r_k v_kn >= sum_k m_k v_kn + min_k (L_k - m_k) min(0, v_kn).

So node i's budget-free cost is c_i(s) + lam m_i(s) + g_i(s) with g_i the segment term above,
and D(lam) = (that problem's optimum) + lam (offset + t0 - B). It is concave in lam; the
search (:func:`relax`) brackets the multiplier where the relaxed plan's bytes cross the
budget and bisects. Every relaxed plan is also a candidate: its recomputation is chosen
exactly for its fixed layouts (a MIP over the segment bits only, :func:`fit_recompute`) and the
best plan that fits is kept. The bound is valid whatever the search does; the primal plan's
distance to it is the gap the caller reports.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from solver.checkpointing import freed_bytes, recompute_s
from solver.errors import InfeasibleError
from solver.presolve import plan_objective_s, plan_peak_memory_bytes
from solver.problem import Node, Problem, Segment


@dataclass(frozen=True, kw_only=True, slots=True)
class Relaxed:
    """What the multiplier search found."""

    bound_s: float
    """max over the multipliers tried of D(lam): a lower bound on the budgeted optimum."""
    choices: tuple[int, ...] | None
    """The best plan found that fits the budget (None: none did)."""
    recomputed: tuple[int, ...]
    objective_s: float
    """Its exact step time (math.inf without a plan)."""
    multiplier: float
    """The multiplier of the best bound (seconds per byte)."""
    evaluations: int
    seconds: float


def _segment_terms(problem: Problem, lam: float) -> list[np.ndarray]:
    """Per node, per strategy: g_i(s), the separable lower bound of the segments' priced
    terms (module docstring)."""
    forced = [np.zeros(n.num_choices) for n in problem.nodes]
    best_free = [np.zeros(n.num_choices) for n in problem.nodes]
    for seg in problem.segments:
        spare = seg.copies - seg.min_copies
        for n, freed, again in zip(seg.nodes, seg.freed_bytes, seg.recompute_s, strict=True):
            v = np.asarray(again) - lam * np.asarray(freed)
            if seg.min_copies:
                forced[n] += seg.min_copies * v
            np.minimum(best_free[n], spare * np.minimum(v, 0.0), out=best_free[n])
    return [f + g for f, g in zip(forced, best_free, strict=True)]


def priced(problem: Problem, lam: float) -> Problem:
    """The budget-free problem whose optimum plus lam (offset + t0 - B) is D(lam)."""
    seg = _segment_terms(problem, lam) if problem.segments else None
    nodes = tuple(
        Node(
            name=node.name,
            cost_s=tuple(
                (
                    np.asarray(node.cost_s)
                    + lam * np.asarray(node.memory_bytes)
                    + (seg[i] if seg else 0.0)
                ).tolist()
            ),
            memory_bytes=(0.0,) * node.num_choices,
        )
        for i, node in enumerate(problem.nodes)
    )
    return Problem(nodes=nodes, edges=problem.edges, tied=problem.tied)


def transient_floor(problem: Problem) -> float:
    """t0 = max_i min_s t_i(s): every plan's largest transient is at least this."""
    return max((min(n.transient_bytes) for n in problem.nodes if n.transient_bytes), default=0.0)


def relaxed_peak(problem: Problem, choices: tuple[int, ...], lam: float) -> float:
    """The separable peak bound of the relaxed plan: a subgradient of D at lam is this less
    the budget (the recompute part counted at the copies the bound assumed)."""
    resident = math.fsum(n.memory_bytes[c] for n, c in zip(problem.nodes, choices, strict=True))
    freed = 0.0
    for seg in problem.segments:
        for n, row, again in zip(seg.nodes, seg.freed_bytes, seg.recompute_s, strict=True):
            v = again[choices[n]] - lam * row[choices[n]]
            if v < 0.0 or seg.min_copies:
                freed += (seg.copies if v < 0.0 else seg.min_copies) * row[choices[n]]
    return problem.memory_offset_bytes + transient_floor(problem) + resident - freed


def fit_recompute(
    problem: Problem, choices: tuple[int, ...]
) -> tuple[tuple[int, ...], float] | None:
    """The fastest recomputation of the plan ``choices`` (layouts fixed) within the budget:
    (recomputed copies per segment, exact step time), or None when no recomputation fits."""
    from solver.ilp import solve_model  # the MIP over the segment bits only

    budget = problem.memory_budget_bytes
    assert budget is not None
    if not problem.segments:
        if plan_peak_memory_bytes(problem, choices) > budget:
            return None
        return (), plan_objective_s(problem, choices)
    if plan_peak_memory_bytes(problem, choices) <= budget and not any(
        seg.min_copies for seg in problem.segments
    ):  # recomputing only adds time
        return (0,) * len(problem.segments), plan_objective_s(problem, choices)
    # One node carries the plan's fixed seconds and bytes; each segment prices its copies on it
    # (its footprint keeps the overlap cliques of the original nodes).
    largest_transient = max(
        (n.transient_bytes[c] for n, c in zip(problem.nodes, choices) if n.transient_bytes),
        default=0.0,
    )
    whole = Node(
        name="plan",
        cost_s=(plan_objective_s(problem, choices),),
        memory_bytes=(
            math.fsum(n.memory_bytes[c] for n, c in zip(problem.nodes, choices, strict=True)),
        ),
        transient_bytes=(max(largest_transient, 0.0),),
    )
    segments = tuple(
        Segment(
            name=seg.name,
            nodes=(0,),
            freed_bytes=((freed_bytes(seg, choices),),),
            recompute_s=((recompute_s(seg, choices),),),
            copies=seg.copies,
            min_copies=seg.min_copies,
            footprint=seg.footprint or seg.nodes,
        )
        for seg in problem.segments
    )
    fixed = Problem(
        nodes=(whole,),
        memory_budget_bytes=budget,
        memory_offset_bytes=problem.memory_offset_bytes,
        segments=segments,
    )
    try:
        sol = solve_model(fixed, backend="highs", time_limit_s=None, gap=0.0, msg=False)
    except InfeasibleError:
        return None
    recomputed = sol.recomputed
    if plan_peak_memory_bytes(problem, choices, recomputed) > budget:
        return None
    return recomputed, plan_objective_s(problem, choices, recomputed)


def relax(
    problem: Problem,
    solve_free,
    *,
    start: float | None = None,
    max_evaluations: int = 24,
    target_gap: float = 0.0,
) -> Relaxed:
    """Search the multiplier (module docstring). ``solve_free(problem) -> (choices, value,
    bound)`` solves a budget-free problem (value: its objective; bound: a lower bound on its
    optimum, equal to value when proven optimal). ``start``: a multiplier to begin from (a
    previous configuration's). Stops when the best plan is within ``target_gap`` of the bound,
    the bracket closes, or after ``max_evaluations`` solves."""
    clock = time.perf_counter()
    budget = problem.memory_budget_bytes
    assert budget is not None
    constant = problem.memory_offset_bytes + transient_floor(problem) - budget
    best_bound, best_lam = -math.inf, 0.0
    best: tuple[float, tuple[int, ...], tuple[int, ...]] | None = None
    evaluations = 0
    tried: set[tuple[int, ...]] = set()

    def evaluate(lam: float) -> float:
        """D(lam)'s subgradient (relaxed peak - budget); updates the bound and the best plan."""
        nonlocal best_bound, best_lam, best, evaluations
        evaluations += 1
        choices, _, lower = solve_free(priced(problem, lam))
        bound = lower + lam * constant
        if bound > best_bound:
            best_bound, best_lam = bound, lam
        if choices not in tried:
            tried.add(choices)
            fitted = fit_recompute(problem, choices)
            if fitted is not None and (best is None or fitted[1] < best[0]):
                best = (fitted[1], choices, fitted[0])
        return relaxed_peak(problem, choices, lam) - budget

    def done() -> bool:
        if best is None or evaluations >= max_evaluations:
            return evaluations >= max_evaluations
        return best[0] - best_bound <= target_gap * abs(best[0])

    # Bracket: lo with the relaxed plan over the budget, hi with it within.
    lo, hi = 0.0, None
    if evaluate(0.0) <= 0.0:
        hi = 0.0
    lam = start if start else _first_multiplier(problem)
    while hi is None and not done():
        if evaluate(lam) > 0.0:
            lo, lam = lam, lam * 8.0
        else:
            hi = lam
    while hi is not None and hi > lo and not done():
        mid = math.sqrt(lo * hi) if lo > 0.0 else hi / 8.0
        if hi - lo <= 1e-6 * hi:
            break
        if evaluate(mid) > 0.0:
            lo = mid
        else:
            hi = mid
    return Relaxed(
        bound_s=best_bound,
        choices=None if best is None else best[1],
        recomputed=() if best is None else best[2],
        objective_s=math.inf if best is None else best[0],
        multiplier=best_lam,
        evaluations=evaluations,
        seconds=time.perf_counter() - clock,
    )


def _first_multiplier(problem: Problem) -> float:
    """A multiplier of the right order: the spread of node seconds over the spread of node
    bytes, summed over the graph."""
    seconds = math.fsum(max(n.cost_s) - min(n.cost_s) for n in problem.nodes)
    bytes_ = math.fsum(max(n.memory_bytes) - min(n.memory_bytes) for n in problem.nodes)
    return seconds / bytes_ if seconds > 0.0 and bytes_ > 0.0 else 1e-12
