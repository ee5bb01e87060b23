"""Activation checkpointing: autopar's joint ILP against fixed policies and Rotor's DP.

    python benchmarks/checkpointing.py                  # both parts, PNGs in benchmarks/out/
    python benchmarks/checkpointing.py --part chains    # ILP vs Rotor on synthetic chains only
    python benchmarks/checkpointing.py --part sweep --layers 4 --points 5

Part 1 (``sweep``): a small GPT on a 2x2 mesh (dp x tp, h100 presets), ZeRO stage 0, for budgets
from ``--low`` (default 0.5) of the budget-free plan's peak up to that peak: predicted step time and
recompute seconds of autopar's plan (``checkpoint='auto'``: sharding and segments chosen
together) vs recomputing every layer (``'all'``) vs Chen et al.'s sqrt(n) (groups of
ceil(sqrt(n)) consecutive layers recomputed as one segment, sharding still chosen by the ILP)
vs no checkpointing (where it fits). The measured column (gloo) is engineer B's
``benchmarks/checkpointing_measure.py`` (``measure_plans``); ``sweep_rows`` returns each row's
``solved`` plan for it.

Part 2 (``chains``): Rotor (Beaumont et al., "Optimal checkpointing for heterogeneous chains",
2019) solves a chain of stages by a dynamic programme over persistent-memory schedules (a stage
is run forward saving everything, or without saving, its output kept as a checkpoint, and
re-run later; schedules nest). autopar's ILP decides one level (a stage is recomputed once, in
backward, or not) under a memory model that counts every saved activation plus one recomputed
stage alive again. At equal budget the table reports both recompute costs; the ILP is never
better (Rotor searches a superset, with a finer memory model); the ratio is the price of the
one-level model.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
from functools import cache
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import solver  # noqa: E402
from solver.problem import Segment  # noqa: E402

OUT = ROOT / "benchmarks" / "out"


# ------------------------------------------------------------------------------------ chains


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Chain:
    """Stages 0..L-1: forward and backward seconds, input bytes x[i] (x[L]: the output) and
    all bytes a stage saves when run forward keeping everything, xbar[i] >= x[i+1]."""

    name: str
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    x: tuple[float, ...]
    xbar: tuple[float, ...]


def rotor_cost(chain: Chain, budget: float, slots: int = 240) -> float:
    """Rotor's optimal forward+backward seconds within ``budget`` bytes (math.inf if none).

    C(s, t, m): the least time to run stages s..t forward and backward with x[s] stored and m
    memory units free beside it (memory in units of budget / slots, sizes rounded up, so the
    answer is feasible for the real budget, at the price of a little recompute where the
    budget is exactly a peak):

        C(s, s, m) = f_s + b_s                                   if xbar_s <= m
        C(s, t, m) = min( f_s + C(s+1, t, m - xbar_s) + b_s       (keep all of stage s)
                          min_{s < j <= t}  sum_{k=s}^{j-1} f_k   (run s..j-1 keeping only
                            + C(j, t, m - x_j) + C(s, j-1, m) )    x_j, redo them later)
    """
    unit = budget / slots
    size = [math.ceil(v / unit - 1e-9) for v in chain.x]
    full = [math.ceil(v / unit - 1e-9) for v in chain.xbar]
    fwd, bwd = chain.fwd, chain.bwd

    @cache
    def best(s: int, t: int, m: int) -> float:
        if m < 0:
            return math.inf
        if s == t:
            return fwd[s] + bwd[s] if full[s] <= m else math.inf
        out = math.inf
        if full[s] <= m:
            out = fwd[s] + best(s + 1, t, m - full[s]) + bwd[s]
        ahead = 0.0
        for j in range(s + 1, t + 1):
            ahead += fwd[j - 1]
            if size[j] <= m:
                out = min(out, ahead + best(j, t, m - size[j]) + best(s, j - 1, m))
        return out

    free = slots - size[0]
    result = best(0, len(fwd) - 1, free)
    best.cache_clear()
    return result


def chain_problem(chain: Chain, budget: float | None) -> solver.Problem:
    """The chain in autopar's ILP: one node per stage (saving xbar_i), one segment per stage
    (recomputing frees xbar_i - x_{i+1}: its output stays as the next stage's checkpoint)."""
    num = len(chain.fwd)
    nodes = tuple(
        solver.Node(
            name=f"stage{i}", cost_s=(chain.fwd[i] + chain.bwd[i],), memory_bytes=(chain.xbar[i],)
        )
        for i in range(num)
    )
    segments = tuple(
        Segment(
            name=f"stage{i}",
            nodes=(i,),
            freed_bytes=((chain.xbar[i] - chain.x[i + 1],),),
            recompute_s=((chain.fwd[i],),),
        )
        for i in range(num)
    )
    return solver.Problem(
        nodes=nodes, memory_budget_bytes=budget, memory_offset_bytes=chain.x[0], segments=segments
    )


def ilp_cost(chain: Chain, budget: float) -> float:
    try:
        return solver.solve(chain_problem(chain, budget)).objective_s
    except solver.InfeasibleBudgetError:
        return math.inf


def chains(seed: int = 0) -> list[Chain]:
    rng = random.Random(seed)
    out = [
        Chain(
            name="homogeneous x12",
            fwd=(1.0,) * 12,
            bwd=(2.0,) * 12,
            x=(1.0,) * 13,
            xbar=(5.0,) * 12,
        )
    ]
    for k in range(2):
        num = 10
        fwd = tuple(rng.uniform(0.5, 2.0) for _ in range(num))
        x = tuple(rng.uniform(0.5, 2.0) for _ in range(num + 1))
        out.append(
            Chain(
                name=f"random x{num} #{k}",
                fwd=fwd,
                bwd=tuple(2 * f for f in fwd),
                x=x,
                xbar=tuple(x[i + 1] + rng.uniform(1.0, 6.0) for i in range(num)),
            )
        )
    # Transformer-like: attention and MLP stages alternate.
    out.append(
        Chain(
            name="attn/mlp x12",
            fwd=tuple(1.0 if i % 2 == 0 else 1.6 for i in range(12)),
            bwd=tuple(2.0 if i % 2 == 0 else 3.2 for i in range(12)),
            x=(1.0,) * 13,
            xbar=tuple(6.0 if i % 2 == 0 else 4.0 for i in range(12)),
        )
    )
    return out


def chain_rows(points: int = 5) -> list[dict]:
    rows = []
    for chain in chains():
        no_recompute = math.fsum(chain.fwd) + math.fsum(chain.bwd)
        top = chain.x[0] + math.fsum(chain.xbar)
        try:
            solver.solve(chain_problem(chain, 0.0))
            raise AssertionError("a zero budget fitted")
        except solver.InfeasibleBudgetError as e:
            bottom = e.min_budget_bytes
        for k in range(points):
            budget = bottom + (top - bottom) * k / (points - 1)
            ilp = ilp_cost(chain, budget) - no_recompute
            rotor = rotor_cost(chain, budget) - no_recompute
            rows.append(
                {
                    "chain": chain.name,
                    "budget": budget,
                    "budget_frac": budget / top,
                    "ilp_s": ilp,
                    "rotor_s": rotor,
                }
            )
    return rows


# ------------------------------------------------------------------------------------ sweep


def gpt(layers: int):
    import torch

    from autopar.models import GPT, GPTConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=64)
    tokens = torch.randint(0, 256, (8, 64))
    return GPT(config), (tokens, tokens.roll(-1, dims=1)), {}


