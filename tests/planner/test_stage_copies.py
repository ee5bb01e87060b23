"""plan/stage_copies.py: identical pipeline stages are solved once.

A 4-stage LLaMA (one block per stage) has two twin middle stages: ``plan_stage_graphs`` solves
three ILPs for four stages, and the plan it derives for the second middle stage (the first one's
plan renamed) equals a direct solve of that stage, field by field (choices, costs, memory,
alternatives), apart from the solver's own timings. Stages that are not twins are not renamed.
A stored plan keeps the twin as ``{"renamed_from": 1}`` and loads back to the same plans.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from autopar.api import plan_captured, plan_stage_graphs
from autopar.capture.export import capture
from autopar.capture.stages import split_stages
from autopar.errors import PlanMismatchError
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.plan.stage_copies import (
    renamed_plan,
    stage_plans_from_stored,
    stored_entries,
    twin_key,
)
from autopar.planner.driver import Driver
from autopar.planner.stages import even_stages
from tests import models


def test_twin_middle_stages_are_solved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model, args, _ = models.tiny_llama(layers=4)
    pipeline = even_stages(
        stack="layers", num_blocks=4, num_stages=4, microbatches=1, schedule="1f1b"
    )
    stages = split_stages(capture(model, args), pipeline)
    keys = [twin_key(s, "layers") for s in stages]
    assert keys[1] == keys[2] and len({keys[0], keys[1], keys[3]}) == 3
    solves: list[int] = []
    solve = Driver.plan

    def counted(self: Any, *a: Any, **k: Any) -> Any:
        solves.append(1)
        return solve(self, *a, **k)

    monkeypatch.setattr(Driver, "plan", counted)
    mesh = Mesh.spec((2,), ("tp",), device="h100")
    options = PlanOptions.from_kwargs({"optimizer": "sgd"})
    plans = plan_stage_graphs(stages, mesh, options, model_name="llama", stack="layers")
    assert len(solves) == 3
    # A middle stage's boundary is left where the ILP lays it out (no gather priced).
    boundary = dataclasses.replace(options, output_placements=("*",) * len(stages[2].outputs))
    direct = plan_captured(
        stages[2].captured, mesh, boundary, model_name="llama/stage2", price_baselines=False
    )
    derived = plans[2].data
    assert plans[2].choices() == direct.choices()
    assert {n.name for n in stages[2].captured.gm.graph.nodes} >= set(plans[2].choices())
    assert set(derived["params"]) == set(stages[2].captured.param_nodes.values())
    for key in direct.data:
        if key not in ("solver", "timings"):
            assert derived[key] == direct.data[key], key
    # The first stage's plan does not rename onto a middle stage (other nodes).
    assert renamed_plan(plans[0].data, stages[0], stages[1], model_name="x") is None
    # Stored: the twin as a reference, renamed again on load; a stage graph that is not a
    # renamed copy of its source is refused in one line.
    entries = stored_entries([p.data for p in plans], [None, None, 1, None])
    assert entries[2] == {"renamed_from": 1}
    loaded = stage_plans_from_stored(json.loads(json.dumps(entries)), stages)
    assert [p.data for p in loaded] == [p.data for p in plans]
    other = [stages[0], stages[1], dataclasses.replace(stages[3], index=2), stages[3]]
    with pytest.raises(PlanMismatchError, match=r"^[^\n]*stage 2 is not a renamed copy[^\n]*$"):
        stage_plans_from_stored(entries, other)
