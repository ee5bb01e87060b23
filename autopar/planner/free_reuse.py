"""A ZeRO configuration's budget-free answer taken from another configuration's, where their
budget-free problems differ only in bytes (issue 16).

Without a budget, bytes are in no constraint: two problems with the same nodes' seconds,
allowed strategies, edges and tie classes have the same plans, priced alike, so one's optimum
(and its bound) is the other's. ZeRO stages 0-2 price time alike (autopar/planner/zero_pricing.py),
so stage 2 on every axis, the budgeted search's first configuration
(autopar/planner/zero_search.py), has stage 0's budget-free problem up to bytes; stage 0 is
solved budget-free before the search (the floor), and that solve is not made again (llama3-70b
b256 bf16: 2.7 s). The problems are compared, not assumed alike: a pricing where they differ
gets None and the configuration is solved as before.

Between plans of equal seconds the solver may return another one for the other problem (its
presolve's dominance looks at bytes too): the answer is an optimum of the configuration's
problem, not necessarily the one its own solve would have returned.
"""

from __future__ import annotations

import dataclasses

from autopar.planner.checkpointing import with_segments
from autopar.planner.configurations import ConfigurationSolver, Solved
from autopar.planner.problem import BuiltProblem, ZeroConfig, build_problem, evaluate
from solver.presolve import plan_peak_memory_bytes


def reused_free(
    configurations: ConfigurationSolver, zero: ZeroConfig, other: Solved
) -> Solved | None:
    """``zero``'s budget-free answer from ``other`` (another configuration solved without a
    budget at the configurations' tightest tie level, no recipe restrictions), or None where
    the two budget-free problems differ in more than bytes (module docstring)."""
    if configurations.options.checkpoint == "all":
        return None  # forced segments: their seconds are per configuration's problem
    mine, theirs = _built(configurations, zero), _built(configurations, other.zero)
    if not _same_but_bytes(mine, theirs):
        return None
    problem = mine.problem
    ev = evaluate(configurations.space, other.choice, zero, mine.streams)
    solution = dataclasses.replace(
        other.solution,
        peak_memory_bytes=plan_peak_memory_bytes(problem, other.solution.choices),
    )
    return dataclasses.replace(
        other, zero=zero, evaluation=with_segments(ev, ()), solution=solution, segments=()
    )


def _built(configurations: ConfigurationSolver, zero: ZeroConfig) -> BuiltProblem:
    """``zero``'s budget-free problem as ConfigurationSolver.solve builds it (no budget, no
    recipe, the tightest tie level; the conversions shared through the solver's memo)."""
    tied = configurations.tied
    return build_problem(
        configurations.space,
        zero,
        allowed=None,
        forbid=None,
        memory_budget_bytes=None,
        tied=tied[0] if tied else (),
        memo=configurations.memo,
    )


def _same_but_bytes(a: BuiltProblem, b: BuiltProblem) -> bool:
    """Whether budget-free ``a`` and ``b`` have the same plans at the same seconds: the same
    allowed strategies, nodes' seconds, edges, tie classes and offsets (bytes aside)."""
    p, q = a.problem, b.problem
    if a.allowed != b.allowed or len(p.nodes) != len(q.nodes):
        return False
    if p.memory_budget_bytes is not None or q.memory_budget_bytes is not None:
        return False
    if p.segments or q.segments or p.tied != q.tied or p.edges != q.edges:
        return False
    return all(x.cost_s == y.cost_s for x, y in zip(p.nodes, q.nodes, strict=True))
