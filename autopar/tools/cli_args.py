"""The command line's arguments: ``autopar``'s parser, its subcommands and their flags, and the
checks that run while parsing (a bad budget, zero stage or report path fails before any planning).
The commands themselves are in autopar/tools/cli.py."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

from autopar.planner.stages import SCHEDULES


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
        raise argparse.ArgumentTypeError(
            f"budgets must be positive, got {text!r} (e.g. --budget 80GiB)"
        )
    try:
        parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def parse_report_path(text: str) -> str:
    """``--html``: a file to write, checked before any planning so a typo costs no minutes."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(
            f"{text} is a directory; give a file name such as report.html"
        )
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(
            f"cannot write {text}: directory {path.parent} does not exist"
        )
    return text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): what is wrong and where help is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _margin(text: str) -> float | str:
    return text if text == "profile" else float(text)


def _add_plan_options(
    parser: argparse.ArgumentParser, *, planning: bool = True, precision: bool = True
) -> None:
    """Model, mesh and cost-model flags; ``planning`` adds the flags that shape one plan
    (--recipe, --zero, --checkpoint, --no-cache), which compare and bench-cost do not take
    (they plan every recipe); ``precision`` adds --mixed-precision (bench-cost runs fp32)."""
    from autopar.options import SOLVERS
    from cost_models import OPTIMIZERS

    parser.add_argument(
        "model",
        help="preset (mlp, gpt2-small, gpt2-xl, llama3-8b, llama3-70b, "
        "NAME-Nl), hf:<model_type>[?key=value&...], or package.module:factory "
        "(importable from the working directory)",
    )
    parser.add_argument(
        "--mesh",
        required=not planning,
        default=None,
        help="mesh shape: 8x8, 4x4x4, 8 or dp=8,tp=8 (plan: or --devices)",
    )
    parser.add_argument(
        "--device",
        default="h100",
        help="device preset (cpu, a100, a100-40gb, h100, h100-pcie, h200)",
    )
    parser.add_argument(
        "--links",
        default=None,
        help="per-axis link presets, comma separated (e.g. infiniband,nvlink)",
    )
    parser.add_argument(
        "--profile", default=None, help="JSON device/link profile (overrides presets)"
    )
    parser.add_argument("--batch", type=int, default=8, help="GLOBAL batch size (default 8)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument(
        "--budget",
        type=parse_budget,
        default=None,
        help="memory budget per device, e.g. 80GiB (default: capacity - 10%%)",
    )
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=OPTIMIZERS,
        metavar="OPTIMIZER",
        help=f"optimizer whose state is counted in memory: {', '.join(OPTIMIZERS)} (default adamw)",
    )
    if precision:
        parser.add_argument(
            "--mixed-precision",
            default=None,
            choices=["bf16", "fp16"],
            help="price bf16 or fp16 compute with fp32 master weights (default: fp32)",
        )
    parser.add_argument(
        "--time-limit", type=float, default=None, help="solver time limit in seconds"
    )
    parser.add_argument(
        "--gap",
        type=float,
        default=0.01,
        help="relative optimality gap at which the solver may stop, in [0, 1) (default 0.01; 0: proven optimum)",
    )
    parser.add_argument(
        "--auto-margin",
        type=_margin,
        default=None,
        help="keep the fastest recipe unless the auto plan is predicted faster by this fraction, "
        "or 'profile': by the calibrated profile's measured error, or 0: always the auto plan "
        "(default: 2%% near-ties on a calibrated profile, 0 on datasheet devices)",
    )
    parser.add_argument(
        "--solver", default="highs", choices=SOLVERS, help="ILP backend (default highs)"
    )
    if planning:
        _add_planning_options(parser)


def _add_planning_options(parser: argparse.ArgumentParser) -> None:
    """The flags that shape one plan: recipe, ZeRO, checkpointing, pipeline stages, cache."""
    from autopar.options import CHECKPOINT_MODES, RECIPES

    parser.add_argument(
        "--recipe",
        default="auto",
        choices=RECIPES,
        help="auto (the ILP chooses) or a fixed recipe: ddp, fsdp, megatron, fsdp+tp (default auto)",
    )
    parser.add_argument(
        "--zero",
        type=parse_zero,
        default=None,
        help="force ZeRO: a stage 0-3 on every data-parallel axis, one stage per mesh axis "
        "('3,2'), or per axis name ('dp=3,tp=0'; unnamed axes 0)",
    )
    parser.add_argument(
        "--checkpoint",
        default="auto",
        choices=CHECKPOINT_MODES,
        help="activation checkpointing: auto (the ILP recomputes segments when the "
        "budget binds), none, or all (default auto)",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="search every pipeline x data x tensor mesh of this many devices "
        "(instead of --mesh) and print the ranked table",
    )
    parser.add_argument(
        "--per-node", type=int, default=8, help="devices per node for --devices (default 8)"
    )
    parser.add_argument(
        "--stages",
        type=int,
        default=None,
        help="pipeline stages (1: none); default: searched with --devices or a pp axis",
    )
    parser.add_argument(
        "--microbatches", type=int, default=None, help="pipeline microbatches (default: searched)"
    )
    parser.add_argument(
        "--schedule",
        default=None,
        choices=SCHEDULES,
        help="pipeline schedule (default: searched; the last three: 2 stages per rank)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes the ZeRO search may use side by side (sets AUTOPAR_PLAN_JOBS; "
        "default: one worker bounds the configuration that skips the most others where the "
        "problem is large; 1: everything in this process)",
    )
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="plan again even if the plan cache ($AUTOPAR_CACHE_DIR or ~/.cache/autopar/plans) has this plan",
    )


