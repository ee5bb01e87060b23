"""The fastest recomputation of a plan whose layouts are fixed (the Lagrangian relaxation's
plans, solver/lagrangian.py, and the bounds' proofs that a configuration is feasible): a small
MIP over the segments' recomputed copies only (solver/checkpointing.py fit_segments)."""

from __future__ import annotations

import math

from solver.checkpointing import fit_segments, freed_bytes, recompute_s
from solver.presolve import plan_objective_s, plan_peak_memory_bytes
from solver.problem import Node, Problem, Segment

__all__ = ["fit_recompute"]


def fit_recompute(
    problem: Problem, choices: tuple[int, ...]
) -> tuple[tuple[int, ...], float] | None:
    """The fastest recomputation of the plan ``choices`` (layouts fixed) within the budget:
    (recomputed copies per segment, exact step time), or None when no recomputation fits."""
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
    recomputed = fit_segments(fixed)
    if recomputed is None:
        return None
    if plan_peak_memory_bytes(problem, choices, recomputed) > budget:
        return None
    return recomputed, plan_objective_s(problem, choices, recomputed)
