"""The terminal rendering of :func:`autopar.plan.summary.summary_data`.

Plain ASCII text at a given width (prose wrapped, tables fitted), or with ``width=None`` plain
unwrapped lines (what a redirected stdout gets). Every column carries one unit, named in the
section title, so numbers compare down a column.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

_SECONDS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6))
_BYTES = (("TiB", 2.0**40), ("GiB", 2.0**30), ("MiB", 2.0**20), ("KiB", 2.0**10), ("B", 1.0))
_MEMORY_SHORT = {"optimizer": "optim", "activations": "acts", "inputs_buffers": "inputs"}


def unit_of(values: Sequence[float], units: Sequence[tuple[str, float]]) -> tuple[str, float]:
    """The largest unit in which the largest value is at least 1 (the smallest unit else)."""
    top = max((abs(v) for v in values), default=0.0)
    for name, scale in units:
        if top >= scale:
            return name, scale
    return units[-1]


def _decimals(values: Sequence[float], scale: float) -> int:
    """Decimals for a column: 3 below 10 units, 2 below 1000, else 1 (aligned down a column)."""
    top = max((abs(v) / scale for v in values), default=0.0)
    return 3 if top < 10 else 2 if top < 1000 else 1


def _num(value: float, scale: float, decimals: int | None = None) -> str:
    x = value / scale
    if x == 0:
        return "0"
    return f"{x:.{_decimals([value], scale) if decimals is None else decimals}f}"


def column(values: Sequence[float], scale: float) -> list[str]:
    """``values`` in one unit with the same decimals (a table column)."""
    decimals = _decimals(values, scale)
    return [_num(v, scale, decimals) for v in values]


def _count(n: float) -> str:
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f}"


def wrap(text: str, width: int | None, indent: str = "", hanging: str | None = None) -> list[str]:
    """``text`` wrapped to ``width`` (one line when None), the first line indented by ``indent``."""
    if width is None:
        return [indent + text]
    return textwrap.wrap(
        text,
        width=width,
        initial_indent=indent,
        subsequent_indent=indent if hanging is None else hanging,
        break_on_hyphens=False,
    ) or [indent]


def table(
    header: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None,
    left: int = 1,
    wrap_last: bool = False,
) -> list[str]:
    """Columns separated by two spaces; the first ``left`` columns left-aligned, the rest right;
    with ``wrap_last`` the last column is left-aligned and wrapped to fit ``width``."""
    cols = len(header)
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(cols)]
    last_width = widths[-1]
    if wrap_last and width is not None:
        used = sum(widths[:-1]) + 2 * (cols - 1)
        last_width = max(16, min(widths[-1], width - used))

    def cells(row: Sequence[str]) -> list[str]:
        lines = (
            textwrap.wrap(str(row[-1]), last_width)
            if wrap_last and width is not None
            else [str(row[-1])]
        )
        out = []
        for k, piece in enumerate(lines or [""]):
            parts = []
            for c in range(cols - 1):
                text = str(row[c]) if k == 0 else ""
                parts.append(text.ljust(widths[c]) if c < left else text.rjust(widths[c]))
            last = piece if wrap_last or cols - 1 < left else piece.rjust(widths[-1])
            parts.append(last)
            out.append("  ".join(parts).rstrip())
        return out

    lines = cells(header)
    lines.append(
        "  ".join("-" * (w if c < cols - 1 else min(w, last_width)) for c, w in enumerate(widths))
    )
    for row in rows:
        lines.extend(cells(row))
    return lines


def _headline(h: dict[str, Any], width: int | None) -> list[str]:
    sec, sec_scale = unit_of([h["step_s"]], _SECONDS)
    mem, mem_scale = unit_of([h["budget_bytes"]], _BYTES)
    step = (
        f"Step {_num(h['step_s'], sec_scale)} {sec} predicted: compute {_num(h['compute_s'], sec_scale)} {sec}, "
        f"communication {_num(h['comm_s'], sec_scale)} {sec}"
        + (f", recomputation {_num(h['recompute_s'], sec_scale)} {sec}" if h["recompute_s"] else "")
    )
    share = h["peak_memory_bytes"] / h["budget_bytes"] if h["budget_bytes"] else 0.0
    peak, peak_scale = unit_of([h["peak_memory_bytes"]], _BYTES)
    memory = (
        f"Peak memory {_num(h['peak_memory_bytes'], peak_scale, 2)} {peak} of "
        f"{_num(h['budget_bytes'], mem_scale, 2)} {mem} budget ({share:.0%})"
    )
    if h["mfu"] is not None:
        memory += f"; MFU {h['mfu']:.1%} at {h['compute_dtype']} peak"
    model = f"{h['model']}: {_count(h['num_params'])} parameters on {h['mesh']} ({h['device']}); ZeRO {h['zero']}"
    if not h["solver"].endswith("optimal, gap 0.00%"):
        model += f"; solver {h['solver']}"
    return [line for text in (step, memory, model) for line in wrap(text, width)]


def _recipes(rows: list[dict[str, Any]], width: int | None) -> list[str]:
    times = [r[k] for r in rows for k in ("step_s", "compute_s", "comm_s", "recompute_s")]
    sec, s = unit_of(times, _SECONDS)
    mem, m = unit_of([r["peak_memory_bytes"] for r in rows], _BYTES)
    recompute = any(r["recompute_s"] for r in rows)
    dt, dm = _decimals(times, s), _decimals([r["peak_memory_bytes"] for r in rows], m)
    header = [
        "plan",
        "step",
        "vs this",
        "compute",
        "comm",
        *(["recompute"] if recompute else []),
        "peak mem",
        "fits",
    ]
    body = [
        [
            r["plan"] + (" (this)" if r["this_plan"] else ""),
            _num(r["step_s"], s, dt),
            "-" if r["vs_this"] is None else f"{r['vs_this']:.2f}x",
            _num(r["compute_s"], s, dt),
            _num(r["comm_s"], s, dt),
            *([_num(r["recompute_s"], s, dt)] if recompute else []),
            _num(r["peak_memory_bytes"], m, dm),
            "yes" if r["fits"] else "NO",
        ]
        for r in rows
    ]
    title = f"Recipes under the same cost model (time in {sec}, peak memory in {mem} per device):"
    lines = [*wrap(title, width), *table(header, body, width=width)]
    recomputing = [
        f"{r['plan']} ({r['recomputed_segments']})" for r in rows if r.get("recomputed_segments")
    ]
    if recomputing:
        lines += wrap(
            "Recomputing to fit the budget (segments), each recipe with its own best checkpointing: "
            + ", ".join(recomputing),
            width,
        )
    return lines


def _blocks(blocks: list[dict[str, Any]], legend: list[str], width: int | None) -> list[str]:
    sec, s = unit_of([b["seconds"] for b in blocks], _SECONDS)
    mem, m = unit_of([b["memory_bytes"] for b in blocks], _BYTES)
    lines = wrap(
        f"Layouts per layer block, in model order (time in {sec}, memory in {mem} per device):",
        width,
    )
    for text in legend:
        lines += wrap(text, width, "  ", "    ")
    name_w = max(len("block"), *(len(b["name"]) for b in blocks))
    lines.append(f"{'block':<{name_w}}  {'time':>9}  {'memory':>9}")
    dt, dm = (
        _decimals([b["seconds"] for b in blocks], s),
        _decimals([b["memory_bytes"] for b in blocks], m),
    )
    for b in blocks:
        lines.append(
            f"{b['name']:<{name_w}}  {_num(b['seconds'], s, dt):>9}  {_num(b['memory_bytes'], m, dm):>9}"
        )
        if b["params"]:
            lines += wrap("  ".join(f"{n}={p}" for n, p in b["params"]), width, "  ", "    ")
        if b["activations"]:
            acts = ", ".join(f"{p} x{c}" for p, c in b["activations"])
            lines += wrap(f"activations: {acts}", width, "  ", "    ")
    return lines


def _details(x: dict[str, Any], width: int | None) -> list[str]:
    keys = [k for k in x["memory_keys"] if any(r["memory"].get(k) for r in x["per_stage"])]
    sec, s = unit_of([r["step_s"] for r in x["per_stage"]], _SECONDS)
    mem, m = unit_of([r["peak_memory_bytes"] for r in x["per_stage"]], _BYTES)
    lines = wrap(
        f"These layouts under each ZeRO stage (time in {sec}, memory in {mem} per device):", width
    )
    header = ["ZeRO stage", "step", *(_MEMORY_SHORT.get(k, k) for k in keys), "peak"]
    rows = x["per_stage"]
    columns = [
        column([r["step_s"] for r in rows], s),
        *(column([r["memory"].get(k, 0.0) for r in rows], m) for k in keys),
        column([r["peak_memory_bytes"] for r in rows], m),
    ]
    body = [
        [r["stage"] + (" (chosen)" if r["chosen"] else ""), *(c[k] for c in columns)]
        for k, r in enumerate(rows)
    ]
    lines += table(header, body, width=width)
    if x["considered"]:
        sec, s = unit_of([r["step_s"] for r in x["considered"]], _SECONDS)
        mem, m = unit_of([r["peak_memory_bytes"] for r in x["considered"]], _BYTES)
        lines.append("")
        lines += wrap(
            f"ZeRO configurations considered (time in {sec}, memory in {mem}; layouts: own = solved "
            "for it, chosen = this plan's priced under it):",
            width,
        )
        rows = x["considered"]
        steps = column([r["step_s"] for r in rows], s)
        peaks = column([r["peak_memory_bytes"] for r in rows], m)
        body = [
            [r["label"], r["layouts"], steps[k], peaks[k], r["verdict"]] for k, r in enumerate(rows)
        ]
        lines += table(
            ["configuration", "layouts", "step", "peak", "verdict"],
            body,
            width=width,
            wrap_last=True,
        )
    if x["zero_reason"]:
        lines += wrap(f"ZeRO choice: {x['zero_reason']}", width)
    segments = x["segments"]
    lines.append("")
    text = f"Checkpointing ({x['checkpoint_mode']}): {len(segments)} segment(s) recomputed"
    if segments:
        saved = sum(seg["saved_bytes"] for seg in segments)
        again = sum(seg["recompute_s"] for seg in segments)
        mem, m = unit_of([saved], _BYTES)
        sec, s = unit_of([again], _SECONDS)
        paths = ", ".join(
            seg["module_path"] + ("" if seg["policy"] == "full" else " [selective]")
            for seg in segments
        )
        text += f" ({paths}); {_num(saved, m)} {mem} of activations saved, +{_num(again, s)} {sec} per step"
    lines += wrap(text, width)
    sol = x["solver"]
    lines += wrap(
        f"Solver {sol['backend']}: {sol['status']}, gap {sol['gap']:.2%} (bound {sol['bound_s']:.5g} s), "
        f"{sol['num_variables']:,} variables, "
        f"{sol['num_constraints']:,} constraints, {sol['solve_s']:.2f} s",
        width,
    )
    return lines


def render_summary(data: dict[str, Any], *, width: int | None = None, verbose: bool = False) -> str:
    """The summary as text: the sentence, the headline figures, the recipes side by side, the
    per-block layouts with a legend, warnings; ``verbose`` adds the ZeRO and solver details."""
    lines = wrap(data["sentence"] + ".", width)
    lines += _headline(data["headline"], width)
    lines.append("")
    lines += _recipes(data["recipes"], width)
    lines.append("")
    lines += _blocks(data["blocks"], data["legend"], width)
    warnings = data["warnings"]
    if warnings:
        lines.append("")
        lines.append(f"Warnings ({len(warnings)}):")
        shown = warnings if verbose else warnings[:3]
        for w in shown:
            lines += wrap(f"- {w}", width, "", "  ")
        if len(shown) < len(warnings):
            lines.append(f"  ... {len(warnings) - len(shown)} more with --verbose")
    if verbose:
        lines.append("")
        lines += _details(data["details"], width)
    return "\n".join(line.rstrip() for line in lines)
