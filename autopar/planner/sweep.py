"""The memory-budget sweep: the step-time vs memory curve of one model on one mesh
(``autopar plan --sweep-budget N``), planned through the driver at each budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

from autopar.errors import PlanningError
from autopar.planner.configurations import Solved
from autopar.planner.driver import Driver


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepPoint:
    """One plan of a memory-budget sweep (``autopar plan --sweep-budget``)."""

    budget_bytes: float
    step_s: float | None
    """Predicted step time; None where no plan fits."""
    peak_memory_bytes: float | None
    recompute_s: float
    num_segments: int
    zero_stage: int | None


def budget_sweep(driver: Driver, *, num_points: int = 6) -> list[SweepPoint]:
    """The options' plan under ``num_points`` budgets evenly spaced from the smallest that fits
    (with the options' checkpoint mode) to the budget-free plan's peak: the step-time vs memory
    curve. The driver's own budget is ignored."""

    def solve(budget: float) -> Solved:
        return driver.with_budget(budget).plan(price_baselines=False).chosen

    top = solve(driver.space.mesh.device.mem_capacity_bytes * 1e3).evaluation.peak_memory_bytes
    bottom = driver.smallest_budget()
    if bottom >= top:
        budgets = [top]
    else:
        budgets = [bottom + (top - bottom) * k / (num_points - 1) for k in range(num_points)]
    points = []
    for budget in budgets:
        try:
            solved = solve(math.ceil(budget))
        except PlanningError:
            points.append(
                SweepPoint(
                    budget_bytes=budget,
                    step_s=None,
                    peak_memory_bytes=None,
                    recompute_s=0.0,
                    num_segments=0,
                    zero_stage=None,
                )
            )
            continue
        ev = solved.evaluation
        points.append(
            SweepPoint(
                budget_bytes=budget,
                step_s=ev.step_s,
                peak_memory_bytes=ev.peak_memory_bytes,
                recompute_s=ev.recompute_s,
                num_segments=len(solved.segments),
                zero_stage=solved.zero.stage,
            )
        )
    return points
