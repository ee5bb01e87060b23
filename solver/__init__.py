"""Torch-free sharding optimization: Problem -> Solution with an ILP (pulp: HiGHS or CBC)."""

from __future__ import annotations

from solver.brute_force import brute_force
from solver.errors import (
    InfeasibleBudgetError,
    InfeasibleError,
    SolverStoppedError,
    SolverTimeoutError,
)
from solver.ilp import BACKENDS
from solver.presolve import plan_objective_s, plan_peak_memory_bytes
from solver.problem import Edge, Node, Problem, Solution
from solver.shrink import solve


def forget_kept() -> None:
    """Drop what the solves of one search keep for the next on the same segments (the
    contracted segments, the last pattern terms and lower bounds, the last problems' priced
    arrays): a search calls it when it ends."""
    from solver.checkpointing import forget_contracted
    from solver.kept_lowers import forget_lowers
    from solver.pattern_bounds import forget_table
    from solver.pricing import forget_pricing

    forget_contracted()
    forget_table()
    forget_lowers()
    forget_pricing()


__all__ = [
    "BACKENDS",
    "Edge",
    "InfeasibleBudgetError",
    "InfeasibleError",
    "Node",
    "Problem",
    "Solution",
    "SolverStoppedError",
    "SolverTimeoutError",
    "brute_force",
    "forget_kept",
    "plan_objective_s",
    "plan_peak_memory_bytes",
    "solve",
]
