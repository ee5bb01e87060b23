"""HTML reports of ``autopar compare`` and ``autopar bench-cost``: the plans side by side (step
time and memory figures, bytes per mesh axis, each plan's layouts) and, for bench-cost, the
predicted vs measured step times, in the page format of ``autopar.plan.report_html``; the
first plan (the auto plan) follows in full.

Data attributes, beside those of the plan report: ``#comparison tr[data-plan]`` with
``data-step-s``, ``data-peak-bytes``, ``data-fits``; ``#measured tr[data-plan]`` with
``data-predicted-s`` and ``data-measured-s`` (absent when the plan was skipped).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from autopar.options import format_bytes
from autopar.plan.document import Plan
from autopar.plan.html_figures import bytes_unit, in_unit, num, paired_bars, seconds_unit, table
from autopar.plan.html_layouts import layout_grids
from autopar.plan.report_html import page, plan_sections, step_and_memory
from autopar.plan.summary import zero_label
from autopar.tools.report import compare_rows


def comparison_section(plans: Mapping[str, Plan]) -> str:
    """The plans side by side: figures, a table with the bytes each device sends per axis, and
    each plan's layouts (collapsed)."""
    rows = compare_rows(plans)
    best = min((r["step_s"] for r in rows if r["fits"]), default=math.nan)
    axes = list(rows[0]["comm_bytes"]) if rows else []
    s_unit = seconds_unit([r["step_s"] for r in rows])
    b_unit = bytes_unit([r["peak_memory_bytes"] for r in rows])
    v_unit = bytes_unit([v for r in rows for v in r["comm_bytes"].values()])
    body = []
    for r in rows:
        cells = [r["plan"], in_unit(r["step_s"], s_unit), f"{r['step_s'] / best:.2f}x" if best > 0 else "-",
                 in_unit(r["compute_s"], s_unit), in_unit(r["comm_s"], s_unit),
                 *(in_unit(r["comm_bytes"][a], v_unit) for a in axes), in_unit(r["peak_memory_bytes"], b_unit),
                 zero_label(r["zero"]), "yes" if r["fits"] else "NO"]  # fmt: skip
        body.append((cells, {"data-plan": r["plan"], "data-step-s": num(r["step_s"]),
                             "data-peak-bytes": num(r["peak_memory_bytes"]), "data-fits": str(r["fits"]).lower()}))  # fmt: skip
    header = ["plan", "step", "vs best", "compute", "communication", *(f"sent on {a}" for a in axes),
              "peak memory", "ZeRO", "fits"]  # fmt: skip
    first = next(iter(plans.values())).data
    named = [
        (name, {**p.data["predicted"], "zero": p.data["zero"]}, r["fits"])
        for (name, p), r in zip(plans.items(), rows)
    ]
    details = "".join(
        f"<details><summary>layouts of {escape(name)}</summary>{layout_grids(p.data, element_id=f'layouts-{name}')}</details>"
        for name, p in plans.items()
    )
    return "\n".join([
        '<section id="comparison-section"><h2>The plans side by side</h2>',
        '<p class="note">Predicted by one cost model; "sent on AXIS" is what each device sends per step '
        "on that mesh axis (layout conversions, gradient sync, ZeRO gathers).</p>",
        table("comparison", header, body, numeric=lambda c: 0 < c < len(header) - 2),
        step_and_memory(named, first["memory_budget_bytes"], this=next(iter(plans)), prefix="compare-"),
        details,
        "</section>",
    ])  # fmt: skip


