"""Planning time per stage: capture, strategies, ILP build and solve, with problem sizes.

    python benchmarks/plan_time.py                       # the default table
    python benchmarks/plan_time.py --models gpt2-small --meshes 8 2x4 --batch 8 --seq 1024

Prints one row per (model, mesh): seconds for capture, strategy enumeration and pricing,
ILP build and solve (summed over every solve the plan needs: the four recipes and the auto
plan's ZeRO candidates), the variables and constraints of the auto plan's ILP, and the auto
plan's predicted step time against the best recipe.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autopar.api import plan_captured  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.mesh import Mesh  # noqa: E402
from autopar.options import PlanOptions  # noqa: E402
from autopar.presets import build_preset  # noqa: E402

DEFAULT_MODELS = ("gpt2-small", "llama3-8b-2l", "llama3-8b")
DEFAULT_MESHES = ("8", "2x4", "8x8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--meshes", nargs="+", default=list(DEFAULT_MESHES))
    parser.add_argument("--device", default="h100")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--time-limit", type=float, default=None)
    args = parser.parse_args()

    table = Table(title=f"planning time ({args.device}, global batch {args.batch}, seq {args.seq})")
    for col in ("model", "mesh", "nodes", "capture s", "strategies s", "solve s", "total s",
                "variables", "constraints", "auto step", "best recipe", "auto / best"):
        table.add_column(col, justify="right" if col not in ("model", "mesh") else "left")
    for model_name in args.models:
        start = time.perf_counter()
        model, ex_args, ex_kwargs = build_preset(model_name, batch=args.batch, seq=args.seq)
        captured = capture(model, ex_args, ex_kwargs)
        capture_s = time.perf_counter() - start
        for mesh_text in args.meshes:
            mesh = Mesh.parse(mesh_text, device=args.device)
            options = PlanOptions(time_limit_s=args.time_limit)
            plan = plan_captured(captured, mesh, options, model_name=model_name, capture_s=capture_s)
            t = plan.data["timings"]
            fitting = {k: v for k, v in plan.baselines.items() if v["fits"]}
            best = min(fitting.items(), key=lambda kv: kv[1]["step_s"]) if fitting else None
            table.add_row(
                model_name,
                mesh_text,
                str(plan.data["model"]["num_nodes"]),
                f"{t['capture_s']:.2f}",
                f"{t['strategies_s']:.2f}",
                f"{t['solve_s']:.2f}",
                f"{sum(t.values()):.2f}",
                f"{plan.data['solver']['num_variables']:,}",
                f"{plan.data['solver']['num_constraints']:,}",
                f"{plan.predicted_step_s * 1e3:.2f} ms",
                f"{best[0]} {best[1]['step_s'] * 1e3:.2f} ms" if best else "none fits",
                f"{plan.predicted_step_s / best[1]['step_s']:.3f}" if best else "-",
            )
            Console().print(f"done: {model_name} on {mesh_text}")
    Console().print(table)


if __name__ == "__main__":
    main()
