"""Command line: ``autopar plan`` (offline planning) and ``autopar show`` (inspect a plan)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

# Hugging Face models are built from configs only: never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")



def parse_zero(text: str) -> int | tuple[int, ...] | dict[str, int]:
    """``--zero``: '3', '3,2' (one stage per mesh axis) or 'dp=3,tp=0' (per axis name)."""
    usage = "use a stage 0-3 ('3'), one per mesh axis ('3,2') or per axis name ('dp=3,tp=0')"
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        if parts and all("=" in p for p in parts):
            named = {k.strip(): int(v) for k, v in (p.split("=", 1) for p in parts)}
            values = list(named.values())
            result: int | tuple[int, ...] | dict[str, int] = named
        elif len(parts) == 1:
            values = [int(parts[0])]
            result = values[0]
        else:
            values = [int(p) for p in parts]
            result = tuple(values)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --zero {text!r}: {usage}") from None
    if not parts or any(v not in (0, 1, 2, 3) for v in values):
        raise argparse.ArgumentTypeError(f"bad --zero {text!r}: stages must be 0-3; {usage}")
    return result

def parse_budget(text: str) -> str:
    """``--budget``: a positive memory size per device ('80GiB', '40GB', bytes)."""
    from autopar.options import parse_bytes

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"budgets must be positive, got {text!r} (e.g. --budget 80GiB)")
    try:
        parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def parse_report_path(text: str) -> str:
    """``--html``: a file to write, checked before any planning so a typo costs no minutes."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name such as report.html")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: directory {path.parent} does not exist")
    return text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): what is wrong and where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _margin(text: str) -> float | str:
    return text if text == "profile" else float(text)


def _add_plan_options(parser: argparse.ArgumentParser, *, planning: bool = True, precision: bool = True) -> None:
    """Model, mesh and cost-model flags; ``planning`` adds the flags that shape one plan
    (--recipe, --zero, --checkpoint, --no-cache), which compare and bench-cost do not take
    (they plan every recipe); ``precision`` adds --mixed-precision (bench-cost runs fp32)."""
    from autopar.options import CHECKPOINT_MODES, RECIPES, SOLVERS
    from cost_models import OPTIMIZERS

    parser.add_argument("model", help="preset (mlp, gpt2-small, gpt2-xl, llama3-8b, llama3-70b, "
                        "NAME-Nl), hf:<model_type>[?key=value&...], or package.module:factory "
                        "(importable from the working directory)")
    parser.add_argument("--mesh", required=not planning, default=None,
                        help="mesh shape: 8x8, 4x4x4, 8 or dp=8,tp=8 (plan: or --devices)")
    parser.add_argument("--device", default="h100", help="device preset (cpu, a100, a100-40gb, h100, h100-pcie, h200)")
    parser.add_argument("--links", default=None, help="per-axis link presets, comma separated (e.g. infiniband,nvlink)")
    parser.add_argument("--profile", default=None, help="JSON device/link profile (overrides presets)")
    parser.add_argument("--batch", type=int, default=8, help="GLOBAL batch size (default 8)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--budget", type=parse_budget, default=None,
                        help="memory budget per device, e.g. 80GiB (default: capacity - 10%%)")
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, metavar="OPTIMIZER",
                        help=f"optimizer whose state is counted in memory: {', '.join(OPTIMIZERS)} (default adamw)")
    if precision:
        parser.add_argument("--mixed-precision", default=None, choices=["bf16", "fp16"],
                            help="price bf16 or fp16 compute with fp32 master weights (default: fp32)")
    parser.add_argument("--time-limit", type=float, default=None, help="solver time limit in seconds")
    parser.add_argument("--gap", type=float, default=0.01,
                        help="relative optimality gap at which the solver may stop, in [0, 1) (default 0.01; 0: proven optimum)")
    parser.add_argument("--auto-margin", type=_margin, default=None,
                        help="keep the fastest recipe unless the auto plan is predicted faster by this fraction, "
                        "or 'profile': by the calibrated profile's measured error (default 0: always the auto plan)")
    parser.add_argument("--solver", default="highs", choices=SOLVERS, help="ILP backend (default highs)")
    if not planning:
        return
    parser.add_argument("--recipe", default="auto", choices=RECIPES,
                        help="auto (the ILP chooses) or a fixed recipe: ddp, fsdp, megatron, fsdp+tp (default auto)")
    parser.add_argument(
        "--zero",
        type=parse_zero,
        default=None,
        help="force ZeRO: a stage 0-3 on every data-parallel axis, one stage per mesh axis "
        "('3,2'), or per axis name ('dp=3,tp=0'; unnamed axes 0)",
    )
    parser.add_argument("--checkpoint", default="auto", choices=CHECKPOINT_MODES,
                        help="activation checkpointing: auto (the ILP recomputes segments when the "
                        "budget binds), none, or all (default auto)")
    parser.add_argument("--devices", type=int, default=None,
                        help="search every pipeline x data x tensor mesh of this many devices "
                        "(instead of --mesh) and print the ranked table")
    parser.add_argument("--per-node", type=int, default=8, help="devices per node for --devices (default 8)")
    parser.add_argument("--stages", type=int, default=None,
                        help="pipeline stages (1: none); default: searched with --devices or a pp axis")
    parser.add_argument("--microbatches", type=int, default=None, help="pipeline microbatches (default: searched)")
    parser.add_argument("--schedule", default=None, choices=["gpipe", "1f1b", "interleaved-1f1b"],
                        help="pipeline schedule (default: searched)")
    parser.add_argument("--no-cache", action="store_true",
                        help="plan again even if the plan cache ($AUTOPAR_CACHE_DIR or ~/.cache/autopar/plans) has this plan")


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
    from autopar.options import PlanOptions

    # Progress goes to stderr, and its first line comes before torch and the planner load
    # (about 2 s of imports): bad options fail first, then the user sees what is happening.
    console = _Progress()
    mesh = _build_mesh(args)
    options = PlanOptions(
        recipe=args.recipe,
        memory_budget=args.budget,
        optimizer=args.optimizer,
        mixed_precision=args.mixed_precision,
        zero_stage=args.zero,
        checkpoint=args.checkpoint,
        time_limit_s=args.time_limit,
        gap=args.gap,
        solver=args.solver,
        auto_margin=args.auto_margin,
    )
    start = time.perf_counter()
    with console.status("loading torch and the planner"):
        from autopar.api import plan_captured
        from autopar.capture.export import capture
        from autopar.plan import cache as plan_cache
        from autopar.plan.summary import planning_note
        from autopar.presets import build_preset, splice_proven
        from autopar.tools.report import plot_prefix
    plot_path = None
    if getattr(args, "sweep_budget", None):  # matplotlib checked before capture and planning
        plot_path = plot_prefix(args.sweep_plot, "budget_sweep.png", "--sweep-plot")
    start = time.perf_counter()
    with console.status("capturing the model"):
        model, example_args, example_kwargs = build_preset(args.model, batch=args.batch, seq=args.seq)
        captured = capture(model, example_args, example_kwargs, check_splice=not splice_proven(args.model))
    capture_s = time.perf_counter() - start
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
                captured, mesh, options, model_name=args.model, capture_s=capture_s, progress=progress
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

    stage = StageOptions(devices=args.devices, per_node=args.per_node, stages=args.stages,
                         microbatches=args.microbatches, schedule=args.schedule)
    start = time.perf_counter()
    with console.status("planning pipeline stages"):
        plan = plan_stages(captured, probe, mesh=mesh, stage=stage, options=options,
                           model_name=args.model, capture_s=capture_s, device=args.device,
                           progress=console.log, capture_microbatch=whole,
                           stage_plans=bool(args.out))  # the file runs as saved: its stages' plans
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


