"""The probes behind stage pricing: one intra-op ILP per (tp size, local microbatch, recipe).

A probe is the model (or a few-block variant of it) captured at the local microbatch shape and
solved by the ordinary configuration solver on a 1-D ``tp`` mesh, without a budget and with
every layer of the stack tied (``planner.stage_pricing`` explains how it prices stages).
Captures are shared by every tp size, solves by every mesh, microbatch count and schedule
that needs them.
"""

from __future__ import annotations

from collections.abc import Callable

import solver
from autopar.capture.export import Captured
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner.driver import Driver
from autopar.planner.problem import ZeroConfig
from autopar.planner.recipes import recipe_spec
from autopar.planner.space import build_space
from autopar.planner.stage_pricing import Parts, probe_parts
from cost_models import DeviceSpec, LinkSpec


class ProbeCache:
    """Probes solved on demand and kept (see the module docstring).

    Args:
        capture: local microbatch size -> the captured probe model.
        options: plan options (optimizer, precision, solver).
        device: the device the probes are priced on.
    """

    def __init__(
        self, capture: Callable[[int], Captured], *, options: PlanOptions, device: DeviceSpec
    ) -> None:
        self._capture = capture
        self.options = options
        self.device = device
        self._captured: dict[int, Captured] = {}
        self._parts: dict[tuple, Parts | None] = {}
        self.solved = 0

    def captured(self, local_batch: int) -> Captured:
        if local_batch not in self._captured:
            self._captured[local_batch] = self._capture(local_batch)
        return self._captured[local_batch]

    def parts(self, local_batch: int, tp: int, link: LinkSpec, *, recipe: str) -> Parts | None:
        """The probe's head, block and tail on ``tp`` ranks joined by ``link`` under ``recipe``
        ("auto" or "megatron"); None when the recipe has no layout for this model and size."""
        key = (local_batch, tp, link, recipe)
        if key in self._parts:
            return self._parts[key]
        captured = self.captured(local_batch)
        mesh = Mesh(shape=(tp,), axis_names=("tp",), device=self.device, links=(link,))
        space = build_space(captured, mesh, self.options)
        driver = Driver(space, budget=float("inf"), candidates=())
        spec = None if recipe == "auto" else recipe_spec(space, recipe)
        zero = ZeroConfig() if spec is None else spec.zero
        try:
            solved = driver.configurations.solve(zero, name=recipe, budget=None, spec=spec)
        except solver.InfeasibleError:
            self._parts[key] = None
            return None
        self.solved += 1
        self._parts[key] = found = probe_parts(space, solved, layouts=recipe)
        return found
