"""The cost-model benchmark's figures and tables: :func:`summarize` turns the rank-0 results of
:func:`autopar.tools.bench_cost.run_bench` into MAPE per op family, step-time MAPE, Spearman's
rank correlation of predicted vs measured plan ordering and the memory error;
:func:`report_text` prints them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from cost_models.calibrate import mape, spearman

__all__ = ["report_text", "summarize"]


def summarize(result: Mapping[str, Any]) -> dict[str, Any]:
    """MAPE per op family (each node counted, repeated layers included), step-time MAPE,
    Spearman's rho of predicted vs measured step times, memory MAPE, over the executed plans."""
    families: dict[str, dict[str, float]] = {}
    for op in result["ops"]:
        if op["measured_s"] <= 0 or not math.isfinite(op["measured_s"]):
            continue
        f = families.setdefault(op["family"], {"count": 0, "ape_sum": 0.0, "predicted_s": 0.0, "measured_s": 0.0})
        f["count"] += op["count"]
        f["ape_sum"] += op["count"] * abs(op["predicted_s"] - op["measured_s"]) / op["measured_s"]
        f["predicted_s"] += op["count"] * op["predicted_s"]
        f["measured_s"] += op["count"] * op["measured_s"]
    for f in families.values():
        f["mape"] = 100.0 * f.pop("ape_sum") / f["count"]
    ran = {n: p for n, p in result["plans"].items() if "skipped" not in p}
    pred = [p["predicted_step_s"] for p in ran.values()]
    meas = [p["step_s"] for p in ran.values()]
    mem = [(p["predicted_peak_memory_bytes"], p["peak_memory_bytes"]) for p in ran.values() if p["peak_memory_bytes"]]
    all_ops = [op for op in result["ops"] if op["measured_s"] > 0]
    summary = {
        "families": families,
        "op_mape": mape([o["predicted_s"] for o in all_ops], [o["measured_s"] for o in all_ops]) if all_ops else math.nan,
        "step_mape": mape(pred, meas) if ran else math.nan,
        "spearman": spearman(pred, meas) if len(ran) >= 2 else math.nan,
        "memory_mape": mape([m[0] for m in mem], [m[1] for m in mem]) if mem else math.nan,
        "num_plans": len(ran),
        "skipped_plans": {n: p["skipped"] for n, p in result["plans"].items() if "skipped" in p},
    }
    # Speed drift: the calibrated peak vs the matmul rate measured during this run (a shared
    # machine's load changes between calibration and benchmark); a uniform factor leaves the
    # ranking alone but scales every step time.
    peak = result.get("calibrated_flops")
    probe = result.get("matmul_flops_during_run")
    if peak and probe and ran:
        drift = peak / probe
        summary["speed_drift"] = drift
        summary["step_mape_drift_corrected"] = mape([p * drift for p in pred], meas)
    if ran:
        best = min(ran, key=lambda n: ran[n]["step_s"])
        summary["fastest_measured"] = best
        summary["fastest_predicted"] = min(ran, key=lambda n: ran[n]["predicted_step_s"])
    return summary


def report_text(result: Mapping[str, Any], summary: Mapping[str, Any], *, markdown: bool = False, title: str = "") -> str:
    """The per-family and per-plan tables and the headline figures."""
    from autopar.options import format_bytes, format_seconds
    from autopar.tools.report import table

    parts = []
    if summary["families"]:
        rows = [
            [fam, str(int(f["count"])), format_seconds(f["predicted_s"]), format_seconds(f["measured_s"]), f"{f['mape']:.0f}%"]
            for fam, f in sorted(summary["families"].items(), key=lambda kv: -kv[1]["measured_s"])
        ]
        parts.append(table(["op family", "ops", "predicted (sum)", "measured (sum)", "MAPE"], rows,
                           markdown=markdown, title=f"{title}: per op, forward + backward"))
    rows = []
    for name, p in result["plans"].items():
        if "skipped" in p:
            rows.append([name, p["mesh"], format_seconds(p["predicted_step_s"]), "skipped", "-",
                         format_bytes(p["predicted_peak_memory_bytes"]), "-", p["skipped"][:60]])
            continue
        err = 100.0 * (p["predicted_step_s"] - p["step_s"]) / p["step_s"]
        measured_mem = format_bytes(p["peak_memory_bytes"]) if p["peak_memory_bytes"] else "n/a"
        rows.append([name, p["mesh"], format_seconds(p["predicted_step_s"]), format_seconds(p["step_s"]),
                     f"{err:+.0f}%", format_bytes(p["predicted_peak_memory_bytes"]), measured_mem, ""])
    parts.append(table(["plan", "mesh", "predicted step", "measured step", "error", "predicted peak",
                        "measured peak", "note"], rows, markdown=markdown, title=f"{title}: per plan"))
    def figure(value: float, form: str) -> str:  # nan: nothing measured (e.g. --no-ops)
        return format(value, form) if math.isfinite(value) else "n/a"

    op_mape = f"op MAPE {figure(summary['op_mape'], '.1f')}%, " if result["ops"] else "ops not timed, "
    lines = [
        f"{op_mape}step MAPE {figure(summary['step_mape'], '.1f')}%, "
        f"Spearman {figure(summary['spearman'], '.3f')} over {summary['num_plans']} plans, "
        f"memory MAPE {figure(summary['memory_mape'], '.1f')}%".replace("n/a%", "n/a"),
    ]
    if "speed_drift" in summary:
        lines.append(
            f"machine speed vs calibration (matmul probe): calibrated peak / rate now = "
            f"{summary['speed_drift']:.2f}; "
            f"step MAPE with predictions scaled by that: {summary['step_mape_drift_corrected']:.1f}%"
        )
    if "fastest_measured" in summary:
        lines.append(f"fastest measured: {summary['fastest_measured']}; fastest predicted: {summary['fastest_predicted']}")
    if result.get("skipped_ops"):
        lines.append(f"{len(result['skipped_ops'])} op(s) not timed alone (e.g. {result['skipped_ops'][0][0]}: {result['skipped_ops'][0][1]})")
    parts.append("\n".join(lines))
    return "\n\n".join(parts)