def _explain_names(text: str) -> list[str]:
    return [name for name in (n.strip() for n in text.split(",")) if name]


def cmd_show(args: argparse.Namespace) -> int:
    from autopar.plan.document import Plan
    from autopar.plan.summary import planning_note

    if Path(args.plan).is_dir():
        raise ValueError(f"{args.plan} is a directory; pass a plan JSON file (written by autopar plan --out)")
    plan = Plan.load(args.plan)
    if args.explain:
        _print_explanations(plan, args.explain)
    else:
        _print_plan(plan, args, note=planning_note(plan.data, live=False))
    _write_html(args, plan)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from autopar.capture.export import capture
    from autopar.options import PlanOptions
    from autopar.planner.recipes import BASELINE_RECIPES
    from autopar.presets import build_preset, splice_proven
    from autopar.tools.report import compare_rows, compare_table, plans_for_recipes

    mesh = _build_mesh(args)
    recipes = ["auto", *(r for r in args.baselines.split(",") if r)] if args.baselines else ["auto", *BASELINE_RECIPES]
    options = PlanOptions(memory_budget=args.budget, optimizer=args.optimizer,
                          mixed_precision=args.mixed_precision, solver=args.solver,
                          time_limit_s=args.time_limit, gap=args.gap, auto_margin=args.auto_margin)
    model, example_args, example_kwargs = build_preset(args.model, batch=args.batch, seq=args.seq)
    captured = capture(model, example_args, example_kwargs, check_splice=not splice_proven(args.model))
    plans = plans_for_recipes(captured, mesh, options, recipes=recipes, model_name=args.model)
    title = f"{args.model} on {mesh.describe()}, global batch {args.batch} x seq {args.seq} (predicted)"
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


