"""Pruning by bounds (solver/prune.py) leaves a planned model's plan unchanged: the tiny LLaMA
(its RoPE butterfly is the core elimination leaves, as on llama3-70b) planned with pruning on
every budget-free core and with pruning off gives the same layouts, step and bound."""

from __future__ import annotations

import pytest

import solver.prune
import solver.shrink
from autopar.api import plan_captured
from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from tests.models import tiny_llama


def test_tiny_llama_plan_is_the_same_with_every_core_pruned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, args, kwargs = tiny_llama(layers=1)
    captured = capture(model, args, kwargs)
    mesh = Mesh.parse("2x2", device="h100")
    options = PlanOptions(gap=0.0)
    monkeypatch.setattr(solver.shrink, "PRUNE_MIN_ENTRIES", 10**12)  # never
    plain = plan_captured(captured, mesh, options, model_name="tiny", price_baselines=False).data
    pruned_cores = []
    original = solver.shrink.prune

    def counting(problem, *args, **kwargs):
        out = original(problem, *args, **kwargs)
        pruned_cores.append(out is not None)
        return out

    monkeypatch.setattr(solver.shrink, "PRUNE_MIN_ENTRIES", -1)  # every core
    monkeypatch.setattr(solver.prune, "GIVE_UP_KEPT", 1.0)  # to the end
    monkeypatch.setattr(solver.shrink, "prune", counting)
    pruned = plan_captured(captured, mesh, options, model_name="tiny", price_baselines=False).data
    assert any(pruned_cores), "no core was pruned: the test would prove nothing"
    assert pruned["nodes"] == plain["nodes"]
    assert pruned["params"] == plain["params"]
    assert pruned["predicted"] == plain["predicted"]
    assert pruned["solver"]["objective_s"] == plain["solver"]["objective_s"]
    assert pruned["solver"]["bound_s"] == pytest.approx(plain["solver"]["bound_s"], rel=1e-9)
