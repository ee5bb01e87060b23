"""The HTML plan report: one self-contained page (inline CSS, SVG and a few lines of JS; no
network, no CDN) showing a plan's step time and memory next to the recipes, every parameter's
layout, the ZeRO and checkpoint choices, and the warnings.

``render_plan_html(plan.data)`` returns the page; ``plan_sections`` the body, which
``autopar.tools.html_report`` reuses under its comparison of several plans. Figures carry
``data-*`` attributes with the exact numbers of the plan JSON (see ``html_figures``):

- ``#headline``: ``data-recipe``, ``data-step-s``, ``data-peak-bytes``, ``data-budget-bytes``;
- ``#step-time`` / ``#memory``: one ``g.bar[data-plan]`` per plan with ``data-step-s`` /
  ``data-peak-bytes`` and one ``rect[data-key]`` per part (``data-seconds`` / ``data-bytes``);
  ``#memory line.limit[data-budget-bytes]``;
- ``#recipes tr[data-plan]``: ``data-step-s``, ``data-peak-bytes``, ``data-fits``;
- ``#layouts td.cell``: ``data-fqn``, ``data-placement``;
- ``#zero``: ``data-stage``, ``data-axes``; ``#checkpoint``: ``data-segments`` and one
  ``tr[data-module-path]`` per segment; ``#warnings li`` one per warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Any

from autopar.options import format_bytes, format_seconds
from autopar.plan.html_figures import (
    MEMORY_PARTS,
    STEP_PARTS,
    bytes_unit,
    in_unit,
    num,
    seconds_unit,
    stacked_bars,
    table,
)
from autopar.plan.html_layouts import layout_grids
from autopar.plan.summary import zero_label

PAGE_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222;
       margin: 0 auto; max-width: 1180px; padding: 16px 24px 48px; }
h1 { font-size: 22px; margin: 8px 0 4px; } h2 { font-size: 18px; margin: 28px 0 8px;
     border-bottom: 1px solid #ddd; padding-bottom: 4px; } h3 { font-size: 15px; margin: 14px 0 6px; }
#headline { font-size: 16px; background: #f4f7fb; border-left: 4px solid #4e79a7; padding: 8px 12px; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 16px; margin: 8px 0; }
dl.facts dt { color: #666; } dl.facts dd { margin: 0; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { padding: 3px 8px; border-bottom: 1px solid #eee; text-align: left; vertical-align: top; }
th.num, td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.this td { font-weight: 600; background: #f4f7fb; }
figure.chart { margin: 10px 0 18px; } figcaption { font-weight: 600; margin-bottom: 4px; }
svg text { font-size: 12px; fill: #222; } svg text.tick { fill: #666; font-size: 11px; }
svg line.tick { stroke: #999; } svg line.limit { stroke: #d62728; stroke-width: 2; stroke-dasharray: 5 3; }
svg text.limit-label { fill: #d62728; font-size: 11px; } svg rect { stroke: #fff; stroke-width: 0.5; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; margin: 4px 0; }
.swatch { display: inline-block; width: 12px; height: 12px; margin-right: 5px; vertical-align: -2px;
          border: 1px solid #999; }
table.layout-grid { border-collapse: separate; border-spacing: 3px 2px; }
table.layout-grid th { font-weight: normal; font-size: 12px; white-space: nowrap; padding: 0 6px 0 0;
                       border: none; }
table.layout-grid th.col { writing-mode: vertical-rl; transform: rotate(180deg); text-align: left;
                           padding: 0 0 4px; max-height: 200px; }
td.cell { padding: 0; border: 1px solid #888; white-space: nowrap; cursor: default; }
td.cell span.ax { display: inline-block; min-width: 26px; text-align: center; font-size: 11px;
                  padding: 1px 2px; }
td.cell span.pname { display: block; font-size: 11px; background: #fff; padding: 0 3px; }
td.recompute { color: #e15759; font-size: 12px; border: none; white-space: nowrap; }
.note { color: #555; font-size: 13px; } ul.warnings li { margin: 3px 0; }
details summary { cursor: pointer; color: #4e79a7; margin: 6px 0; }
#tip { position: absolute; display: none; background: #222; color: #fff; padding: 6px 9px;
       border-radius: 4px; font-size: 12px; white-space: pre-line; pointer-events: none;
       max-width: 460px; z-index: 10; }
"""

