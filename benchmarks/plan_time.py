"""Planning time per stage, with ILP sizes before and after tying and elimination.

    python benchmarks/plan_time.py                        # the issue's large models
    python benchmarks/plan_time.py --set small            # gpt2-small, llama3-8b-2l, llama3-8b on 8, 2x4, 8x8
    python benchmarks/plan_time.py --models gpt2-small-2l --meshes 2x4 --seq 1024
    python benchmarks/plan_time.py --depth llama3-8b --mesh 8x8 --layers 2 4 8 16 32 64 128
    python benchmarks/plan_time.py --set budget           # issue 16's budget-bound rows (whole CLI
                                                          # command per row; see plan_time_budget.py)

One row per (model, mesh): wall seconds for capture, strategies (enumeration and pricing) and
solve (every ILP the plan needs: four recipes and the auto plan's configurations), the total
wall and CPU seconds (wall time is inflated on a shared, loaded machine; CPU time is not),
the number of ILP variables of the auto plan as Alpa's formulation states it (one x per node
strategy, one e per allowed pair of every edge) and as solved (after presolve, dominance
pruning, edge compression, elimination and tying), the predicted step time against the best
recipe, and the process's peak resident memory so far (ru_maxrss: the largest of the runs
before it in the same process too).
"""

from __future__ import annotations

import argparse
import os
import resource
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autopar.api import plan_captured  # noqa: E402
from autopar.capture.export import capture  # noqa: E402
from autopar.errors import PlanningError  # noqa: E402
from autopar.mesh import Mesh  # noqa: E402
from autopar.options import PlanOptions  # noqa: E402
from autopar.presets import build_preset, splice_proven  # noqa: E402

LARGE = [("llama3-8b", "8x8"), ("llama3-70b", "8x16x8"), ("gpt2-xl", "4x4x4")]
SMALL_MODELS = ("gpt2-small", "llama3-8b-2l", "llama3-8b")
SMALL_MESHES = ("8", "2x4", "8x8")
COLUMNS = (
    "model",
    "mesh",
    "nodes",
    "capture s",
    "strategies s",
    "solve s",
    "total s",
    "cpu s",
    "vars (Alpa)",
    "vars solved",
    "auto step",
    "best recipe",
    "auto / best",
    "peak RSS GiB",
)


def full_variables(plan) -> int:
    """Alpa's count: a binary per node strategy plus a pair variable per allowed edge pair."""
    space = plan.space
    seen: dict[int, int] = {}
    pairs = 0
    for edge in space.edges:
        key = id(edge.cost_s)
        if key not in seen:
            seen[key] = int(np.count_nonzero(np.isfinite(edge.cost_s)))
        pairs += seen[key]
    return sum(len(n.strategies) for n in space.nodes) + pairs


def run(model_name: str, meshes: list[str], args, table: Table, console: Console) -> None:
    cpu0 = time.process_time()
    start = time.perf_counter()
    model, ex_args, ex_kwargs = build_preset(model_name, batch=args.batch, seq=args.seq)
    captured = capture(model, ex_args, ex_kwargs, check_splice=not splice_proven(model_name))
    capture_s = time.perf_counter() - start
    capture_cpu = time.process_time() - cpu0
    for mesh_text in meshes:
        cpu1 = time.process_time()
        mesh = Mesh.parse(mesh_text, device=args.device)
        options = PlanOptions(
            time_limit_s=args.time_limit, gap=args.gap, checkpoint=args.checkpoint
        )
        try:
            plan = plan_captured(
                captured,
                mesh,
                options,
                model_name=model_name,
                capture_s=capture_s,
                price_baselines=not args.no_baselines,
            )
        except PlanningError as e:
            console.print(f"{model_name} on {mesh_text}: no plan: {e}", highlight=False)
            table.add_row(model_name, mesh_text, *["-"] * (len(COLUMNS) - 3), "no plan fits")
            continue
        peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        cpu_s = capture_cpu + time.process_time() - cpu1
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
            f"{cpu_s:.2f}",
            f"{full_variables(plan):,}",
            f"{plan.data['solver']['num_variables']:,}",
            f"{plan.predicted_step_s * 1e3:.2f} ms",
            f"{best[0]} {best[1]['step_s'] * 1e3:.2f} ms" if best else "none fits",
            f"{plan.predicted_step_s / best[1]['step_s']:.3f}" if best else "-",
            f"{peak_gib:.2f}",
        )
        console.print(
            f"done: {model_name} on {mesh_text}: {sum(t.values()):.2f} s wall, {cpu_s:.2f} s cpu "
            f"(capture {t['capture_s']:.2f}, strategies {t['strategies_s']:.2f}, solve "
            f"{t['solve_s']:.2f}); variables {full_variables(plan):,} -> "
            f"{plan.data['solver']['num_variables']:,}; auto {plan.predicted_step_s * 1e3:.2f} ms; "
            f"peak RSS {peak_gib:.2f} GiB",
            highlight=False,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--set", choices=["large", "small", "budget"], default=None)
    parser.add_argument("--rows", nargs="+", default=None, help="--set budget: these rows only")
    parser.add_argument("--exact", action="store_true", help="--set budget: also at --gap 0")
    parser.add_argument("--row-timeout", type=float, default=900.0, help="--set budget: seconds")
    parser.add_argument("--max-memory", type=float, default=8.0, help="--set budget: GiB cap")
    parser.add_argument("--models", nargs="+", default=None)
    parser.add_argument("--meshes", nargs="+", default=None)
    parser.add_argument("--depth", default=None, help="model family for a depth table (NAME-Nl)")
    parser.add_argument("--mesh", default="8x8", help="mesh of the depth table")
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--device", default="h100")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--time-limit", type=float, default=None)
    parser.add_argument("--gap", type=float, default=0.0)
    parser.add_argument(
        "--checkpoint",
        default="auto",
        choices=["auto", "none", "all"],
        help="activation checkpointing mode of the plans (segments add rows to budgeted ILPs)",
    )
    parser.add_argument(
        "--no-baselines", action="store_true", help="solve the auto plan only, not the recipes"
    )
    args = parser.parse_args()
    if args.set == "budget":
        import plan_time_budget as budget

        names = args.rows or list(budget.ROWS)
        rows = budget.run_rows(
            names, exact=args.exact, timeout_s=args.row_timeout, max_memory_gib=args.max_memory
        )
        budget.print_table(rows, title="planning time where the budget binds (whole command)")
        return

    console = Console(width=200)
    table = Table(
        title=f"planning time ({args.device}, global batch {args.batch}, seq {args.seq}, "
        f"checkpoint {args.checkpoint})"
    )
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("model", "mesh") else "right")
    if args.depth:
        for layers in args.layers:
            run(f"{args.depth}-{layers}l", [args.mesh], args, table, console)
    elif args.models:
        for model_name in args.models:
            run(model_name, args.meshes or list(SMALL_MESHES), args, table, console)
    elif args.set == "small":
        for model_name in SMALL_MODELS:
            run(model_name, list(SMALL_MESHES), args, table, console)
    else:
        for model_name, mesh_text in LARGE:
            run(model_name, [mesh_text], args, table, console)
    console.print(table)


if __name__ == "__main__":
    main()
