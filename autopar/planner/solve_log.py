"""The plan JSON's solver log: one entry per configuration solved."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autopar.planner.configurations import Solved


def log_entry(solved: Solved, *, budget_free: bool = False) -> dict[str, Any]:
    """The plan JSON's ``solver.candidates`` entry of one solved configuration."""
    return {
        "zero_stage": solved.zero.stage,
        "zero_axes": list(solved.zero.axes),
        "zero_stages": list(solved.zero.stages),
        "status": solved.solution.status,
        "step_s": solved.evaluation.step_s,
        "peak_memory_bytes": solved.evaluation.peak_memory_bytes,
        "memory": solved.evaluation.memory,
        "budget_free": budget_free,
    }