# Hover: show an element's data-tip next to the pointer (native titles wait a second and
# cannot be styled; this is the only script on the page).
PAGE_JS = """
(function () {
  var tip = document.getElementById("tip");
  document.addEventListener("mouseover", function (e) {
    var el = e.target.closest ? e.target.closest("[data-tip]") : null;
    if (!el) { tip.style.display = "none"; return; }
    tip.textContent = el.getAttribute("data-tip");
    tip.style.display = "block";
  });
  document.addEventListener("mousemove", function (e) {
    tip.style.left = (e.pageX + 14) + "px";
    tip.style.top = (e.pageY + 14) + "px";
  });
})();
"""


def page(title: str, body: str) -> str:
    """A complete, self-contained HTML document."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{PAGE_CSS}</style></head>\n<body>\n{body}\n"
        f'<div id="tip"></div><script>{PAGE_JS}</script>\n</body></html>\n'
    )


def _plans(data: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], bool]]:
    """(name, figures, fits) of this plan, then of every other recipe priced with it."""
    own_fits = data["predicted"]["peak_memory_bytes"] <= data["memory_budget_bytes"]
    rows = [(data["recipe"], {**data["predicted"], "zero": data["zero"]}, own_fits)]
    rows += [
        (name, b, bool(b["fits"]))
        for name, b in data["baselines"].items()
        if name != data["recipe"]
    ]
    return rows


def headline(data: Mapping[str, Any]) -> str:
    """What was chosen, in one or two sentences of a user's words."""
    pred = data["predicted"]
    params = data["params"].values()
    replicated = all(set(p["placement"].split(",")) == {"R"} for p in params) and all(
        set((i.get("placements") or "R").split(",")) <= {"R"} for i in data.get("inputs", [])
    )
    what = (
        "replicated: no parallelism pays at this size"
        if replicated
        else f"the {data['recipe']} plan"
    )
    parts = [
        f"{what}: step {format_seconds(pred['step_s'])}, peak {format_bytes(pred['peak_memory_bytes'])}"
        f" of the {format_bytes(data['memory_budget_bytes'])} budget"
    ]
    rivals = [
        (b["step_s"], name)
        for name, b in data["baselines"].items()
        if name != data["recipe"] and b["fits"]
    ]
    if rivals and pred["step_s"] > 0:
        step, name = min(rivals)
        ratio = step / pred["step_s"]
        if ratio >= 1.005:
            parts.append(f"{ratio:.2f}x faster than {name}, the fastest recipe that fits")
        elif ratio <= 0.995:
            parts.append(f"{1 / ratio:.2f}x slower than {name}, the fastest recipe that fits")
        else:
            parts.append(f"as fast as {name}, the fastest recipe that fits")
    elif not rivals:
        parts.append("no recipe fits the budget")
    parts.append(f"ZeRO {zero_label(data['zero'])}")
    segments = data["checkpoint"]["segments"]
    if segments:
        seconds = sum(s["recompute_s"] for s in segments)
        parts.append(f"{len(segments)} segment(s) recomputed (+{format_seconds(seconds)} per step)")
    else:
        parts.append("nothing recomputed")
    text = "; ".join(parts) + "."
    values = {"recipe": data["recipe"], "step-s": num(pred["step_s"]),
              "peak-bytes": num(pred["peak_memory_bytes"]), "budget-bytes": num(data["memory_budget_bytes"])}  # fmt: skip
    data_attrs = "".join(f' data-{k}="{escape(v)}"' for k, v in values.items())
    return f'<p id="headline"{data_attrs}>{escape(text[0].upper() + text[1:])}</p>'


def facts(data: Mapping[str, Any]) -> str:
    mesh = data["mesh"]
    links = ", ".join(
        f"{n}: {link['name']}" for n, link in zip(mesh["axis_names"], mesh.get("links", []))
    )
    options = data.get("options", {})
    solver = data["solver"]
    timings = data.get("timings", {})
    rows = [
        ("model", f"{data['model']['name']}: {data['model']['num_params']:,} parameters, {data['model']['num_nodes']} nodes"),
        ("mesh", " x ".join(f"{n}={s}" for n, s in zip(mesh["axis_names"], mesh["shape"]))
         + f" of {mesh['device']['name']}" + (f" ({links})" if links else "")),
        ("memory budget", f"{format_bytes(data['memory_budget_bytes'])} per device"),
        ("options", f"optimizer {options.get('optimizer', '?')}, precision {options.get('mixed_precision') or 'fp32'}, "
                    f"checkpoint {options.get('checkpoint', 'auto')}"),
        ("solver", f"{solver['backend']}: {solver['status']}, gap {solver['gap']:.2%}, "
                   f"{solver['num_variables']:,} variables, {solver['num_constraints']:,} constraints"),
        ("planning time", ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in timings.items())),
        ("autopar", str(data.get("autopar_version", "?"))),
    ]  # fmt: skip
    items = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in rows)
    return f'<dl class="facts">{items}</dl>'


