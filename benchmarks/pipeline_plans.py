"""Plans at scale with pipeline stages (issue 15): the auto plan with stages vs the best plan
without stages vs Megatron-LM's 3-D recipe, predicted on the H100 preset, and the planning time.

    python benchmarks/pipeline_plans.py                       # the three cases below
    python benchmarks/pipeline_plans.py --cases llama3-8b     # one of them
    python benchmarks/pipeline_plans.py --search-only         # the search, not the final plan

Cases (bf16 with fp32 master weights, AdamW, budget = 90% of 80 GiB):

- llama3-70b on 1,024 devices (128 nodes of 8), global batch 256 x seq 8192;
- llama3-8b on 8 devices (one node), global batch 32 x seq 8192;
- gpt2-xl on 64 devices (8 nodes of 8), global batch 512 x seq 1024.

Each row is the mesh search of ``autopar plan MODEL --devices N --per-node 8`` (probes on the
preset's 2-block variant, as the CLI does): predicted step, peak memory per device and bubble of
the chosen plan, of the best plan without stages and of ``megatron-3d``, and the wall and CPU
seconds of capture + search (wall is inflated on a shared machine; CPU is not). A PNG of the
predicted steps is written beside the table.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from autopar.api import plan_stages  # noqa: E402
from autopar.capture.export import capture  # noqa: E402
from autopar.options import PlanOptions  # noqa: E402
from autopar.plan.pipelined import search_json  # noqa: E402
from autopar.plan.stage_search import StageOptions, search_stages  # noqa: E402
from autopar.presets import build_preset  # noqa: E402

CASES = {
    "llama3-70b": dict(devices=1024, batch=256, seq=8192),
    "llama3-8b": dict(devices=8, batch=32, seq=8192),
    "gpt2-xl": dict(devices=64, batch=512, seq=1024),
}


def run_case(
    name: str, devices: int, batch: int, seq: int, per_node: int, search_only: bool = False
) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    model, args, kwargs = build_preset(name, batch=batch, seq=seq)
    captured = capture(model, args, kwargs)

    def probe(b: int, which: str = f"{name}-2l"):
        m, a, k = build_preset(which, batch=b, seq=seq)
        return capture(m, a, k)

    stage = StageOptions(devices=devices, per_node=per_node)
    options = PlanOptions(mixed_precision="bf16")
    if search_only:
        result, _, _ = search_stages(
            captured, probe, model_name=name, mesh=None, stage=stage, options=options
        )
        search = search_json(result)
    else:
        plan = plan_stages(
            captured,
            probe,
            mesh=None,
            stage=stage,
            options=options,
            model_name=name,
            capture_microbatch=lambda b: probe(b, name),
        )
        search = plan.data["stage_search"]
    return {
        "name": name,
        "devices": devices,
        "shape": f"{batch}x{seq}",
        "best": search["candidates"][0],
        "no_stages": search.get("no_stages"),
        "megatron": search.get("megatron_3d"),
        "probes": search["probes"],
        "kept": len(search["candidates"]),
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
    }


def _cell(row: dict | None) -> str:
    if row is None:
        return "does not fit"
    mesh = "x".join(map(str, row["mesh"]))
    stages = row["stages"] * row.get("virtual_stages", 1)
    return (
        f"{row['step_s']:.2f} s, {row['peak_memory_bytes'] / 2**30:.1f} GiB, bubble "
        f"{row['bubble_fraction']:.1%} ({mesh}, {stages} st, m={row['microbatches']}, "
        f"{row['schedule']})"
    )


def table(results: list[dict]) -> str:
    lines = [
        "| model | devices | batch x seq | auto (with stages) | best without stages | megatron-3d "
        "| auto / no stages | auto / megatron-3d | ILPs | plan wall s | plan CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        best = r["best"]["step_s"]
        ratio = [f"{best / o['step_s']:.2f}" if o else "-" for o in (r["no_stages"], r["megatron"])]
        lines.append(
            f"| {r['name']} | {r['devices']} | {r['shape']} | {_cell(r['best'])} | "
            f"{_cell(r['no_stages'])} | {_cell(r['megatron'])} | {ratio[0]} | {ratio[1]} | "
            f"{r['probes']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results, strict=True):
        rows = [("auto", r["best"]), ("no stages", r["no_stages"]), ("megatron-3d", r["megatron"])]
        rows = [(label, row) for label, row in rows if row is not None]
        ax.bar(
            [label for label, _ in rows],
            [row["step_s"] for _, row in rows],
            color=["#4e79a7", "#bab0ac", "#f28e2b"][: len(rows)],
        )
        ax.set_title(f"{r['name']} on {r['devices']}")
        ax.set_ylabel("predicted step (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--plot", default="pipeline_plans.png")
    parser.add_argument(
        "--search-only",
        action="store_true",
        help="stop after the stage search (when no stages win, the plan itself is the ordinary "
        "planner's on the chosen mesh, whose time benchmarks/plan_time.py reports)",
    )
    args = parser.parse_args()
    results = []
    for name in args.cases:
        results.append(
            run_case(name, per_node=args.per_node, search_only=args.search_only, **CASES[name])
        )
        print(table(results[-1:]), flush=True)
    print()
    print(table(results))
    plot(results, args.plot)
    print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
