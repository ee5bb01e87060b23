"""Figures of the HTML plan report as inline SVG and HTML strings: stacked bars (step time,
memory), layout grids (one coloured stripe per mesh axis per parameter) and plain tables.

No plotting library and no network: every figure is text the page carries. Each figure carries
machine-readable ``data-*`` attributes holding the exact figures it draws (floats as ``repr``),
so a test can read the DOM and compare it with the plan JSON.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from html import escape
from typing import Any

_SHARD_COLOURS = ("#4e79a7", "#59a14f", "#b07aa1", "#edc948", "#76b7b2", "#ff9da7")
_REPLICATE_COLOUR = "#d9d9d9"
_PARTIAL_COLOUR = "#f28e2b"

#: (breakdown key, label, colour) of the step-time figure, in drawing order.
STEP_PARTS: tuple[tuple[str, str, str], ...] = (
    ("compute_s", "compute", "#4e79a7"),
    ("resharding_s", "resharding", "#f28e2b"),
    ("activation_grad_comm_s", "activation-gradient comm", "#ffbe7d"),
    ("output_comm_s", "output comm", "#9c755f"),
    ("grad_sync_s", "gradient sync", "#59a14f"),
    ("zero_comm_s", "ZeRO traffic", "#b07aa1"),
    ("recompute_s", "recomputation", "#e15759"),
    ("pipeline_bubble_s", "pipeline bubble", "#bab0ac"),
)

#: (memory key, label, colour) of the memory figure, in drawing order.
MEMORY_PARTS: tuple[tuple[str, str, str], ...] = (
    ("params", "parameters", "#4e79a7"),
    ("grads", "gradients", "#59a14f"),
    ("optimizer", "optimizer state", "#edc948"),
    ("master", "fp32 master weights", "#b07aa1"),
    ("activations", "activations", "#f28e2b"),
    ("recompute_peak", "recomputed in backward", "#e15759"),
    ("transient", "largest transient", "#9c755f"),
    ("inputs_buffers", "inputs and buffers", "#bab0ac"),
)


def num(value: float) -> str:
    """A float as an attribute value that parses back to the same float."""
    return repr(float(value))


def attrs(values: Mapping[str, Any]) -> str:
    """`` name="value"`` pairs, escaped; None values left out."""
    return "".join(f' {k}="{escape(str(v))}"' for k, v in values.items() if v is not None)


def _typical(values: Sequence[float]) -> float:
    """The median of the nonzero magnitudes: a unit fitted to it keeps most figures between 1
    and 1000 (the largest-value unit would print 0.28 s next to 2.91 s)."""
    nonzero = sorted(abs(v) for v in values if v)
    return nonzero[len(nonzero) // 2] if nonzero else 0.0


def seconds_unit(values: Sequence[float]) -> tuple[float, str]:
    """One unit for a whole column or axis: (scale, name) fitted to the typical value."""
    top = _typical(values)
    if top >= 1:
        return 1.0, "s"
    if top >= 1e-3:
        return 1e-3, "ms"
    return 1e-6, "us"


def bytes_unit(values: Sequence[float]) -> tuple[float, str]:
    top = _typical(values)
    for name, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= scale:
            return float(scale), name
    return 1.0, "B"


def in_unit(value: float, unit: tuple[float, str]) -> str:
    """``value`` in ``unit`` with three significant digits or more (0.086 ms, 2,272.2 ms)."""
    scaled = value / unit[0]
    decimals = 1 if abs(scaled) >= 100 else 2 if abs(scaled) >= 1 or scaled == 0 else 3
    return f"{scaled:,.{decimals}f} {unit[1]}"


def nice_ticks(top: float, count: int = 5) -> list[float]:
    """Axis ticks at 0 and multiples of 1, 2 or 5 x 10^k, at most ``top``."""
    if top <= 0:
        return [0.0]
    raw = top / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [k * step for k in range(int(top / step) + 1)]


def placement_colour(axis_placement: str) -> str:
    """Colour of one mesh axis's placement: R grey, P orange, S<dim> one colour per dim."""
    if axis_placement == "R":
        return _REPLICATE_COLOUR
    if axis_placement == "P":
        return _PARTIAL_COLOUR
    match = re.fullmatch(r"S(\d+)(\[[\d:]+\])?", axis_placement)
    return _SHARD_COLOURS[int(match.group(1)) % len(_SHARD_COLOURS)] if match else "#ffffff"