def step_and_memory(
    named: list[tuple[str, Mapping[str, Any], bool]], budget: float, *, this: str, prefix: str = ""
) -> str:
    """The step-time and memory figures of several plans (``(name, figures, fits)``), with ids
    ``PREFIXstep-time`` and ``PREFIXmemory``."""
    steps = [(n, fig["breakdown"], fig["step_s"]) for n, fig, _ in named]
    mems = [(n, fig["memory"], fig["peak_memory_bytes"]) for n, fig, _ in named]
    pipeline_note = (
        {}
        if any(b.get("pipeline_bubble_s") for _, b, _ in steps)
        else {"pipeline_bubble_s": "no pipeline stages"}
    )
    return stacked_bars(
        figure_id=f"{prefix}step-time", caption=f"Predicted step time per plan (this plan: {this}), one device",
        rows=steps, parts=STEP_PARTS, total_attr="step-s", part_attr="seconds",
        unit=seconds_unit([t for _, _, t in steps]), absent_note=pipeline_note,
    ) + stacked_bars(
        figure_id=f"{prefix}memory", caption="Predicted peak memory per device vs the budget",
        rows=mems, parts=MEMORY_PARTS, total_attr="peak-bytes", part_attr="bytes",
        unit=bytes_unit([t for _, _, t in mems] + [budget]), limit=budget,
        limit_label="budget", limit_attr="budget-bytes",
    )  # fmt: skip


def recipes_table(named: list[tuple[str, Mapping[str, Any], bool]], *, this: str) -> str:
    """The plans side by side: step, its parts, peak memory, fit and ZeRO; one unit per column."""
    ref = next(fig["step_s"] for n, fig, _ in named if n == this)
    s_unit = seconds_unit([fig["step_s"] for _, fig, _ in named])
    b_unit = bytes_unit([fig["peak_memory_bytes"] for _, fig, _ in named])
    rows = []
    for name, fig, fits in named:
        bk = fig["breakdown"]
        comm = sum(v for k, v in bk.items() if k not in ("compute_s", "recompute_s"))
        zero = fig.get("zero")
        cells = [name, in_unit(fig["step_s"], s_unit), f"{fig['step_s'] / ref:.2f}x" if ref > 0 else "-",
                 in_unit(bk["compute_s"], s_unit), in_unit(comm, s_unit), in_unit(bk.get("recompute_s", 0.0), s_unit),
                 in_unit(fig["peak_memory_bytes"], b_unit), "yes" if fits else "NO",
                 zero_label(zero) if zero else "-"]  # fmt: skip
        row_attrs = {"data-plan": name, "data-step-s": num(fig["step_s"]),
                     "data-peak-bytes": num(fig["peak_memory_bytes"]), "data-fits": str(fits).lower(),
                     "class": "this" if name == this else None}  # fmt: skip
        rows.append((cells, row_attrs))
    header = [
        "plan",
        "step",
        f"vs {this}",
        "compute",
        "communication",
        "recompute",
        "peak memory",
        "fits",
        "ZeRO",
    ]
    return table("recipes", header, rows, numeric=lambda c: 0 < c < 7)


def zero_section(data: Mapping[str, Any]) -> str:
    zero = data["zero"]
    out = [f'<section id="zero" data-stage="{zero["stage"]}" data-axes="{escape(",".join(zero["axes"]))}">',
           "<h2>ZeRO</h2>", f"<p>Chosen: <b>ZeRO {escape(zero_label(zero))}</b>"
           + (f", chunks of {escape(format_bytes(zero['chunk_bytes']))}" if zero.get("chunk_bytes") else "") + ".</p>"]  # fmt: skip
    if zero.get("reason"):
        out.append(f'<p class="note">Why: {escape(zero["reason"])}</p>')
    per_stage = zero.get("per_stage") or {}
    if len(per_stage) > 1:
        rows = [
            (f"ZeRO {k}", fig["memory"], fig["peak_memory_bytes"]) for k, fig in per_stage.items()
        ]
        out.append(stacked_bars(
            figure_id="memory-per-zero-stage", caption="These layouts under each ZeRO stage: memory per device",
            rows=rows, parts=MEMORY_PARTS, total_attr="peak-bytes", part_attr="bytes",
            unit=bytes_unit([t for _, _, t in rows] + [data["memory_budget_bytes"]]),
            limit=data["memory_budget_bytes"], limit_label="budget", limit_attr="budget-bytes",
        ))  # fmt: skip
    considered = zero.get("considered") or []
    if considered:
        s_unit = seconds_unit([r["step_s"] for r in considered])
        b_unit = bytes_unit([r["peak_memory_bytes"] for r in considered])
        rows = [([zero_label(r), r["layouts"], in_unit(r["step_s"], s_unit), in_unit(r["peak_memory_bytes"], b_unit),
                  r["verdict"]], {"data-verdict": r["verdict"]}) for r in considered]  # fmt: skip
        out.append(f"<details><summary>{len(considered)} ZeRO configurations considered</summary>")
        out.append(table("zero-considered", ["configuration", "layouts", "step", "peak memory", "verdict"], rows,
                         numeric=lambda c: c in (2, 3)))  # fmt: skip
        out.append("</details>")
    out.append("</section>")
    return "\n".join(out)


