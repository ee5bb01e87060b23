"""One solved configuration (:class:`Solved`) and its entry in the plan JSON's solver log."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import solver
from autopar.planner.checkpointing import ChosenSegment
from autopar.planner.problem import Evaluation, ZeroConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Solved:
    """One solved configuration: its layouts (``choice``: a strategy index per space node),
    ZeRO configuration, figures and the solver's report."""

    name: str
    zero: ZeroConfig
    choice: tuple[int, ...]
    evaluation: Evaluation
    solution: solver.Solution
    segments: tuple[ChosenSegment, ...] = ()
    """Checkpoint segments recomputed (evaluation already includes them)."""

    @property
    def warm_multipliers(self) -> tuple[float, float] | None:
        """Where its solve's Lagrangian relaxation ended (the separable phase's multiplier,
        the best bound's), to start another configuration's from (ConfigurationSolver.solve
        ``warm_from``); None when no relaxation ran."""
        details = self.solution.details
        if "lagrangian_separable_multiplier" not in details:
            return None
        return details["lagrangian_separable_multiplier"], details["lagrangian_multiplier"]


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