def _add_view_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verbose", action="store_true",
                        help="also print the ZeRO stage and configuration tables, the recomputed "
                        "segments and the solver's report")
    parser.add_argument("--explain", action="extend", type=_explain_names, default=None, metavar="NAME",
                        help="why a parameter FQN or module path (e.g. layers.0.attention.wq.weight) "
                        "got its layout: the alternatives weighed and why not; repeat the flag or "
                        "separate names with commas")


def build_parser() -> argparse.ArgumentParser:
    from autopar import __version__

    parser = _Parser(prog="autopar", description="automatic parallelization for PyTorch")
    parser.add_argument("--version", action="version", version=f"autopar {__version__}",
                        help="print autopar's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="plan, show, compare, calibrate or bench-cost (each has --help)")
    p = sub.add_parser("plan", help="plan a model on a mesh offline and print the summary")
    _add_plan_options(p)
    p.add_argument("--out", default=None, help="write the plan JSON here")
    _add_view_options(p)
    p.add_argument("--html", type=parse_report_path, default=None, metavar="PATH", help="write an HTML report here (one self-contained file: figures, layouts, recipes)")
    p.add_argument("--sweep-budget", type=int, nargs="?", const=6, default=None, metavar="POINTS",
                   help="instead of one plan: plan under POINTS budgets (default 6) from the smallest "
                   "that fits to the budget-free peak; print step time vs budget and plot it")
    p.add_argument("--sweep-plot", default=None, help="PNG written by --sweep-budget (default budget_sweep.png; "
                   "needs matplotlib, checked before planning; without it and without this flag it is skipped)")
    p.set_defaults(func=cmd_plan)
    s = sub.add_parser("show", help="print a saved plan's summary, or explain nodes")
    s.add_argument("plan", help="plan JSON file")
    _add_view_options(s)
    s.add_argument("--html", type=parse_report_path, default=None, metavar="PATH", help="write an HTML report here (one self-contained file: figures, layouts, recipes)")
    s.set_defaults(func=cmd_show)
    c = sub.add_parser("compare", help="the auto plan vs each recipe: step time, bytes per axis, memory")
    _add_plan_options(c, planning=False)
    c.add_argument("--baselines", default=None, help="recipes to compare, comma separated (default: all)")
    c.add_argument("--markdown", action="store_true", help="print a Markdown table")
    c.add_argument("--html", type=parse_report_path, default=None, metavar="PATH",
                   help="write the plans side by side as an HTML report here (self-contained file)")
    c.set_defaults(func=cmd_compare)
    k = sub.add_parser("calibrate", help="measure this machine (under torchrun, or --nproc N) and write a profile")
    k.add_argument("--mesh", required=True, help="mesh shape: 2x2, 4, dp=2,tp=2")
    k.add_argument("--out", required=True, help="profile JSON to write")
    k.add_argument("--nproc", type=int, default=None, help="spawn this many gloo ranks on 127.0.0.1 (no torchrun)")
    k.add_argument("--quick", action="store_true", help="minimal sizes (seconds; for tests)")
    k.set_defaults(func=cmd_calibrate)
    b = sub.add_parser("bench-cost", help="predicted vs measured op and step times of the auto plan and recipes")
    _add_plan_options(b, planning=False, precision=False)
    b.add_argument("--recipes", default="auto,ddp,megatron,fsdp,fsdp+tp", help="plans to run, comma separated")
    b.add_argument("--steps", type=int, default=5, help="timed training steps per plan")
    b.add_argument("--op-time", type=float, default=0.01, help="seconds of repeats per op timing")
    b.add_argument("--no-ops", action="store_true", help="skip the per-op measurements")
    b.add_argument("--nproc", type=int, default=None, help="spawn gloo ranks here (default: the mesh size, unless under torchrun)")
    b.add_argument("--plots", default=None, help="PNG path prefix (PREFIX_ops.png, PREFIX_steps.png; default "
                   "bench_cost); needs matplotlib, checked before measuring (without it and without "
                   "--plots the plots are skipped)")
    b.add_argument("--markdown", action="store_true", help="print Markdown tables")
    b.add_argument("--json", default=None, help="write every figure to this JSON file")
    b.add_argument("--html", type=parse_report_path, default=None, metavar="PATH",
                   help="write predicted vs measured and the plans side by side as an HTML report here")
    b.set_defaults(func=cmd_bench_cost)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from autopar.errors import AutoparError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # argparse takes "-5GiB" for an option; glue it to --budget so the error is about budgets.
    for k in range(len(argv) - 2, -1, -1):
        if argv[k] == "--budget" and argv[k + 1].startswith("-"):
            argv[k : k + 2] = [f"--budget={argv[k + 1]}"]
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (AutoparError, ValueError, KeyError, OSError) as e:
        # A KeyError's str() is its repr (quoted); print its message as written.
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"autopar: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