def checkpoint_section(data: Mapping[str, Any]) -> str:
    ckpt = data["checkpoint"]
    segments = ckpt["segments"]
    out = [
        f'<section id="checkpoint" data-segments="{len(segments)}"><h2>Activation checkpointing</h2>'
    ]
    mode = ckpt.get("mode", "auto")
    if not segments:
        why = "the budget does not bind" if mode == "auto" else f"checkpoint mode {mode}"
        out.append(f"<p>Nothing is recomputed ({escape(why)}).</p>")
    else:
        saved = sum(s["saved_bytes"] for s in segments)
        extra = sum(s["recompute_s"] for s in segments)
        out.append(f"<p>Mode {escape(mode)}: {len(segments)} segment(s) recomputed in backward, "
                   f"{escape(format_bytes(saved))} of activations not kept, "
                   f"+{escape(format_seconds(extra))} of recomputation per step.</p>")  # fmt: skip
        b_unit = bytes_unit([s["saved_bytes"] for s in segments])
        s_unit = seconds_unit([s["recompute_s"] for s in segments])
        rows = [([s["module_path"] or "(top)", s["policy"], str(len(s["nodes"])), in_unit(s["saved_bytes"], b_unit),
                  in_unit(s["recompute_s"], s_unit)], {"data-module-path": s["module_path"]}) for s in segments]  # fmt: skip
        out.append(table("checkpoint-segments", ["module", "policy", "nodes", "activations freed", "recompute"],
                         rows, numeric=lambda c: c >= 2))  # fmt: skip
    out.append("</section>")
    return "\n".join(out)


def warnings_section(data: Mapping[str, Any]) -> str:
    warnings = data.get("warnings") or []
    items = "".join(f"<li>{escape(w)}</li>" for w in warnings) or "<li>none</li>"
    return f'<section id="warnings" data-count="{len(warnings)}"><h2>Warnings</h2><ul class="warnings">{items}</ul></section>'


def inputs_table(data: Mapping[str, Any]) -> str:
    rows = [
        ([i["name"], i.get("placements") or "-"], {"data-input": i["name"]})
        for i in data.get("inputs", [])
    ]
    return table("inputs", ["input", "layout"], rows, numeric=lambda c: False) if rows else ""


def plan_sections(data: Mapping[str, Any], *, side_by_side: bool = True) -> str:
    """The body of one plan's report (everything but the page around it); ``side_by_side=False``
    leaves out the figures and table of the recipes (a comparison page shows its own)."""
    named = _plans(data)
    this = data["recipe"]
    recipes = [
        '<section id="figures"><h2>Step time and memory</h2>',
        step_and_memory(named, data["memory_budget_bytes"], this=this),
        "</section>",
        f'<section id="recipes-section"><h2>This plan and the recipes</h2><p class="note">All priced by the '
        f"same cost model; communication is resharding, gradient sync and ZeRO traffic.</p>{recipes_table(named, this=this)}</section>",
    ]
    return "\n".join([
        headline(data),
        facts(data),
        *(recipes if side_by_side else []),
        f"<section><h2>Layouts per layer block</h2>{layout_grids(data)}"
        f"<h3>inputs</h3>{inputs_table(data)}</section>",
        zero_section(data),
        checkpoint_section(data),
        warnings_section(data),
    ])  # fmt: skip


def render_plan_html(data: Mapping[str, Any]) -> str:
    """The plan report page for a plan JSON document (``Plan.data``)."""
    mesh = " x ".join(str(s) for s in data["mesh"]["shape"])
    title = f"autopar plan: {data['model']['name']} on {mesh} {data['mesh']['device']['name']}"
    return page(title, f"<h1>{escape(title)}</h1>\n{plan_sections(data)}")


def write_plan_html(data: Mapping[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_plan_html(data))
