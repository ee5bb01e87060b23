"""Tables and plots for ``autopar compare`` and ``autopar bench-cost``.

``plans_for_recipes`` plans the auto plan and every recipe on ONE strategy space (built once, so
comparing five plans costs one space and five solves); ``comm_volume_by_axis`` counts the bytes a
plan moves per mesh axis; ``compare_table`` prints them side by side (rich or Markdown), and the
``plot_*`` functions write the bench-cost PNGs.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from autopar.options import PlanOptions, format_bytes, format_seconds
from autopar.placement import parse_placements
from autopar.plan.document import Plan
from autopar.resharding.steps import reshard_steps
from cost_models import collective_steps_and_wire_bytes

__all__ = [
    "comm_volume_by_axis",
    "compare_rows",
    "compare_table",
    "plans_for_recipes",
    "plot_op_scatter",
    "plot_step_bars",
]

_COLLECTIVES = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")


def plans_for_recipes(
    captured: Any,
    mesh: Any,
    options: PlanOptions,
    *,
    recipes: Sequence[str],
    model_name: str,
) -> dict[str, Plan]:
    """One Plan per name in ``recipes`` ("auto", baseline recipes, or "replicated": inputs and
    parameters Replicate, the no-parallelism reference), from one strategy space and one
    planner driver, so each plan is the one ``autopar plan --recipe NAME`` returns. A recipe
    that does not fit the memory budget even with recomputation is still planned (its ``fits``
    flag in ``baselines`` says so); a baseline recipe with no plan on this model and mesh at
    all is left out (a warning of the other plans says why).

    Raises:
        ValueError: an unknown recipe name.
        PlanningError: the auto plan fits no ZeRO configuration within the budget.
    """
    from autopar.api import document_plan
    from autopar.errors import NoLayoutError
    from autopar.planner.driver import REFERENCE_RECIPES, Driver
    from autopar.planner.space import build_space

    unknown = [r for r in recipes if r not in REFERENCE_RECIPES]
    if unknown:
        raise ValueError(f"unknown recipe(s) {unknown}; choose from {', '.join(REFERENCE_RECIPES)}")
    space = build_space(captured, mesh, options)
    driver = Driver(space)
    plans: dict[str, Plan] = {}
    for recipe in recipes:
        try:
            planned = driver.plan(recipe, strict=False)
        except NoLayoutError:
            if recipe == "auto":
                raise
            continue
        timings = {"capture_s": 0.0, "strategies_s": space.build_s, "solve_s": planned.solve_s}
        plans[recipe] = document_plan(driver, planned, model_name=model_name, timings=timings)
    return plans


def _needs_grad(nodes: Sequence[Mapping[str, Any]]) -> set[str]:
    """Nodes whose gradient is computed: float parameters and float ops downstream of one."""
    needs: set[str] = set()
    for entry in nodes:
        is_float = entry.get("dtype", "").startswith(("float", "bfloat", "complex"))
        if entry["kind"] == "param":
            if is_float:
                needs.add(entry["name"])
        elif entry["kind"] == "op" and is_float and any(a in needs for a in entry.get("args", [])):
            needs.add(entry["name"])
    return needs


def comm_volume_by_axis(plan: Plan) -> dict[str, float]:
    """Bytes each device sends per training step, per mesh axis name.

    Counts (wire bytes per device, as ``cost_models.collective_steps_and_wire_bytes`` defines):
    every layout conversion on an edge (forward and backward steps of
    ``autopar.resharding.steps.reshard_steps``), the all-reduce of every Partial gradient of a
    Replicate input that needs one (parameters: the data-parallel gradient sync), and under ZeRO
    stage 3 the extra all-gather of each parameter on its ZeRO axes. Stages 1-2 move the same
    bytes as the all-reduce they replace.
    """
    d = plan.data
    mesh = d["mesh"]
    names = list(mesh["axis_names"])
    mesh_shape = tuple(mesh["shape"])
    act_itemsize = 2 if d.get("options", {}).get("mixed_precision") else None
    nodes = d["nodes"]
    by_name = {e["name"]: e for e in nodes}
    needs = _needs_grad(nodes)
    volume = {name: 0.0 for name in names}

    def itemsize(entry: Mapping[str, Any]) -> int:
        dtype = entry.get("dtype", "float32")
        size = {
            "float64": 8,
            "int64": 8,
            "float16": 2,
            "bfloat16": 2,
            "bool": 1,
            "int8": 1,
            "uint8": 1,
        }.get(dtype, 4)
        if (
            act_itemsize is not None
            and entry["kind"] == "op"
            and dtype.startswith(("float", "bfloat"))
        ):
            return act_itemsize
        return size

    def add(kind: str, axis: int, nbytes: float) -> None:
        if kind in _COLLECTIVES and mesh_shape[axis] > 1 and nbytes > 0:
            volume[names[axis]] += collective_steps_and_wire_bytes(kind, nbytes, mesh_shape[axis])[
                1
            ]

    def local_bytes(shape: Sequence[int], placements: str, size: int) -> float:
        count = float(math.prod(shape))
        for axis, p in enumerate(parse_placements(placements)):
            if p.is_shard():
                count /= mesh_shape[axis]
        return count * size

    for entry in nodes:
        for j, arg in enumerate(entry.get("args", [])):
            producer = by_name.get(arg)
            if producer is None or entry["inputs"][j] is None:
                continue
            index = (
                entry.get("getitem_index", 0) if entry["op"] == "<built-in function getitem>" else 0
            )
            src = producer["outputs"][index]
            dst = entry["inputs"][j]
            shape = producer["shapes"][index]
            if src is None or shape is None:
                continue
            size = itemsize(producer)
            if src != dst:
                fwd, bwd = reshard_steps(
                    parse_placements(src), parse_placements(dst), shape, size, mesh_shape
                )
                for step in (*fwd, *bwd):
                    add(step.kind, step.axis, step.nbytes)
            grads = entry.get("input_grads", [])
            grad = grads[j] if j < len(grads) else None
            if grad is not None and arg in needs:
                for axis, p in enumerate(parse_placements(grad)):
                    if p.is_partial():
                        add("all_reduce", axis, local_bytes(shape, dst, size))
    zero = d.get("zero", {})
    if zero.get("stage") == 3:
        for entry in nodes:
            if entry["kind"] != "param" or "fqn" not in entry:
                continue
            info = d["params"].get(entry["fqn"], {})
            placement = info.get("placement", entry["outputs"][0])
            nbytes = local_bytes(
                entry["shapes"][0], placement, 2 if act_itemsize else itemsize(entry)
            )
            for axis_name in info.get("zero", {}).get("axes", []):
                add("all_gather", names.index(axis_name), nbytes)
    return volume


def compare_rows(plans: Mapping[str, Plan]) -> list[dict[str, Any]]:
    """One row per plan: predicted step time and its parts, bytes per axis, peak memory, fit."""
    rows = []
    for name, plan in plans.items():
        pred = plan.data["predicted"]
        parts = pred["breakdown"]
        comm = sum(v for k, v in parts.items() if k != "compute_s")
        fits = pred["peak_memory_bytes"] <= plan.data["memory_budget_bytes"]
        rows.append(
            {
                "plan": name,
                "step_s": pred["step_s"],
                "compute_s": parts["compute_s"],
                "comm_s": comm,
                "comm_bytes": comm_volume_by_axis(plan),
                "peak_memory_bytes": pred["peak_memory_bytes"],
                "zero": plan.data["zero"],
                "fits": fits,
            }
        )
    return rows


def compare_table(
    rows: Sequence[Mapping[str, Any]], *, markdown: bool = False, title: str = ""
) -> str:
    """The rows of :func:`compare_rows` as a table: rich text, or Markdown to paste."""
    axes = list(rows[0]["comm_bytes"]) if rows else []
    best = min((r["step_s"] for r in rows if r["fits"]), default=math.nan)
    header = ["plan", "step time", "vs best", "compute", "comm", *(f"bytes on {a}" for a in axes),
              "peak memory", "ZeRO", "fits"]  # fmt: skip
    body = []
    for r in rows:
        zero = r["zero"]
        body.append(
            [
                r["plan"],
                format_seconds(r["step_s"]),
                f"{r['step_s'] / best:.2f}x" if best == best and best > 0 else "-",
                format_seconds(r["compute_s"]),
                format_seconds(r["comm_s"]),
                *(format_bytes(r["comm_bytes"][a]) for a in axes),
                format_bytes(r["peak_memory_bytes"]),
                f"{zero['stage']} on {','.join(zero['axes'])}"
                if zero["stage"] and zero["axes"]
                else "-",
                "yes" if r["fits"] else "NO",
            ]
        )
    return _table(header, body, markdown=markdown, title=title)


def _table(
    header: Sequence[str], body: Sequence[Sequence[str]], *, markdown: bool, title: str = ""
) -> str:
    if markdown:
        lines = [f"**{title}**", ""] if title else []
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for row in body:
        table.add_row(*row)
    console = Console(width=200, record=True, file=open(os.devnull, "w"), color_system=None)
    console.print(table)
    return console.export_text().rstrip()


def table(
    header: Sequence[str], body: Sequence[Sequence[str]], *, markdown: bool = False, title: str = ""
) -> str:
    """A generic table (rich text or Markdown) for the bench-cost report."""
    return _table(header, body, markdown=markdown, title=title)


PLOT_INSTALL = "pip install 'autopar[plot]'"
"""How to get the optional plotting dependency (matplotlib)."""


def plotting_unavailable() -> str | None:
    """None when PNG plots can be written; else why not and how to fix it, in one line.

    Commands that plot call this before they measure (minutes or hours of work), not when they
    come to write the PNG.
    """
    try:
        import matplotlib  # noqa: F401 - only whether it imports
    except ImportError:
        return (
            f"matplotlib is not installed (optional, for PNG plots); install it with {PLOT_INSTALL}"
        )
    return None


def plot_prefix(requested: str | None, default: str, flag: str) -> str | None:
    """Where a command writes its PNG plots, decided before it measures: ``requested`` (the
    user's ``flag`` value) or ``default``; None (plots skipped, with a note on stderr) when
    matplotlib is missing and the user did not ask for plots.

    Raises:
        ValueError: the user asked for plots (``flag`` given) and matplotlib is missing.
    """
    missing = plotting_unavailable()
    if missing is None:
        return requested if requested is not None else default
    if requested is not None:
        raise ValueError(f"{flag} {requested}: {missing} (or leave out {flag} to skip the plots)")
    print(f"autopar: note: PNG plots skipped: {missing}", file=sys.stderr)
    return None


def plot_op_scatter(points: Sequence[Mapping[str, Any]], path: str, *, title: str = "") -> None:
    """Predicted vs measured seconds per op (log-log, one colour per family, y = x line).

    ``points``: dicts with ``family``, ``predicted_s`` and ``measured_s``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 5))
    families = sorted({p["family"] for p in points})
    for family in families:
        xs = [p["measured_s"] for p in points if p["family"] == family]
        ys = [p["predicted_s"] for p in points if p["family"] == family]
        ax.scatter(xs, ys, label=family, s=18, alpha=0.8)
    values = [v for p in points for v in (p["measured_s"], p["predicted_s"]) if v > 0]
    if values:
        lo, hi = min(values) / 1.5, max(values) * 1.5
        ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8, label="predicted = measured")
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured seconds (forward + backward)")
    ax.set_ylabel("predicted seconds")
    ax.set_title(title or "per-op cost model", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_step_bars(rows: Sequence[Mapping[str, Any]], path: str, *, title: str = "") -> None:
    """Predicted and measured step time per plan, side by side.

    ``rows``: dicts with ``plan``, ``predicted_s`` and ``measured_s``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows) + 2), 4))
    xs = range(len(rows))
    width = 0.38
    ax.bar(
        [x - width / 2 for x in xs],
        [r["predicted_s"] * 1e3 for r in rows],
        width,
        label="predicted",
    )
    ax.bar(
        [x + width / 2 for x in xs], [r["measured_s"] * 1e3 for r in rows], width, label="measured"
    )
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["plan"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("step time (ms, forward + backward)")
    ax.set_title(title or "step time per plan", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def sweep_table(points: Sequence[Any], *, title: str = "step time vs memory budget") -> str:
    """A budget sweep (autopar.planner.sweep.budget_sweep) as a table."""
    body = [
        [
            format_bytes(p.budget_bytes),
            format_seconds(p.step_s) if p.step_s is not None else "does not fit",
            format_bytes(p.peak_memory_bytes) if p.peak_memory_bytes is not None else "-",
            format_seconds(p.recompute_s),
            str(p.num_segments),
            "-" if p.zero_stage is None else str(p.zero_stage),
        ]
        for p in points
    ]
    header = ["budget", "step", "peak memory", "recompute", "segments", "ZeRO stage"]
    return table(header, body, title=title)


def plot_budget_sweep(points: Sequence[Any], path: str, *, title: str = "") -> None:
    """Predicted step time (and its recompute part) against the memory budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fits = [p for p in points if p.step_s is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [p.budget_bytes / 2**20 for p in fits]
    ax.plot(xs, [p.step_s * 1e3 for p in fits], marker="o", label="predicted step")
    ax.plot(xs, [p.recompute_s * 1e3 for p in fits], marker="x", label="of which recompute")
    ax.set_xlabel("memory budget per device (MiB)")
    ax.set_ylabel("ms per step")
    ax.set_title(title or "step time vs memory budget", fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
