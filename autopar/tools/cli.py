"""Command line: ``autopar plan`` (offline planning) and ``autopar show`` (inspect a plan)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from autopar.tools.cli_args import build_parser as _build_parser
from autopar.tools.cli_args import parse_zero  # noqa: F401 - part of this module's interface

# Hugging Face models are built from configs only: never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _plan_options(args: argparse.Namespace, **planning):
    """PlanOptions from the model and cost-model flags (``planning``: plan's own flags)."""
    from autopar.options import PlanOptions

    return PlanOptions(
        memory_budget=args.budget,
        optimizer=args.optimizer,
        mixed_precision=args.mixed_precision,
        solver=args.solver,
        time_limit_s=args.time_limit,
        gap=args.gap,
        auto_margin=args.auto_margin,
        **planning,
    )


def _build_mesh(args: argparse.Namespace):
    from autopar.mesh import Mesh

    if args.mesh is None:
        if getattr(args, "devices", None) is None:
            raise ValueError("give --mesh (e.g. --mesh 8x8) or --devices N [--per-node K]")
        return None
    links = args.links.split(",") if args.links else None
    return Mesh.parse(args.mesh, device=args.device, links=links, profile=args.profile)


class _Progress:
    """Progress on stderr: rich's status line and timed log on a terminal; redirected, plain
    unwrapped lines (rich would wrap and pad them at 80 columns)."""

    def __init__(self) -> None:
        from rich.console import Console

        self._console = Console(stderr=True, highlight=False, log_path=False)

    def log(self, line: str) -> None:
        if self._console.is_terminal:
            self._console.log(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def status(self, text: str):
        return self._console.status(text) if self._console.is_terminal else _NoStatus()


class _NoStatus:
    """``_Progress.status`` off a terminal: nothing to animate or update."""

    def __enter__(self) -> _NoStatus:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, text: str) -> None:
        return None


def cmd_plan(args: argparse.Namespace) -> int:
    # Progress goes to stderr, and its first line comes before torch and the planner load
    # (about 2 s of imports): bad options fail first, then the user sees what is happening.
    console = _Progress()
    if args.jobs is not None:
        if args.jobs < 1:
            raise SystemExit(f"autopar plan: --jobs {args.jobs}: expected 1 or more")
        os.environ["AUTOPAR_PLAN_JOBS"] = str(args.jobs)
    mesh = _build_mesh(args)
    options = _plan_options(
        args, recipe=args.recipe, zero_stage=args.zero, checkpoint=args.checkpoint
    )
    start = time.perf_counter()
    with console.status("loading torch and the planner"):
        from autopar.api import plan_captured
        from autopar.capture.export import capture
        from autopar.plan import cache as plan_cache
        from autopar.plan.summary import planning_note
        from autopar.presets import build_preset, splice_proven
        from autopar.tools.report import plot_prefix
    # In the program (not a caller's process), what the imports loaded (torch's modules, op
    # tables, the planner) and, below, the captured model live until exit: frozen, the
    # collector's full passes no longer scan them again and again (llama3-8b b32 bf16: 0.9 s
    # of CPU in 7 full passes, 0.45 s with both freezes).
    if args.program:
        gc.freeze()
    plot_path = None
    if getattr(args, "sweep_budget", None):  # matplotlib checked before capture and planning
        plot_path = plot_prefix(args.sweep_plot, "budget_sweep.png", "--sweep-plot")
    start = time.perf_counter()
    with console.status("capturing the model"):
        model, example_args, example_kwargs = build_preset(
            args.model, batch=args.batch, seq=args.seq
        )
        captured = capture(
            model, example_args, example_kwargs, check_splice=not splice_proven(args.model)
        )
    capture_s = time.perf_counter() - start
    if args.program:
        gc.freeze()
        if not getattr(args, "sweep_budget", None):
            # One plan, then os._exit: its containers die by reference count, and the few
            # cycles it leaves (27 MB on llama3-70b b256 fp32) are not worth the collector's
            # passes over the young ones (about 1 s of that row's 29 s).
            gc.disable()
    replicated = f" ({captured.replicated_layers})" if captured.replicated_layers else ""
    console.log(f"capture: {len(captured.gm.graph.nodes)} nodes, {capture_s:.2f} s{replicated}")
    if getattr(args, "sweep_budget", None):
        from autopar.planner.driver import Driver
        from autopar.planner.space import build_space
        from autopar.planner.sweep import budget_sweep
        from autopar.tools.report import plot_budget_sweep, sweep_table

        if args.html:
            raise ValueError("--html reports one plan; it does not go with --sweep-budget")
        if args.sweep_budget < 2:
            raise ValueError("--sweep-budget needs at least 2 points")
        with console.status("planning under each budget"):
            driver = Driver(build_space(captured, mesh, options))
            points = budget_sweep(driver, num_points=args.sweep_budget)
        title = f"{args.model} on {mesh.describe()}: step time vs memory budget (checkpoint={args.checkpoint})"
        print(sweep_table(points, title=title))
        if plot_path is not None:
            plot_budget_sweep(points, plot_path, title=title)
            print(f"plot written to {plot_path}")
        return 0
    if _stages_wanted(args, mesh):
        return _plan_stages(args, console, captured, mesh, options, capture_s)
    key = plan_cache.cache_key(captured.graph_hash, mesh, options, args.model)
    plan = None if args.no_cache else plan_cache.load(key, captured.graph_hash)
    cached = plan is not None
    if plan is not None:
        console.log(f"plan cache hit: {plan_cache.cache_dir() / (key + '.json')}")
    else:
        with console.status("planning: strategies and solves") as status:

            def progress(line: str) -> None:
                console.log(line)
                status.update(f"planning: {line.split(':')[0]} done")

            plan = plan_captured(
                captured,
                mesh,
                options,
                model_name=args.model,
                capture_s=capture_s,
                progress=progress,
            )
        if not args.no_cache:
            plan_cache.store(key, plan)
    _print_plan(plan, args, note=planning_note(plan.data, live=not cached))
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    _write_html(args, plan)
    return 0


def _stages_wanted(args: argparse.Namespace, mesh) -> bool:
    fixed = (args.devices, args.stages, args.microbatches, args.schedule)
    return any(x is not None for x in fixed) or (mesh is not None and "pp" in mesh.axis_names)


def _plan_stages(args, console, captured, mesh, options, capture_s: float) -> int:
    """``--devices`` / ``--stages`` / a ``pp`` axis: the stage search (autopar.api.plan_stages);
    presets are probed as their 2-block variant (same blocks and ends, faster ILPs)."""
    from autopar.api import plan_stages
    from autopar.capture.export import capture
    from autopar.plan.stage_search import StageOptions
    from autopar.presets import PRESETS, _split_layers, build_preset, splice_proven

    base, layers = _split_layers(args.model)
    few = base in PRESETS and base != "mlp" and (layers is None or layers > 2)
    probe_name = f"{base}-2l" if few else args.model

    def probe(batch: int, name: str = probe_name):
        model, example_args, example_kwargs = build_preset(name, batch=batch, seq=args.seq)
        return capture(model, example_args, example_kwargs, check_splice=not splice_proven(name))

    def whole(batch: int):
        return probe(batch, args.model)

    stage = StageOptions(
        devices=args.devices,
        per_node=args.per_node,
        stages=args.stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
    )
    start = time.perf_counter()
    with console.status("planning pipeline stages"):
        plan = plan_stages(
            captured,
            probe,
            mesh=mesh,
            stage=stage,
            options=options,
            model_name=args.model,
            capture_s=capture_s,
            device=args.device,
            progress=console.log,
            capture_microbatch=whole,
            stage_plans=bool(args.out),
        )  # the file runs as saved: its stages' plans
    print(plan.summary(width=output_width(), verbose=args.verbose))
    print(f"stage search: {time.perf_counter() - start:.1f} s wall")
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    _write_html(args, plan)
    return 0


def _write_html(args: argparse.Namespace, plan) -> None:
    """``--html PATH``: the plan report (autopar.plan.report_html), one self-contained page."""
    if args.html:
        from autopar.plan.report_html import write_plan_html

        write_plan_html(plan.data, args.html)
        print(f"report written to {args.html}")


def output_width() -> int | None:
    """Columns to render for: $COLUMNS when set, the terminal's width when stdout is one, else
    None (redirected: plain unwrapped lines)."""
    import shutil

    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def _print_explanations(plan, names: list[str]) -> None:
    width = output_width()
    for k, name in enumerate(names):
        if k:
            print()
        print(plan.explain(name, width=width))


def _print_plan(plan, args: argparse.Namespace, *, note: str) -> None:
    """The summary (the same for a live, cached or loaded plan), the planning-time note, and
    the explanations asked for."""
    print(plan.summary(width=output_width(), verbose=args.verbose))
    print(note)
    if args.explain:
        print()
        _print_explanations(plan, args.explain)


def cmd_show(args: argparse.Namespace) -> int:
    from autopar.plan.document import Plan
    from autopar.plan.summary import planning_note

    if Path(args.plan).is_dir():
        raise ValueError(
            f"{args.plan} is a directory; pass a plan JSON file (written by autopar plan --out)"
        )
    plan = Plan.load(args.plan)
    if args.explain:
        _print_explanations(plan, args.explain)
    else:
        _print_plan(plan, args, note=planning_note(plan.data, live=False))
    _write_html(args, plan)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from autopar.capture.export import capture
    from autopar.planner.recipes import BASELINE_RECIPES
    from autopar.presets import build_preset, splice_proven
    from autopar.tools.report import compare_rows, compare_table, plans_for_recipes

    mesh = _build_mesh(args)
    recipes = (
        ["auto", *(r for r in args.baselines.split(",") if r)]
        if args.baselines
        else ["auto", *BASELINE_RECIPES]
    )
    options = _plan_options(args)
    model, example_args, example_kwargs = build_preset(args.model, batch=args.batch, seq=args.seq)
    captured = capture(
        model, example_args, example_kwargs, check_splice=not splice_proven(args.model)
    )
    plans = plans_for_recipes(captured, mesh, options, recipes=recipes, model_name=args.model)
    title = (
        f"{args.model} on {mesh.describe()}, global batch {args.batch} x seq {args.seq} (predicted)"
    )
    print(compare_table(compare_rows(plans), markdown=args.markdown, title=title))
    if args.html:
        from autopar.tools.html_report import write_comparison_html

        write_comparison_html(args.html, plans, title=title)
        print(f"report written to {args.html}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from autopar.mesh import Mesh
    from autopar.tools.calibration import CalibrationConfig, calibrate
    from cost_models import save_profile

    mesh = Mesh.parse(args.mesh, device="cpu")
    import torch

    if args.quick:
        config = CalibrationConfig.tiny()
    elif torch.cuda.is_available() and args.nproc is None:  # torchrun ranks on GPUs (NCCL)
        config = CalibrationConfig.for_gpu()
    else:
        config = CalibrationConfig()
    profile = calibrate(mesh.shape, mesh.axis_names, config=config, nproc=args.nproc)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        save_profile(profile, args.out)
        print(f"profile written to {args.out} (use it with --profile {args.out})")
    return 0


def cmd_bench_cost(args: argparse.Namespace) -> int:
    from autopar.tools.bench_cost import BenchConfig, bench_cost_cli

    config = BenchConfig(steps=args.steps, op_repeat_s=args.op_time, measure_ops=not args.no_ops)
    return bench_cost_cli(args, config)


def build_parser() -> argparse.ArgumentParser:
    """``autopar``'s parser with this module's commands (autopar/tools/cli_args.py)."""
    return _build_parser(
        {
            "plan": cmd_plan,
            "show": cmd_show,
            "compare": cmd_compare,
            "calibrate": cmd_calibrate,
            "bench-cost": cmd_bench_cost,
        }
    )


def main(argv: Sequence[str] | None = None, *, program: bool = False) -> int:
    """Run one command; ``program``: this process is the ``autopar`` program itself (see
    :func:`run`), so nothing it loads needs collecting before exit."""
    from autopar.errors import AutoparError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # argparse takes "-5GiB" for an option; glue it to --budget so the error is about budgets.
    for k in range(len(argv) - 2, -1, -1):
        if argv[k] == "--budget" and argv[k + 1].startswith("-"):
            argv[k : k + 2] = [f"--budget={argv[k + 1]}"]
    args = parser.parse_args(argv)
    args.program = program
    try:
        return args.func(args)
    except (AutoparError, ValueError, KeyError, OSError) as e:
        # A KeyError's str() is its repr (quoted); print its message as written.
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"autopar: error: {message}", file=sys.stderr)
        return 2


# Commands that run in one process and leave nothing to tear down but the interpreter itself.
_FAST_EXIT_COMMANDS = frozenset({"plan", "show", "compare"})


def run() -> None:
    """The ``autopar`` program: :func:`main` on ``sys.argv``, then exit. After ``plan``,
    ``show`` and ``compare`` the process ends at once (``os._exit``, output flushed and logging
    shut down first) instead of tearing the interpreter down object by object: torch's and the
    planner's objects took 1.3 s of CPU to destroy after a llama3-8b b32 plan (the commands
    hold no files, processes or process groups open by then). Other commands (calibrate and
    bench-cost run under torchrun) exit the ordinary way."""
    argv = sys.argv[1:]
    fast = bool(argv) and argv[0] in _FAST_EXIT_COMMANDS
    if fast:
        # Young collections every 20,000 allocations instead of 700: the planner allocates
        # millions of short-lived containers and frees nearly all of them by reference count
        # (llama3-8b b32 bf16: 1,350 young and 10 full collections, 0.86 s of CPU; 61 young,
        # no full one, 0.47 s; gpt2-small-2l 0.81 -> 0.21 s; max RSS +1 MB).
        gc.set_threshold(20_000, 10, 10)
    code = main(argv, program=True)
    if fast:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except OSError:  # a closed pipe (``| head``): nothing more can be written anyway
                pass
        logging.shutdown()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
