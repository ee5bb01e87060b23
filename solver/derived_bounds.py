"""Lower bounds on one budgeted problem derived, without a solve, from another's Lagrangian
bound: for problems that differ only in their nodes' seconds and bytes (the ZeRO
configurations of one model: a stage changes what a parameter strategy costs and keeps,
nothing else).

Let problems c and c' have the same edges, tie classes, checkpoint segments, transients and
budget, and differ in node costs t_i(s) and bytes m_i(s) (and the constant memory offset). At
a multiplier lam each Lagrangian dual of solver/lagrangian.py (the separable D, the pattern D
on recompute or count patterns) is a minimum, over patterns and plans x, of

    F(x) + sum_i p_i(x_i) + lam (offset + t0 - B),      p_i(s) = t_i(s) + lam m_i(s),

where F (edge seconds, recompute terms, bytes alive again) depends only on what c and c'
share. So with delta_i(s) = p'_i(s) - p_i(s),

    D_c'(lam) >= D_c(lam) + sum_i min_s delta_i(s) + lam (offset' - offset),

since the minimum of a sum is at least the sum of the minima; and any lower bound on D_c(lam)
(the relaxation's, a solver's bound below the exact D) gives one on D_c'(lam). By weak duality
D_c'(lam) is at most c''s budgeted optimum over plans whose tie classes choose alike, so the
right-hand side is a lower bound on it: a configuration may be skipped on it with no solve.
Where a stage only adds seconds at lam (a parameter's gathers cost more than its priced bytes
save), the sum is 0 and c' inherits c's bound exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from solver.pricing import node_arrays
from solver.problem import Problem


@dataclass(frozen=True, kw_only=True, slots=True)
class Reference:
    """A lower bound on one problem's D at a multiplier, and what deriving others needs."""

    multiplier: float
    bound_s: float
    """A lower bound on D(multiplier), its constant included."""
    priced: np.ndarray
    """t_i(s) + multiplier m_i(s), every node's strategies one after another."""
    starts: np.ndarray
    """Where each node's strategies start in ``priced`` (one more entry: the end)."""
    offset_bytes: float
    budget_bytes: float
    edges: tuple
    tied: tuple
    segments: tuple
    transients: tuple
    """Every node's transient bytes (they set t0)."""


def _priced(
    problem: Problem, lam: float, arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """p_i(s) = t_i(s) + lam m_i(s) of every node, flat, and where each node starts
    (``arrays``: the problem's :func:`node_arrays`, where made already)."""
    cost, memory, starts = arrays if arrays is not None else node_arrays(problem)
    return cost + lam * memory, starts


def reference(problem: Problem, multiplier: float, bound_s: float) -> Reference:
    """``bound_s``, a lower bound on ``problem``'s D at ``multiplier`` (any of the duals of
    solver/lagrangian.py), kept to derive others' (:func:`derived_bound`)."""
    if problem.memory_budget_bytes is None or not multiplier >= 0.0:
        raise ValueError(
            f"a reference needs a budgeted problem and a multiplier >= 0, got {multiplier}"
        )
    priced, starts = _priced(problem, multiplier)
    return Reference(
        multiplier=multiplier,
        bound_s=bound_s,
        priced=priced,
        starts=starts,
        offset_bytes=problem.memory_offset_bytes,
        budget_bytes=problem.memory_budget_bytes,
        edges=problem.edges,
        tied=problem.tied,
        segments=problem.segments,
        transients=tuple(node.transient_bytes for node in problem.nodes),
    )


def derived_bound(
    problem: Problem, ref: Reference, arrays: tuple[np.ndarray, ...] | None = None
) -> float | None:
    """A lower bound on ``problem``'s D at ``ref.multiplier`` (so on its budgeted optimum over
    plans whose tie classes choose alike) derived from ``ref`` (module docstring); None when
    the two differ in more than node seconds, node bytes and the memory offset. ``arrays``:
    ``problem``'s :func:`node_arrays`, made once for several references."""
    if (
        problem.memory_budget_bytes != ref.budget_bytes
        or len(problem.nodes) != len(ref.starts) - 1
        or any(n.num_choices != b - a for n, a, b in zip(problem.nodes, ref.starts, ref.starts[1:]))
        or tuple(node.transient_bytes for node in problem.nodes) != ref.transients
        or problem.tied != ref.tied
        or problem.edges != ref.edges
        or problem.segments != ref.segments
    ):
        return None
    priced, starts = _priced(problem, ref.multiplier, arrays)
    # A strategy forbidden here (an infinite cost) is never chosen: it lowers no minimum. One
    # forbidden in the reference only gives -inf (a valid, useless bound).
    with np.errstate(invalid="ignore"):
        delta = np.where(np.isfinite(priced), priced - ref.priced, np.inf)
    lowest = np.minimum.reduceat(delta, starts[:-1]) if delta.size else np.zeros(0)
    return math.fsum(
        [
            ref.bound_s,
            *lowest.tolist(),
            ref.multiplier * (problem.memory_offset_bytes - ref.offset_bytes),
        ]
    )


def fitting_step(
    problem: Problem, choices: tuple[int, ...], try_first: Sequence[tuple[int, ...]] = ()
) -> float | None:
    """The step time of the plan ``choices`` of ``problem`` with its fastest recomputation, when
    its tie classes choose alike and it fits the budget (a proof that the problem is feasible
    at its tie level), else None; ``try_first``: see :func:`fitting`."""
    found = fitting(problem, choices, try_first)
    return None if found is None else found[1]


def fitting(
    problem: Problem, choices: tuple[int, ...], try_first: Sequence[tuple[int, ...]] = ()
) -> tuple[tuple[int, ...], float] | None:
    """:func:`fitting_step`'s recomputed copies per segment and step. ``try_first``: copies
    tried in order before the fastest recomputation's MIP (the plan's own in another ZeRO
    configuration, whose segments this problem shares; those another configuration's MIP
    found): the first allowed by every overlap clique and within the budget is taken, with
    its step (a proof all the same, not always the fastest: llama3-70b b256 fp32 bounds six
    configurations on the best plan, and five of their MIPs, 0.5 s, are made no more)."""
    from solver.checkpointing import counts_allowed
    from solver.lagrangian import fit_recompute  # solver.lagrangian is the heavier import
    from solver.presolve import plan_objective_s, plan_peak_memory_bytes

    if len(choices) != len(problem.nodes) or any(
        not 0 <= c < node.num_choices for node, c in zip(problem.nodes, choices, strict=True)
    ):
        return None
    if any(len({choices[i] for i in members}) != 1 for members in problem.tied):
        return None
    for recomputed in try_first:
        if (
            len(recomputed) == len(problem.segments)
            and counts_allowed(problem.segments, recomputed)
            and plan_peak_memory_bytes(problem, choices, recomputed) <= problem.memory_budget_bytes
        ):
            return tuple(recomputed), plan_objective_s(problem, choices, recomputed)
    return fit_recompute(problem, choices)