def placement_words(axis_placement: str) -> str:
    if axis_placement == "R":
        return "replicated"
    if axis_placement == "P":
        return "partial sums"
    match = re.fullmatch(r"S(\d+)(?:\[([\d:]+)\])?", axis_placement)
    if match and match.group(2):
        return f"split on dim {match.group(1)}, each of its sections {match.group(2)}"
    return f"split on dim {match.group(1)}" if match else axis_placement


def legend(items: Sequence[tuple[str, str]], *, figure: str) -> str:
    """A row of colour swatches: (label, colour)."""
    spans = "".join(
        f'<span class="key"><span class="swatch" style="background:{colour}"></span>{escape(label)}</span>'
        for label, colour in items
    )
    return f'<div class="legend" data-legend-of="{escape(figure)}">{spans}</div>'


def stacked_bars(
    *,
    figure_id: str,
    caption: str,
    rows: Sequence[tuple[str, Mapping[str, float], float]],
    parts: Sequence[tuple[str, str, str]],
    total_attr: str,
    part_attr: str,
    unit: tuple[float, str],
    limit: float | None = None,
    limit_label: str = "",
    limit_attr: str = "",
    absent_note: Mapping[str, str] | None = None,
) -> str:
    """Horizontal stacked bars, one per row ``(name, parts by key, total)``.

    Each bar is ``<g class="bar" data-plan=NAME data-TOTAL_ATTR=total>`` with one ``<rect
    data-key=KEY data-PART_ATTR=value>`` per nonzero part (keys outside ``parts`` are drawn in
    grey, so nothing is silently dropped); ``limit`` draws a dashed line (the memory budget).
    """
    known = {key for key, _, _ in parts}
    extra = sorted({k for _, values, _ in rows for k, v in values.items() if k not in known and v})
    all_parts = [*parts, *((k, k, "#7f7f7f") for k in extra)]
    label_w, bar_w, right_w, row_h = 170, 560, 130, 28
    largest = max([total for _, _, total in rows] + [1e-30])
    # A limit far above every bar (a 72 GiB budget over 60 MiB plans) would squash the bars to
    # slivers: then the scale ends at the bars and the limit is named, off the scale.
    off_scale = bool(limit) and limit > 2.5 * largest
    scale_top = max([largest] + ([limit] if limit and not off_scale else [])) * 1.04
    top_margin = 18 if limit else 6  # room for the limit's label above the bars
    height = top_margin + row_h * len(rows) + 28
    out = [
        f'<figure id="{escape(figure_id)}" class="chart"><figcaption>{escape(caption)}</figcaption>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + right_w}" '
        f'height="{height}" role="img" aria-label="{escape(caption)}">',
    ]
    for r, (name, values, total) in enumerate(rows):
        y = top_margin + r * row_h
        out.append(f'<g class="bar"{attrs({"data-plan": name, f"data-{total_attr}": num(total)})}>')
        out.append(f'<text x="{label_w - 8}" y="{y + 16}" text-anchor="end">{escape(name)}</text>')
        x = float(label_w)
        for key, label, colour in all_parts:
            value = float(values.get(key, 0.0))
            if value <= 0:
                continue
            w = bar_w * value / scale_top
            tip = f"{name}: {label} {in_unit(value, unit)} ({100 * value / total:.1f}% of {in_unit(total, unit)})"
            out.append(
                f'<rect x="{x:.2f}" y="{y + 3}" width="{max(w, 0.5):.2f}" height="{row_h - 8}" '
                f'fill="{colour}"{attrs({"data-key": key, f"data-{part_attr}": num(value), "data-tip": tip})}/>'
            )
            x += w
        out.append(
            f'<text x="{x + 6:.2f}" y="{y + 16}" class="total">{escape(in_unit(total, unit))}</text></g>'
        )
    axis_y = top_margin + len(rows) * row_h
    # The axis reads in the unit of its largest figure (0, 50, 100 GiB), labels in ``unit``.
    axis_unit = (seconds_unit if unit[1] in ("s", "ms", "us") else bytes_unit)([scale_top])
    for tick in nice_ticks(scale_top / axis_unit[0]):
        x = label_w + bar_w * tick * axis_unit[0] / scale_top
        out.append(
            f'<line x1="{x:.1f}" y1="{axis_y}" x2="{x:.1f}" y2="{axis_y + 4}" class="tick"/>'
        )
        out.append(
            f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle" class="tick">{tick:g} {axis_unit[1]}</text>'
        )
    if limit:
        text = f"{limit_label} {in_unit(limit, bytes_unit([limit]) if unit[1].endswith('B') else unit)}"
        limit_attrs = attrs({f"data-{limit_attr}": num(limit), "data-tip": text})
        if off_scale:
            out.append(
                f'<text x="{label_w + bar_w + right_w - 4}" y="{top_margin - 6}" text-anchor="end" '
                f'class="limit-label"{limit_attrs}>{escape(text)}, off the scale &#8594;</text>'
            )
        else:
            x = label_w + bar_w * limit / scale_top
            out.append(
                f'<line class="limit" x1="{x:.2f}" y1="{top_margin - 4}" x2="{x:.2f}" y2="{axis_y}"{limit_attrs}/>'
            )
            out.append(
                f'<text x="{x:.2f}" y="{top_margin - 6}" text-anchor="middle" class="limit-label">{escape(text)}</text>'
            )
    out.append("</svg>")
    present = {k for _, values, _ in rows for k, v in values.items() if v}
    notes = absent_note or {}
    items = [(label, colour) for key, label, colour in all_parts if key in present]
    items += [
        (f"{label} ({notes[key]})", colour)
        for key, label, colour in all_parts
        if key not in present and key in notes
    ]
    out.append(legend(items, figure=figure_id))
    out.append("</figure>")
    return "\n".join(out)