def _explain_names(text: str) -> list[str]:
    return [name for name in (n.strip() for n in text.split(",")) if name]


def _add_view_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also print the ZeRO stage and configuration tables, the recomputed "
        "segments and the solver's report",
    )
    parser.add_argument(
        "--explain",
        action="extend",
        type=_explain_names,
        default=None,
        metavar="NAME",
        help="why a parameter FQN or module path (e.g. layers.0.attention.wq.weight) "
        "got its layout: the alternatives weighed and why not; repeat the flag or "
        "separate names with commas",
    )


def build_parser(
    commands: Mapping[str, Callable[[argparse.Namespace], int]],
) -> argparse.ArgumentParser:
    """``autopar``'s parser; ``commands`` maps each subcommand (plan, show, compare, calibrate,
    bench-cost) to the function that runs it (set as ``args.func``)."""
    from autopar import __version__

    parser = _Parser(prog="autopar", description="automatic parallelization for PyTorch")
    parser.add_argument(
        "--version",
        action="version",
        version=f"autopar {__version__}",
        help="print autopar's version and exit",
    )
    sub = parser.add_subparsers(
        dest="command",
        required=True,
        metavar="COMMAND",
        help="plan, show, compare, calibrate or bench-cost (each has --help)",
    )
    p = sub.add_parser("plan", help="plan a model on a mesh offline and print the summary")
    _add_plan_options(p)
    p.add_argument("--out", default=None, help="write the plan JSON here")
    _add_view_options(p)
    p.add_argument(
        "--html",
        type=parse_report_path,
        default=None,
        metavar="PATH",
        help="write an HTML report here (one self-contained file: figures, layouts, recipes)",
    )
    p.add_argument(
        "--sweep-budget",
        type=int,
        nargs="?",
        const=6,
        default=None,
        metavar="POINTS",
        help="instead of one plan: plan under POINTS budgets (default 6) from the smallest "
        "that fits to the budget-free peak; print step time vs budget and plot it",
    )
    p.add_argument(
        "--sweep-plot",
        default=None,
        help="PNG written by --sweep-budget (default budget_sweep.png; "
        "needs matplotlib, checked before planning; without it and without this flag it is skipped)",
    )
    p.set_defaults(func=commands["plan"])
    s = sub.add_parser("show", help="print a saved plan's summary, or explain nodes")
    s.add_argument("plan", help="plan JSON file")
    _add_view_options(s)
    s.add_argument(
        "--html",
        type=parse_report_path,
        default=None,
        metavar="PATH",
        help="write an HTML report here (one self-contained file: figures, layouts, recipes)",
    )
    s.set_defaults(func=commands["show"])
    _add_measure_commands(sub, commands)
    return parser


def _add_measure_commands(sub, commands: Mapping[str, Callable[[argparse.Namespace], int]]) -> None:
    """compare, calibrate and bench-cost: the subcommands that price or time every recipe."""
    c = sub.add_parser(
        "compare", help="the auto plan vs each recipe: step time, bytes per axis, memory"
    )
    _add_plan_options(c, planning=False)
    c.add_argument(
        "--baselines", default=None, help="recipes to compare, comma separated (default: all)"
    )
    c.add_argument("--markdown", action="store_true", help="print a Markdown table")
    c.add_argument(
        "--html",
        type=parse_report_path,
        default=None,
        metavar="PATH",
        help="write the plans side by side as an HTML report here (self-contained file)",
    )
    c.set_defaults(func=commands["compare"])
    k = sub.add_parser(
        "calibrate", help="measure this machine (under torchrun, or --nproc N) and write a profile"
    )
    k.add_argument("--mesh", required=True, help="mesh shape: 2x2, 4, dp=2,tp=2")
    k.add_argument("--out", required=True, help="profile JSON to write")
    k.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="spawn this many gloo ranks on 127.0.0.1 (no torchrun)",
    )
    k.add_argument("--quick", action="store_true", help="minimal sizes (seconds; for tests)")
    k.set_defaults(func=commands["calibrate"])
    b = sub.add_parser(
        "bench-cost", help="predicted vs measured op and step times of the auto plan and recipes"
    )
    _add_plan_options(b, planning=False, precision=False)
    b.add_argument(
        "--recipes", default="auto,ddp,megatron,fsdp,fsdp+tp", help="plans to run, comma separated"
    )
    b.add_argument("--steps", type=int, default=5, help="timed training steps per plan")
    b.add_argument("--op-time", type=float, default=0.01, help="seconds of repeats per op timing")
    b.add_argument("--no-ops", action="store_true", help="skip the per-op measurements")
    b.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="spawn gloo ranks here (default: the mesh size, unless under torchrun)",
    )
    b.add_argument(
        "--plots",
        default=None,
        help="PNG path prefix (PREFIX_ops.png, PREFIX_steps.png; default "
        "bench_cost); needs matplotlib, checked before measuring (without it and without "
        "--plots the plots are skipped)",
    )
    b.add_argument("--markdown", action="store_true", help="print Markdown tables")
    b.add_argument("--json", default=None, help="write every figure to this JSON file")
    b.add_argument(
        "--html",
        type=parse_report_path,
        default=None,
        metavar="PATH",
        help="write predicted vs measured and the plans side by side as an HTML report here",
    )
    b.set_defaults(func=commands["bench-cost"])
