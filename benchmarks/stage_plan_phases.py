"""CPU seconds of each step that storing stage plans adds to ``autopar plan ... --out``.

Usage: ``python benchmarks/stage_plan_phases.py plan.json [model] [global_batch] [seq]`` with a
pipelined plan written by ``autopar plan`` for that preset (default llama3-70b, 256, 8192):
captures the model at the microbatch's shapes, splits it at the plan's cuts, checks the twin
stages, plans stages 0 and 1 and renames stage 1's plan onto stage 2 (README "Identical stages
planned once"). Prints one line per step (``time.process_time``).
"""

from __future__ import annotations

import json
import sys
import time

from autopar.api import plan_captured, stage_mesh
from autopar.capture.export import capture
from autopar.capture.stages import split_stages
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.plan.stage_copies import renamed_plan, twin_key
from autopar.planner.stages import PipelinePlan
from autopar.presets import build_preset


def main() -> None:
    path, model_name, batch, seq = (
        sys.argv[1:] + ["", "llama3-70b", "256", "8192"][len(sys.argv) - 1 :]
    )[:4]
    data = json.load(open(path))
    pipeline = PipelinePlan.from_json(data["pipeline"])
    start = time.process_time()

    def step(what: str) -> None:
        nonlocal start
        print(f"{what}: {time.process_time() - start:.2f} s CPU")
        start = time.process_time()

    model, args, kwargs = build_preset(
        model_name, batch=int(batch) // pipeline.microbatches, seq=int(seq)
    )
    stages = split_stages(capture(model, args, kwargs), pipeline)
    step("capture at the microbatch's shapes + split")
    keys = [twin_key(s, pipeline.stack) for s in stages]
    step(f"twin keys ({len(set(keys))} distinct of {len(keys)})")
    mesh = stage_mesh(Mesh.from_dict(data["mesh"]), pipeline.axis)
    options = PlanOptions.from_kwargs(data["options"])
    plans = []
    for stage in stages[:2]:
        plans.append(
            plan_captured(stage.captured, mesh, options, model_name="m", price_baselines=False)
        )
        step(f"plan stage {stage.index} ({stage.blocks[1] - stage.blocks[0]} blocks)")
    if len(stages) > 2:
        renamed = renamed_plan(plans[1].data, stages[1], stages[2], model_name="m/stage2")
        step(f"rename stage 1's plan onto stage 2 ({'done' if renamed else 'not twins'})")


if __name__ == "__main__":
    main()