def paired_bars(
    *,
    figure_id: str,
    caption: str,
    rows: Sequence[tuple[str, float, float | None]],
    unit: tuple[float, str],
) -> str:
    """Predicted (light) vs measured (dark) bars per row ``(name, predicted, measured or None)``."""
    label_w, bar_w, right_w, row_h = 170, 560, 160, 34
    top = max([p for _, p, _ in rows] + [m for _, _, m in rows if m is not None] + [1e-30]) * 1.04
    out = [
        f'<figure id="{escape(figure_id)}" class="chart"><figcaption>{escape(caption)}</figcaption>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + right_w}" '
        f'height="{row_h * len(rows) + 8}" role="img" aria-label="{escape(caption)}">',
    ]
    for r, (name, predicted, measured) in enumerate(rows):
        y = 4 + r * row_h
        out.append(
            f'<g class="pair"{attrs({"data-plan": name, "data-predicted-s": num(predicted), "data-measured-s": None if measured is None else num(measured)})}>'
        )
        out.append(f'<text x="{label_w - 8}" y="{y + 18}" text-anchor="end">{escape(name)}</text>')
        for k, (what, value, colour) in enumerate(
            (("predicted", predicted, "#a0cbe8"), ("measured", measured, "#4e79a7"))
        ):
            if value is None:
                continue
            w = max(bar_w * value / top, 0.5)
            tip = f"{name}: {what} {in_unit(value, unit)}"
            out.append(
                f'<rect x="{label_w}" y="{y + 2 + 14 * k}" width="{w:.2f}" height="12" fill="{colour}" data-tip="{escape(tip)}"/>'
            )
            out.append(
                f'<text x="{label_w + w + 6:.2f}" y="{y + 12 + 14 * k}" class="total">{escape(in_unit(value, unit))}</text>'
            )
        out.append("</g>")
    out.append("</svg>")
    out.append(legend([("predicted", "#a0cbe8"), ("measured", "#4e79a7")], figure=figure_id))
    out.append("</figure>")
    return "\n".join(out)


def table(
    table_id: str,
    header: Sequence[str],
    rows: Sequence[tuple[Sequence[str], Mapping[str, Any]]],
    *,
    numeric: Callable[[int], bool] = lambda c: c > 0,
) -> str:
    """An HTML table; each row is (cells, data attributes of its ``<tr>``). Cells are text."""
    head = "".join(
        f'<th class="{"num" if numeric(c) else ""}">{escape(h)}</th>' for c, h in enumerate(header)
    )
    body = []
    for cells, row_attrs in rows:
        tds = "".join(
            f'<td class="{"num" if numeric(c) else ""}">{escape(v)}</td>'
            for c, v in enumerate(cells)
        )
        body.append(f"<tr{attrs(row_attrs)}>{tds}</tr>")
    return f'<table id="{escape(table_id)}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
