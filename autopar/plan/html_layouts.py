"""The layout grids of the HTML plan report: one grid per family of repeated layer blocks
(rows = blocks such as ``layers.0 .. layers.31``, columns = the parameters of a block) and one
for the other blocks (embeddings, final norm, output layer), in model order.

Each parameter is one ``<td class="cell" data-fqn=FQN data-placement="S0,R">`` holding one
coloured stripe per mesh axis; hovering shows the tensor, its bytes in all and per device, and
its ZeRO treatment.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from autopar.options import format_bytes
from autopar.plan.html_figures import attrs, legend, placement_colour, placement_words
from autopar.plan.summary import block_of, natural_key

_ITEMSIZE = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2,
             "bool": 1, "int8": 1, "uint8": 1}  # fmt: skip


def params_in_model_order(data: Mapping[str, Any]) -> list[str]:
    """Parameter FQNs in the order the graph uses them (placeholders come in module order);
    parameters the graph does not list come last, sorted."""
    order = [
        e["fqn"]
        for e in data["nodes"]
        if e.get("kind") == "param" and e.get("fqn") in data["params"]
    ]
    seen = set(order)
    return [*order, *sorted(f for f in data["params"] if f not in seen)]


def _family(block: str) -> str:
    """``layers.3`` -> ``layers``; a block that is not one of a numbered series -> ''."""
    head, _, tail = block.rpartition(".")
    return head if tail.isdigit() and head else ""


def _tooltip(
    fqn: str, param: Mapping[str, Any], node: Mapping[str, Any] | None, mesh: Mapping[str, Any]
) -> str:
    shape = list(param.get("shape") or (node["shapes"][0] if node and node.get("shapes") else []))
    dtype = (node or {}).get("dtype", "float32")
    total = math.prod(shape) * _ITEMSIZE.get(dtype, 4)
    per_axis = param["placement"].split(",")
    local = float(total)
    words = []
    for name, size, p in zip(mesh["axis_names"], mesh["shape"], per_axis):
        words.append(f"{name}: {placement_words(p)}")
        if p.startswith("S"):
            local /= size
    lines = [
        fqn,
        f"shape {shape} {dtype}, {format_bytes(total)} in all",
        f"layout {param['placement']} ({'; '.join(words)})",
        f"{format_bytes(local)} per device in the compute layout",
    ]
    zero = param.get("zero") or {}
    stages = {a: s for a, s in (zero.get("stages") or {}).items() if s}
    if stages:
        stored = local / math.prod(
            size for name, size in zip(mesh["axis_names"], mesh["shape"]) if name in stages
        )
        lines.append(
            "ZeRO "
            + ", ".join(f"stage {s} on {a}" for a, s in stages.items())
            + (
                f": stored as {format_bytes(stored)} per device"
                if max(stages.values()) >= 3
                else ""
            )
        )
    if param.get("tied_to"):
        lines.append(f"tied to {', '.join(param['tied_to'])}")
    return "\n".join(lines)


def _cell(fqn: str, label: str | None, data: Mapping[str, Any], nodes: Mapping[str, Any]) -> str:
    param = data["params"][fqn]
    placement = param["placement"]
    stripes = "".join(
        f'<span class="ax" style="background:{placement_colour(p)}">{escape(p)}</span>'
        for p in placement.split(",")
    )
    caption = f'<span class="pname">{escape(label)}</span>' if label else ""
    tip = _tooltip(fqn, param, nodes.get(fqn), data["mesh"])
    return f'<td class="cell"{attrs({"data-fqn": fqn, "data-placement": placement, "data-tip": tip})}>{caption}{stripes}</td>'


def _grid(
    family: str,
    blocks: Sequence[str],
    members: Mapping[str, list[str]],
    data: Mapping[str, Any],
    nodes: Mapping[str, Any],
) -> str:
    columns: list[str] = []
    for block in blocks:
        for fqn in members[block]:
            rel = fqn[len(block) + 1 :]
            if rel not in columns:
                columns.append(rel)
    segments = [seg["module_path"] for seg in data["checkpoint"]["segments"]]
    recomputes = {
        block: [
            p[len(block) + 1 :] or "all"
            for p in segments
            if p == block or p.startswith(block + ".")
        ]
        for block in blocks
    }
    show_recompute = any(recomputes.values())
    head = "".join(f'<th class="col">{escape(c)}</th>' for c in columns)
    head += '<th class="col">recomputed</th>' if show_recompute else ""
    rows = []
    for block in blocks:
        present = {fqn[len(block) + 1 :]: fqn for fqn in members[block]}
        cells = "".join(
            _cell(present[c], None, data, nodes) if c in present else "<td></td>" for c in columns
        )
        if show_recompute:
            cells += f'<td class="recompute">{escape(", ".join(recomputes[block]))}</td>'
        rows.append(f'<tr data-block="{escape(block)}"><th>{escape(block)}</th>{cells}</tr>')
    return (
        f'<div class="grid-wrap"><h3>{escape(family)} ({len(blocks)} blocks)</h3>'
        f'<table class="layout-grid" data-family="{escape(family)}"><thead><tr><th></th>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def _other_grid(
    blocks: Sequence[str],
    members: Mapping[str, list[str]],
    data: Mapping[str, Any],
    nodes: Mapping[str, Any],
) -> str:
    rows = []
    for block in blocks:
        cells = "".join(
            _cell(fqn, fqn[len(block) + 1 :] if fqn.startswith(block + ".") else fqn, data, nodes)
            for fqn in members[block]
        )
        rows.append(f'<tr data-block="{escape(block)}"><th>{escape(block)}</th>{cells}</tr>')
    return (
        '<div class="grid-wrap"><h3>other blocks</h3>'
        f'<table class="layout-grid" data-family=""><tbody>{"".join(rows)}</tbody></table></div>'
    )


def layout_grids(data: Mapping[str, Any], *, element_id: str = "layouts") -> str:
    """Every parameter's layout, one grid per family of numbered blocks, then the other blocks,
    each in the order the model first uses it; a legend of the placements present."""
    nodes = {e["fqn"]: e for e in data["nodes"] if e.get("kind") == "param" and e.get("fqn")}
    members: dict[str, list[str]] = {}
    for fqn in params_in_model_order(data):
        members.setdefault(block_of(data["params"][fqn]["module_path"]), []).append(fqn)
    families: dict[str, list[str]] = {}
    for block in members:
        families.setdefault(_family(block), []).append(block)
    # A numbered family of one block (a 1-layer model) reads best among the other blocks.
    others = [b for b in members if not _family(b) or len(families[_family(b)]) == 1]
    parts = []
    for family, blocks in families.items():
        if family and len(blocks) > 1:
            parts.append(_grid(family, sorted(blocks, key=natural_key), members, data, nodes))
        elif others and others[0] in blocks:
            parts.append(_other_grid(others, members, data, nodes))
    used = sorted({p for param in data["params"].values() for p in param["placement"].split(",")})
    names = ", ".join(data["mesh"]["axis_names"])
    key = legend(
        [(f"{p}: {placement_words(p)}", placement_colour(p)) for p in used], figure=element_id
    )
    note = (
        f'<p class="note">One stripe per mesh axis ({escape(names)}), in mesh order; hover a cell for '
        "the tensor, its bytes and its ZeRO treatment.</p>"
    )
    return f'<div id="{escape(element_id)}" class="layouts">{note}{key}{"".join(parts)}</div>'