def sweep_rows(
    layers: int, points: int, *, low: float = 0.5, time_limit_s: float = 60.0
) -> list[dict]:
    """Predicted step time and recompute seconds per policy and budget (module docstring)."""
    from autopar.capture.export import capture
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions
    from autopar.planner.checkpointing import block_group_candidates, candidate_segments
    from autopar.planner.configurations import tie_levels
    from autopar.planner.driver import Driver
    from autopar.planner.problem import ZeroConfig, build_space

    model, args, kwargs = gpt(layers)
    captured = capture(model, args, kwargs)
    mesh = Mesh.spec((2, 2), ("dp", "tp"))
    # A time limit keeps the minimum-peak ILPs of infeasible budgets short (the best found
    # is then reported, not proven).
    auto = PlanOptions(checkpoint="auto", zero_stage=0, time_limit_s=time_limit_s)
    forced = PlanOptions(checkpoint="all", zero_stage=0, time_limit_s=time_limit_s)
    space = build_space(captured, mesh, auto)
    tied = tie_levels(space)
    group = math.ceil(math.sqrt(layers))
    policies = {
        "autopar": (auto, candidate_segments(space, "auto")),
        "every layer": (forced, candidate_segments(space, "all")),
        f"sqrt(n): {group} layers/segment": (forced, block_group_candidates(space, group)),
        "none": (auto, ()),
    }

    def run(name: str, budget: float | None):
        options, candidates = policies[name]
        try:
            driver = Driver(space, options=options, tied=tied, candidates=candidates)
            return driver.configurations.solve(ZeroConfig(), name=name, budget=budget)
        except (solver.InfeasibleBudgetError, solver.SolverTimeoutError):
            return None

    free = run("none", None)
    top = free.evaluation.peak_memory_bytes
    rows = []
    for k in range(points):
        budget = top * (low + (1.0 - low) * k / (points - 1))
        for name in policies:
            print(f"  budget {budget / 2**20:.3f} MiB: {name}", file=sys.stderr, flush=True)
            solved = run(name, math.ceil(budget))
            fits = solved is not None
            rows.append(
                {
                    "budget": budget,
                    "policy": name,
                    "fits": fits,
                    "step_s": solved.evaluation.step_s if fits else None,
                    "recompute_s": solved.evaluation.recompute_s if fits else None,
                    "peak_bytes": solved.evaluation.peak_memory_bytes if fits else None,
                    "segments": len(solved.segments) if fits else None,
                    "status": solved.solution.status if fits else "-",
                    "solved": solved if fits else None,
                }
            )
    return rows


