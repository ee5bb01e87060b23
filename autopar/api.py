"""``autopar.plan()``: capture -> strategy space -> the planner's driver -> Plan.

The thin entry point; the policy (which configurations are solved, and how) is
:mod:`autopar.planner.driver`, the document :mod:`autopar.plan.build`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch.nn as nn

from autopar.capture.export import Captured, capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.plan.build import plan_document
from autopar.plan.document import Plan
from autopar.planner.driver import Driver, Planned
from autopar.planner.space import build_space


def plan(
    model: nn.Module,
    mesh: Mesh,
    example_inputs: Sequence[Any] = (),
    example_kwargs: dict[str, Any] | None = None,
    *,
    model_name: str | None = None,
    **options: Any,
) -> Plan:
    """Plan ``model`` on ``mesh`` for the GLOBAL batch given by the example inputs.

    Runs in one process on fake/meta tensors (no GPU, no process group). Options are the
    fields of :class:`autopar.options.PlanOptions` (``recipe``, ``memory_budget``,
    ``optimizer``, ``mixed_precision``, ``zero_stage``, ``checkpoint``, ``output_placements``,
    ``time_limit_s``, ``gap``, ``solver``).
    """
    opts = PlanOptions.from_kwargs(options)
    start = time.perf_counter()
    captured = capture(model, tuple(example_inputs), example_kwargs)
    capture_s = time.perf_counter() - start
    name = model_name or type(model).__name__
    return plan_captured(captured, mesh, opts, model_name=name, capture_s=capture_s)


def plan_captured(
    captured: Captured,
    mesh: Mesh,
    options: PlanOptions,
    *,
    model_name: str,
    capture_s: float = 0.0,
    price_baselines: bool = True,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Plan an already captured graph (the CLI and autoparallelize share this). With
    ``price_baselines=False`` the recipes are not priced alongside (``plan.baselines`` then
    holds only the chosen recipe, if any), which saves one ILP per recipe. ``progress`` (e.g.
    the CLI's stderr display) receives one line per finished stage and per solve; library
    calls print nothing unless they pass one."""
    report = progress or (lambda line: None)
    start = time.perf_counter()
    space = build_space(captured, mesh, options)
    driver = Driver(space, progress=progress)
    strategies_s = time.perf_counter() - start
    tied = driver.tied
    report(
        f"strategies: {len(space.nodes)} nodes, {len(space.edges)} edges, "
        f"{sum(len(c) for c in tied[0]) if tied else 0} nodes in repeated layers, "
        f"{strategies_s:.2f} s"
    )
    planned = driver.plan(price_baselines=price_baselines)
    return document_plan(
        driver,
        planned,
        model_name=model_name,
        timings={"capture_s": capture_s, "strategies_s": strategies_s, "solve_s": planned.solve_s},
    )


def document_plan(
    driver: Driver, planned: Planned, *, model_name: str, timings: dict[str, float]
) -> Plan:
    """The Plan of one :meth:`Driver.plan` answer."""
    space = driver.space
    data = plan_document(
        space,
        planned.chosen,
        planned.baselines,
        budget=driver.budget,
        recipe=planned.recipe,
        model_name=model_name,
        log=planned.log,
        warnings=sorted(set(space.warnings)) + sorted(set(planned.notes)),
        timings=timings,
    )
    return Plan(data=data, space=space, choice=planned.chosen.choice)


__all__ = ["plan", "plan_captured", "document_plan"]
