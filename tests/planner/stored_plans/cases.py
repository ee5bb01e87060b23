"""Plans stored as JSON, to prove that a refactor of the planner keeps every plan the same.

``python -m tests.planner.stored_plans.cases`` (from the repository root) re-plans every case
and rewrites the stored files; do that only for a change that is meant to change plans, and
say in the commit which fields changed and why. ``test_stored_plans.py`` re-plans each case and
compares it with the stored file, field by field, apart from the wall-clock timings.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent

VOLATILE = {
    ("timings",),
    ("solver", "build_s"),
    ("solver", "solve_s"),
    ("autopar_version",),
    ("version",),
}
"""Fields that measure this run's wall clock or name the code version, not the plan."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    name: str
    model: str
    """A preset name (autopar.presets) or ``tests.models:<builder>``."""
    mesh: str
    batch: int = 8
    seq: int = 128
    options: tuple[tuple[str, Any], ...] = ()


CASES = (
    Case(name="mlp-4", model="mlp", mesh="4"),
    Case(name="gpt2-small-2l-2x2", model="gpt2-small-2l", mesh="2x2", seq=256),
    Case(
        name="tiny-gpt-2-tight",
        model="tests.models:tiny_gpt",
        mesh="2",
        options=(("memory_budget", 1_500_000), ("zero_stage", 0)),
    ),
    Case(
        name="tiny-gpt-2-zero",
        model="tests.models:tiny_gpt",
        mesh="2",
        options=(("memory_budget", 2_500_000),),
    ),
    Case(
        name="tiny-llama-2x2-megatron",
        model="tests.models:tiny_llama",
        mesh="2x2",
        options=(("recipe", "megatron"),),
    ),
)


def make(case: Case) -> dict[str, Any]:
    """The plan JSON document of ``case``, planned now (volatile fields removed)."""
    import importlib

    from autopar.api import plan_captured
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.presets import build_preset

    if case.model.startswith("tests.models:"):
        builder = getattr(importlib.import_module("tests.models"), case.model.split(":")[1])
        model, args, kwargs = builder()
    else:
        model, args, kwargs = build_preset(case.model, batch=case.batch, seq=case.seq)
    captured = capture(model, args, kwargs)
    mesh = Mesh.parse(case.mesh, device="h100")
    # The cases were stored at gap 0 (the default before issue 16): they pin the proven optimum.
    options = PlanOptions(**{"gap": 0.0, **dict(case.options)})
    plan = plan_captured(captured, mesh, options, model_name=case.model)
    return normalize(json.loads(plan.to_json()))


def normalize(data: dict[str, Any]) -> dict[str, Any]:
    for path in VOLATILE:
        parent = data
        for key in path[:-1]:
            parent = parent.get(key, {})
        parent.pop(path[-1], None)
    return data


def path_of(case: Case) -> pathlib.Path:
    return HERE / f"{case.name}.json"


if __name__ == "__main__":
    import sys
    import time

    wanted = set(sys.argv[1:])
    for case in CASES:
        if wanted and case.name not in wanted:
            continue
        start = time.perf_counter()
        data = make(case)
        path_of(case).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"{case.name}: {time.perf_counter() - start:.1f} s", flush=True)