# ------------------------------------------------------------------------------------ output


def print_tables(chain: list[dict], sweep: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    from autopar.options import format_bytes, format_seconds

    console = Console(width=160)
    if sweep:
        table = Table(title="small GPT on 2x2 (dp x tp), ZeRO 0: predicted step time per budget")
        for col in (
            "budget",
            "policy",
            "step",
            "recompute",
            "vs budget-free",
            "peak",
            "segments",
            "solver",
        ):
            table.add_column(col, justify="left" if col in ("policy",) else "right")
        base = next(
            r["step_s"]
            for r in sweep
            if r["policy"] == "none"
            and r["fits"]
            and r["budget"] == max(x["budget"] for x in sweep)
        )
        for r in sweep:
            table.add_row(
                format_bytes(r["budget"]),
                r["policy"],
                format_seconds(r["step_s"]) if r["fits"] else "does not fit",
                format_seconds(r["recompute_s"]) if r["fits"] else "-",
                f"{r['step_s'] / base - 1:+.1%}" if r["fits"] else "-",
                format_bytes(r["peak_bytes"]) if r["fits"] else "-",
                str(r["segments"]) if r["fits"] else "-",
                r["status"],
            )
        console.print(table)
    if chain:
        table = Table(
            title="recompute seconds at equal budget: autopar ILP (one level) vs Rotor DP"
        )
        for col in ("chain", "budget", "of no-recompute peak", "ILP", "Rotor", "ILP / Rotor"):
            table.add_column(col, justify="left" if col == "chain" else "right")
        for r in chain:
            ratio = "-"  # also where either is 0 (Rotor's rounding may then cost a little)
            if (
                math.isfinite(r["ilp_s"])
                and math.isfinite(r["rotor_s"])
                and r["rotor_s"] > 0 < r["ilp_s"]
            ):
                ratio = f"{r['ilp_s'] / r['rotor_s']:.2f}"
            table.add_row(
                r["chain"],
                f"{r['budget']:.2f}",
                f"{r['budget_frac']:.0%}",
                "infeasible" if not math.isfinite(r["ilp_s"]) else f"{r['ilp_s']:.2f}",
                "infeasible" if not math.isfinite(r["rotor_s"]) else f"{r['rotor_s']:.2f}",
                ratio,
            )
        console.print(table)


def plot(chain: list[dict], sweep: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if sweep:
        ax = axes[0]
        for policy in dict.fromkeys(r["policy"] for r in sweep):
            pts = [r for r in sweep if r["policy"] == policy and r["fits"]]
            ax.plot(
                [r["budget"] / 2**20 for r in pts],
                [r["step_s"] * 1e3 for r in pts],
                marker="o",
                label=policy,
            )
        ax.set_xlabel("memory budget per device (MiB)")
        ax.set_ylabel("predicted step (ms)")
        ax.set_title("small GPT, 2x2 mesh: step time vs budget", fontsize=9)
        ax.legend(fontsize=7)
    if chain:
        ax = axes[1]
        for name in dict.fromkeys(r["chain"] for r in chain):
            pts = [r for r in chain if r["chain"] == name and math.isfinite(r["ilp_s"])]
            line = ax.plot(
                [r["budget_frac"] for r in pts],
                [r["ilp_s"] for r in pts],
                marker="o",
                label=f"{name} ILP",
            )
            rot = [r for r in chain if r["chain"] == name and math.isfinite(r["rotor_s"])]
            ax.plot(
                [r["budget_frac"] for r in rot],
                [r["rotor_s"] for r in rot],
                linestyle="--",
                color=line[0].get_color(),
                label=f"{name} Rotor",
            )
        ax.set_xlabel("budget / no-recompute peak")
        ax.set_ylabel("recompute seconds")
        ax.set_title("ILP (one level) vs Rotor DP", fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("all", "sweep", "chains"), default="all")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--points", type=int, default=5)
    parser.add_argument(
        "--low", type=float, default=0.5, help="lowest budget, as a fraction of the free peak"
    )
    parser.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan")
    parser.add_argument("--plot", default=str(OUT / "checkpointing.png"))
    args = parser.parse_args()
    from autopar.tools.report import plotting_unavailable

    missing = plotting_unavailable()  # this benchmark writes PNGs: say so before measuring
    if missing is not None:
        parser.error(missing)
    chain = chain_rows(args.points) if args.part in ("all", "chains") else []
    sweep = (
        sweep_rows(args.layers, args.points, low=args.low, time_limit_s=args.time_limit)
        if args.part in ("all", "sweep")
        else []
    )
    print_tables(chain, sweep)
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot(chain, sweep, Path(args.plot))
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
