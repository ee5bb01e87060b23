"""CPU seconds of the fixed phases of a plan (everything but the ILP solves), branch vs a base.

Usage::

    python benchmarks/plan_time_fixed.py BASE_TREE [--runs 3] [preset and plan flags]

e.g. ``python benchmarks/plan_time_fixed.py /tmp/base llama3-70b --mesh 8x16x8 --batch 256
--seq 8192 --mixed-precision bf16``. Each run is a fresh process (``PYTHONPATH`` = this tree,
then the base tree, alternating) that captures the preset and times, with
``time.process_time``, the phases that do not solve an ILP: building the strategy space, the
tie levels, the four recipes' specs and the checkpoint candidates ('auto'). Prints each phase's
median and spread (min-max) per tree and the ratio of the medians (branch / base).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PHASES = ("space", "ties", "recipes", "candidates")
HERE = Path(__file__).resolve().parents[1]

_CHILD = """
import json, sys, time
from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner.checkpointing import candidate_segments
from autopar.planner.configurations import tie_levels
from autopar.planner.recipes import BASELINE_RECIPES, recipe_specs
from autopar.planner.space import build_space
from autopar.presets import build_preset

a = json.loads(sys.argv[1])
model, args, kwargs = build_preset(a["model"], batch=a["batch"], seq=a["seq"])
captured = capture(model, args, kwargs)
mesh = Mesh.parse(a["mesh"], device=a["device"])
options = PlanOptions.from_kwargs({"mixed_precision": a["mixed_precision"]})
out = {}
t = time.process_time()
space = build_space(captured, mesh, options)
out["space"] = time.process_time() - t
t = time.process_time()
tie_levels(space)
out["ties"] = time.process_time() - t
t = time.process_time()
recipe_specs(space, BASELINE_RECIPES)
out["recipes"] = time.process_time() - t
t = time.process_time()
candidate_segments(space, "auto")
out["candidates"] = time.process_time() - t
print(json.dumps(out))
"""


def _run(tree: str, spec: dict) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("model", nargs="?", default="llama3-70b")
    parser.add_argument("--mesh", default="8x16x8")
    parser.add_argument("--device", default="h100")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--mixed-precision", default="bf16")
    parser.add_argument("--runs", type=int, default=3)
    a = parser.parse_args()
    spec = {
        "model": a.model,
        "mesh": a.mesh,
        "device": a.device,
        "batch": a.batch,
        "seq": a.seq,
        "mixed_precision": a.mixed_precision or None,
    }
    trees = {"branch": str(HERE), "base": str(Path(a.base).resolve())}
    times: dict[str, list[dict[str, float]]] = {"branch": [], "base": []}
    for _ in range(a.runs):
        for name, tree in trees.items():
            times[name].append(_run(tree, spec))
    for phase in (*PHASES, "total"):
        row = []
        medians = {}
        for name in trees:
            values = [sum(r.values()) if phase == "total" else r[phase] for r in times[name]]
            medians[name] = statistics.median(values)
            row.append(f"{name} {medians[name]:.2f} s ({min(values):.2f}-{max(values):.2f})")
        ratio = medians["branch"] / medians["base"] if medians["base"] else float("nan")
        print(f"{phase:>10}: {'; '.join(row)}; branch/base {ratio:.2f}")


if __name__ == "__main__":
    main()
