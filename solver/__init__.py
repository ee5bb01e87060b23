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
    "plan_objective_s",
    "plan_peak_memory_bytes",
    "solve",
]