def measured_section(result: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    """bench-cost: predicted vs measured step time and peak memory per plan, and per op family."""
    ran = {n: p for n, p in result["plans"].items() if "skipped" not in p}
    s_unit = seconds_unit(
        [v for p in ran.values() for v in (p["predicted_step_s"], p["step_s"])] or [0.0]
    )
    rows = []
    for name, p in result["plans"].items():
        skipped = "skipped" in p
        error = (
            "-" if skipped else f"{100 * (p['predicted_step_s'] - p['step_s']) / p['step_s']:+.0f}%"
        )
        measured_peak = p.get("peak_memory_bytes") or 0
        cells = [name, p.get("mesh", ""), in_unit(p["predicted_step_s"], s_unit),
                 "skipped" if skipped else in_unit(p["step_s"], s_unit), error,
                 format_bytes(p["predicted_peak_memory_bytes"]), format_bytes(measured_peak) if measured_peak else "n/a",
                 p["skipped"] if skipped else ""]  # fmt: skip
        rows.append((cells, {"data-plan": name, "data-predicted-s": num(p["predicted_step_s"]),
                             "data-measured-s": None if skipped else num(p["step_s"])}))  # fmt: skip
    header = [
        "plan",
        "mesh",
        "predicted step",
        "measured step",
        "error",
        "predicted peak",
        "measured peak",
        "note",
    ]
    out = ['<section id="measured-section"><h2>Predicted vs measured</h2>']
    out.append(paired_bars(figure_id="measured-steps", caption="Step time per plan: predicted vs measured",
                           rows=[(n, p["predicted_step_s"], p["step_s"]) for n, p in ran.items()], unit=s_unit))  # fmt: skip
    out.append(table("measured", header, rows, numeric=lambda c: 2 <= c <= 6))

    def figure(value: float, form: str) -> str:
        return (
            format(value, form)
            if isinstance(value, (int, float)) and math.isfinite(value)
            else "n/a"
        )

    lines = [f"step MAPE {figure(summary['step_mape'], '.1f')}%, Spearman {figure(summary['spearman'], '.3f')} "
             f"over {summary['num_plans']} plans, memory MAPE {figure(summary['memory_mape'], '.1f')}%",
             "op MAPE " + (f"{figure(summary['op_mape'], '.1f')}%" if result.get("ops") else "n/a (ops not timed)")]  # fmt: skip
    if "fastest_measured" in summary:
        lines.append(
            f"fastest measured: {summary['fastest_measured']}; fastest predicted: {summary['fastest_predicted']}"
        )
    out.append(
        "".join(f'<p class="note">{escape(line).replace("n/a%", "n/a")}</p>' for line in lines)
    )
    families = summary.get("families") or {}
    if families:
        f_unit = seconds_unit([f["measured_s"] for f in families.values()])
        fam_rows = [([fam, str(int(f["count"])), in_unit(f["predicted_s"], f_unit), in_unit(f["measured_s"], f_unit),
                      f"{f['mape']:.0f}%"], {"data-family": fam})
                    for fam, f in sorted(families.items(), key=lambda kv: -kv[1]["measured_s"])]  # fmt: skip
        out.append("<h3>per op family, forward + backward</h3>")
        out.append(
            table(
                "op-families",
                ["op family", "ops", "predicted (sum)", "measured (sum)", "MAPE"],
                fam_rows,
            )
        )
    out.append("</section>")
    return "\n".join(out)


def render_comparison_html(
    plans: Mapping[str, Plan],
    *,
    title: str,
    bench: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
) -> str:
    """The comparison page: ``plans`` side by side (the first one in full below), and with
    ``bench=(result, summary)`` of bench-cost, its predicted vs measured figures."""
    if not plans:
        raise ValueError("no plans to report")
    first_name, first = next(iter(plans.items()))
    body = [f"<h1>{escape(title)}</h1>", comparison_section(plans)]
    if bench is not None:
        body.append(measured_section(*bench))
    body.append(f'<h2 class="part">The {escape(first_name)} plan in detail</h2>')
    body.append(plan_sections(first.data, side_by_side=False))
    return page(title, "\n".join(body))


def write_comparison_html(
    path: str,
    plans: Mapping[str, Plan],
    *,
    title: str,
    bench: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None,
) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_comparison_html(plans, title=title, bench=bench))


__all__: Sequence[str] = (
    "comparison_section",
    "measured_section",
    "render_comparison_html",
    "write_comparison_html",
)
