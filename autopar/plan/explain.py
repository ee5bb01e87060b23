"""``plan.explain(NAME)``: why a parameter, module or node got its layout, from the plan JSON.

Names are parameter FQNs (``layers.0.attention.wq.weight``) or module paths
(``layers.0.attention``); a graph node name (``linear_3``) works too. The alternatives come
from the plan's stored ``alternatives`` (every parameter and the most expensive op nodes, see
:mod:`autopar.plan.alternatives`), so a saved plan answers as well as a live one. Suggestions
for a wrong name are drawn from FQNs and module paths only, never internal node names.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

from autopar.options import format_bytes, format_seconds
from autopar.plan.render import table
from autopar.plan.render import wrap as _wrap

Live = Callable[[str], "dict[str, Any] | None"]
"""Computes a node's alternatives entry from the live strategy space (plans made in this
process), for nodes whose alternatives the file does not store."""
_MAX_MODULE_ENTRIES = 6


def vocabulary(d: dict[str, Any]) -> list[str]:
    """The names explain accepts and suggests: parameter FQNs and module paths (with their
    parents), in model order."""
    names: dict[str, None] = {}
    for entry in d["nodes"]:
        path = entry.get("module_path") or ""
        parts = path.split(".") if path else []
        for k in range(1, len(parts) + 1):
            names.setdefault(".".join(parts[:k]))
        if entry.get("fqn"):
            names.setdefault(entry["fqn"])
    for fqn in d["params"]:
        names.setdefault(fqn)
    return list(names)


def _signed_seconds(value: float | None) -> str:
    if value is None:
        return "impossible"
    if value == 0:
        return "+0"
    return ("+" if value > 0 else "-") + format_seconds(abs(value))


def _signed_bytes(value: float) -> str:
    if value == 0:
        return "+0"
    return ("+" if value > 0 else "-") + format_bytes(abs(value))


def _alternatives_lines(alt: dict[str, Any], width: int | None) -> list[str]:
    shown = len(alt["options"])
    more = f", the fastest {shown} shown" if shown < alt["num_strategies"] else ""
    lines = _wrap(
        f"{alt['num_strategies']} layouts weighed{more}; step time and memory per device vs the "
        "chosen one, every other layout fixed at this plan's choice:",
        width,
        "  ",
        "  ",
    )
    rows = [
        [
            ("* " if o["reason"] == "chosen" else "  ") + o["layout"],
            _signed_seconds(o["step_delta_s"]),
            _signed_bytes(o["memory_delta_bytes"]),
            o["reason"],
        ]
        for o in alt["options"]
    ]
    body = table(
        ["  layout", "step", "memory", "why not"],
        rows,
        width=None if width is None else width - 2,
        wrap_last=True,
    )
    return lines + ["  " + line for line in body]


def _node_lines(
    d: dict[str, Any], entry: dict[str, Any], live: Live | None, width: int | None
) -> list[str]:
    where = entry["module_path"] or "(top)"
    if entry["kind"] == "param":
        param = d["params"].get(entry.get("fqn", ""), {})
        zero = param.get("zero", {})
        head = (
            f"parameter {entry.get('fqn', entry['name'])} {param.get('shape', '')} in module {where}: "
            f"{entry['outputs'][0]}"
            + (
                f", ZeRO stage {zero['stage']} on {','.join(zero['axes'])}"
                if zero.get("stage")
                else ""
            )
        )
    else:
        head = (
            f"op {entry['name']} ({entry['op']}) in module {where}: inputs "
            f"[{' '.join(str(p) for p in entry['inputs'])}] -> outputs [{' '.join(str(p) for p in entry['outputs'])}]"
        )
    if entry["kind"] == "param":
        cost = (
            f"cost {format_seconds(entry['seconds'])} per step (gradient sync and ZeRO gathers), "
            f"memory {format_bytes(entry['memory_bytes'])} per device (parameter, gradient, optimizer state)"
        )
    else:
        cost = (
            f"cost {format_seconds(entry['seconds'])} per step (compute {format_seconds(entry['compute_s'])}, "
            f"the rest communication), memory {format_bytes(entry['memory_bytes'])} per device"
        )
    lines = _wrap(head, width, "", "  ") + _wrap(cost, width, "  ", "  ")
    stored = d.get("alternatives")
    alt = stored["entries"].get(entry["name"]) if stored else None
    if alt is None and live is not None:
        alt = live(entry["name"])
    tied = (
        d["params"].get(entry.get("fqn", ""), {}).get("tied_to")
        if entry["kind"] == "param"
        else None
    )
    if alt is not None:
        lines += _alternatives_lines(alt, width)
    elif tied and stored is not None:
        lines += _wrap(
            f"tied to {', '.join(tied)} (one tensor, one layout): explain {tied[0]} for the "
            "layouts weighed",
            width,
            "  ",
            "  ",
        )
    elif stored is None:
        lines += _wrap(
            "this plan file stores no alternatives (written before autopar stored them); "
            "re-plan to see what the solver weighed",
            width,
            "  ",
            "  ",
        )
    else:
        lines += _wrap(
            f"alternatives are stored for every parameter and the {stored['top_nodes']} most "
            "expensive ops, and this op is not among them: explain a parameter of its module",
            width,
            "  ",
            "  ",
        )
    return lines


def explain_text(
    d: dict[str, Any], name: str, *, live: Live | None = None, width: int | None = None
) -> str:
    """Why ``name`` (parameter FQN, module path or node name) got its layout.

    Raises:
        KeyError: no such name; the message suggests close FQNs and module paths.
    """
    nodes = d["nodes"]
    param_node = next((e for e in nodes if e["kind"] == "param" and e.get("fqn") == name), None)
    if param_node is not None:
        return "\n".join(_node_lines(d, param_node, live, width))
    node = next((e for e in nodes if e["name"] == name), None)
    if node is not None:
        return "\n".join(_node_lines(d, node, live, width))
    inside = [
        e for e in nodes if e["module_path"] == name or e["module_path"].startswith(name + ".")
    ]
    if not inside:
        words = vocabulary(d)
        close = difflib.get_close_matches(name, words, n=5, cutoff=0.6)
        close += [w for w in words if name in w and w not in close][: 5 - len(close)]
        hint = (
            f"; did you mean {', '.join(close)}?"
            if close
            else "; names are parameter FQNs or module paths"
        )
        raise KeyError(f"no parameter or module {name!r} in this plan{hint}")
    params = [e for e in inside if e["kind"] == "param"]
    stored = d.get("alternatives") or {"entries": {}}
    ops = [e for e in inside if e["kind"] == "op" and e["name"] in stored["entries"]]
    ops.sort(key=lambda e: -e["seconds"])
    lines = [
        f"module {name}: {len(inside)} nodes, {len(params)} parameter(s), "
        f"{format_seconds(sum(e['seconds'] for e in inside))} per step"
    ]
    picked = params[:_MAX_MODULE_ENTRIES]
    picked += ops[: max(1, _MAX_MODULE_ENTRIES - len(picked))]
    for entry in picked:
        lines.append("")
        lines += _node_lines(d, entry, live, width)
    left = len(params) + len(ops) - len(picked)
    if left > 0:
        lines.append(f"({left} more parameter(s) and op(s) in this module: explain them by name)")
    return "\n".join(lines)
