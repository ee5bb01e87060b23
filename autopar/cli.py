"""Command line: ``autopar plan`` (offline planning) and ``autopar show`` (inspect a plan)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

# Hugging Face models are built from configs only: never reach for the hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _add_plan_options(parser: argparse.ArgumentParser) -> None:
    from autopar.options import CHECKPOINT_MODES, RECIPES, SOLVERS

    parser.add_argument("model", help="preset (mlp, gpt2-small, gpt2-xl, llama3-8b, llama3-70b, "
                        "NAME-Nl), hf:<model_type>[?key=value&...], or package.module:factory")
    parser.add_argument("--mesh", required=True, help="mesh shape: 8x8, 4x4x4, 8 or dp=8,tp=8")
    parser.add_argument("--device", default="h100", help="device preset (cpu, a100, a100-40gb, h100, h100-pcie, h200)")
    parser.add_argument("--links", default=None, help="per-axis link presets, comma separated (e.g. infiniband,nvlink)")
    parser.add_argument("--profile", default=None, help="JSON device/link profile (overrides presets)")
    parser.add_argument("--batch", type=int, default=8, help="GLOBAL batch size (default 8)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--budget", default=None, help="memory budget per device, e.g. 80GiB (default: capacity - 10%%)")
    parser.add_argument("--recipe", default="auto", choices=RECIPES)
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--mixed-precision", default=None, choices=["bf16", "fp16"])
    parser.add_argument("--zero", type=int, default=None, choices=[0, 1, 2, 3], help="force a ZeRO stage")
    parser.add_argument("--checkpoint", default="auto", choices=CHECKPOINT_MODES)
    parser.add_argument("--time-limit", type=float, default=None, help="solver time limit in seconds")
    parser.add_argument("--gap", type=float, default=0.0, help="relative optimality gap")
    parser.add_argument("--solver", default="highs", choices=SOLVERS)


def _build_mesh(args: argparse.Namespace):
    from autopar.mesh import Mesh

    links = args.links.split(",") if args.links else None
    return Mesh.parse(args.mesh, device=args.device, links=links, profile=args.profile)


def cmd_plan(args: argparse.Namespace) -> int:
    from autopar.api import plan_captured
    from autopar.capture import capture
    from autopar.options import PlanOptions
    from autopar.presets import build_preset

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
    )
    start = time.perf_counter()
    model, example_args, example_kwargs = build_preset(args.model, batch=args.batch, seq=args.seq)
    captured = capture(model, example_args, example_kwargs)
    capture_s = time.perf_counter() - start
    plan = plan_captured(captured, mesh, options, model_name=args.model, capture_s=capture_s)
    print(plan.summary())
    t = plan.data["timings"]
    print(
        f"planned in {sum(t.values()):.2f} s (capture {t['capture_s']:.2f} s, strategies "
        f"{t['strategies_s']:.2f} s, solve {t['solve_s']:.2f} s)"
    )
    if args.out:
        plan.save(args.out)
        print(f"plan written to {args.out}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from autopar.plan import Plan

    plan = Plan.load(args.plan)
    if args.explain:
        for name in args.explain:
            print(plan.explain(name))
    else:
        print(plan.summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="automatic parallelization for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="plan a model on a mesh offline and print the summary")
    _add_plan_options(p)
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.set_defaults(func=cmd_plan)
    s = sub.add_parser("show", help="print a saved plan's summary, or explain nodes")
    s.add_argument("plan", help="plan JSON file")
    s.add_argument("--explain", nargs="*", default=None, help="node names or parameter FQNs to explain")
    s.set_defaults(func=cmd_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from autopar.errors import AutoparError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (AutoparError, ValueError, KeyError, FileNotFoundError) as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
