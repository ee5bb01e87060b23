"""The plan summary: what was chosen, in words and figures, from the plan JSON alone.

:func:`summary_data` assembles everything the summary shows as plain data (a sentence, the
headline figures, the recipes side by side, the per-block layouts in model order, and the
details behind ``--verbose``), so the terminal renderer (``autopar.plan.render``) and the HTML
report draw the same numbers. It reads only the JSON, so a plan made in this process, one from
the plan cache and one loaded by ``autopar show`` summarise identically.
"""

from __future__ import annotations

import re
from typing import Any

RECIPE_ORDER = ("auto", "replicated", "ddp", "fsdp", "megatron", "fsdp+tp")
_MEMORY_ORDER = (
    "params",
    "grads",
    "optimizer",
    "master",
    "activations",
    "inputs_buffers",
    "transient",
)
_PEAK_DTYPE = {"bf16": "bfloat16", "fp16": "float16", None: "float32"}


def natural_key(text: str) -> list[Any]:
    """Sort key that orders numbered names by number (layers.2 before layers.10)."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text)]


def block_of(module_path: str) -> str:
    """The repeated block a module path belongs to: the path up to its first numeric part
    (``layers.3.attn.q_proj`` -> ``layers.3``), else its first part, else ``(top)``."""
    if not module_path:
        return "(top)"
    parts = module_path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def zero_label(entry: dict[str, Any]) -> str:
    """'stage 3 on dp,tp', or 'stages dp=2,tp=3' when the axes differ, of a plan JSON ``zero``
    entry (or a ``zero.considered`` row); plans without ``stages`` read as stage on axes."""
    stages = entry.get("stages") or {}
    if len({v for v in stages.values() if v}) > 1:
        return "stages " + ",".join(f"{name}={v}" for name, v in stages.items())
    return f"stage {entry['stage']}" + (f" on {','.join(entry['axes'])}" if entry["axes"] else "")


def per_stage_key(entry: dict[str, Any]) -> str:
    """The chosen configuration's key in ``zero.per_stage`` (see autopar.plan.build._per_stage)."""
    stages = entry.get("stages") or {}
    if len({v for v in stages.values() if v}) > 1:
        return ",".join(f"{name}={v}" for name, v in stages.items())
    return str(entry["stage"])


def _axis_roles(d: dict[str, Any]) -> list[tuple[str, str]]:
    """Per mesh axis of size > 1: (axis name, 'data' / 'tensor' / 'data+tensor' / 'none').
    Data parallel: most op time (weighted by seconds) has its output split along dim 0, the
    batch; tensor parallel: some parameter is split along the axis."""
    names, shape = d["mesh"]["axis_names"], d["mesh"]["shape"]
    ops = [e for e in d["nodes"] if e["kind"] == "op" and e["outputs"] and e["outputs"][0]]
    total = sum(e["seconds"] for e in ops) or 1.0
    out = []
    for a, (name, size) in enumerate(zip(names, shape)):
        if size <= 1:
            continue
        batch = sum(e["seconds"] for e in ops if e["outputs"][0].split(",")[a] == "S0")
        data = batch / total > 0.5
        tensor = any(p["placement"].split(",")[a].startswith("S") for p in d["params"].values())
        out.append(
            (
                name,
                "data+tensor"
                if data and tensor
                else "data"
                if data
                else "tensor"
                if tensor
                else "none",
            )
        )
    return out


def _layers(d: dict[str, Any]) -> list[str]:
    """The numbered blocks of the model (``layers.0``, ``layers.1``...) in model order."""
    seen: dict[str, None] = {}
    for entry in d["nodes"]:
        block = block_of(entry["module_path"])
        if block.rsplit(".", 1)[-1].isdigit():
            seen.setdefault(block)
    return list(seen)


def sentence(d: dict[str, Any]) -> str:
    """What was chosen, in a user's words (e.g. 'tensor parallel on tp with data parallel on dp,
    ZeRO-1 on dp, 4 of 32 layers recomputed')."""
    roles = _axis_roles(d)
    by_role: dict[str, list[str]] = {}
    for name, role in roles:
        by_role.setdefault(role, []).append(name)
    parts = []
    tp_words = (
        "Megatron tensor parallel" if d["recipe"] in ("megatron", "fsdp+tp") else "tensor parallel"
    )
    if by_role.get("tensor"):
        parts.append(f"{tp_words} on {','.join(by_role['tensor'])}")
    data_axes = [name for name, role in roles if role in ("data", "data+tensor")]
    if data_axes:
        split = by_role.get("data+tensor")
        parts.append(
            f"data parallel on {','.join(data_axes)}"
            + (f" (some weights split on {','.join(split)} too)" if split else "")
        )
    if by_role.get("none"):
        parts.append(f"replicated on {','.join(by_role['none'])}")
    if not any(by_role.get(r) for r in ("tensor", "data", "data+tensor")):
        head = (
            "replicated: no parallelism pays at this size"
            if d["recipe"] == "auto"
            else "replicated"
        )
    else:
        head = " with ".join(parts[:2]) + "".join(f", {p}" for p in parts[2:])
    zero = d["zero"]
    stages = zero.get("stages") or {}
    extras = []
    if len({v for v in stages.values() if v}) > 1:
        extras.append("ZeRO " + ", ".join(f"{v} on {a}" for a, v in stages.items() if v))
    elif zero["stage"]:
        extras.append(f"ZeRO-{zero['stage']} on {','.join(zero['axes'])}")
    segments = d["checkpoint"]["segments"]
    if segments:
        layers = set(_layers(d))
        recomputed = {block_of(s["module_path"]) for s in segments}
        if layers and recomputed <= layers:
            extras.append(f"{len(recomputed)} of {len(layers)} layers recomputed")
        else:
            extras.append(f"{len(segments)} segment(s) recomputed")
    text = ", ".join([head, *extras])
    if d["recipe"] != "auto":
        text = f"recipe {d['recipe']}: {text}"
    if d.get("auto_choice"):  # the auto plan vs the best recipe under the model's error
        text += f" ({d['auto_choice']['reason']})"
    return text[0].upper() + text[1:]


def mfu(d: dict[str, Any]) -> float | None:
    """Predicted model FLOPs utilisation: train_flops / (step x peak FLOP/s x devices), at the
    peak of the compute dtype; None when the plan lacks the figures (older plan files)."""
    flops = d["model"].get("train_flops")
    peak = (
        d["mesh"]["device"]
        .get("peak_flops", {})
        .get(_PEAK_DTYPE.get(d["options"].get("mixed_precision")))
    )
    devices = 1
    for size in d["mesh"]["shape"]:
        devices *= size
    step = d["predicted"]["step_s"]
    if not flops or not peak or step <= 0:
        return None
    return flops / (step * peak * devices)


def _comm_s(breakdown: dict[str, float]) -> float:
    return sum(v for k, v in breakdown.items() if k not in ("compute_s", "recompute_s"))


def recipe_rows(d: dict[str, Any]) -> list[dict[str, Any]]:
    """This plan first, then every other recipe priced alongside, in a fixed order."""
    pred = d["predicted"]
    figures = {d["recipe"]: (pred, pred["peak_memory_bytes"] <= d["memory_budget_bytes"])}
    segments = {d["recipe"]: len(d.get("checkpoint", {}).get("segments", ()))}
    for name, b in d["baselines"].items():
        figures.setdefault(name, (b, b["fits"]))
        segments.setdefault(name, b.get("recomputed_segments", 0))
    order = sorted(
        figures,
        key=lambda n: (n != d["recipe"], RECIPE_ORDER.index(n) if n in RECIPE_ORDER else 99),
    )
    rows = []
    for name in order:
        fig, fits = figures[name]
        bk = fig["breakdown"]
        rows.append(
            {
                "plan": name,
                "this_plan": name == d["recipe"],
                "step_s": fig["step_s"],
                "vs_this": fig["step_s"] / pred["step_s"] if pred["step_s"] > 0 else None,
                "compute_s": bk["compute_s"],
                "comm_s": _comm_s(bk),
                "recompute_s": bk.get("recompute_s", 0.0),
                "peak_memory_bytes": fig["peak_memory_bytes"],
                "fits": bool(fits),
                "recomputed_segments": segments[name],
            }
        )
    return rows


def blocks(d: dict[str, Any]) -> list[dict[str, Any]]:
    """Per layer block in model order (graph order of first use), consecutive identical numbered
    blocks merged (``layers.0-31``, ``count`` 32, mean figures per block): parameters in order of
    first use with their placement, activation layouts with their counts, seconds and bytes."""
    first_use: dict[str, int] = {}
    for k, entry in enumerate(d["nodes"]):
        for arg in entry.get("args", []):
            first_use.setdefault(arg, k)
    raw: dict[str, dict[str, Any]] = {}
    order: dict[str, int] = {}
    for k, entry in enumerate(d["nodes"]):
        name = block_of(entry["module_path"])
        blk = raw.setdefault(name, {"params": [], "acts": {}, "seconds": 0.0, "memory_bytes": 0.0})
        blk["seconds"] += entry["seconds"]
        blk["memory_bytes"] += entry["memory_bytes"]
        if entry["kind"] == "op":
            order.setdefault(name, k)
            if entry["outputs"] and entry["outputs"][0] is not None:
                blk["acts"][entry["outputs"][0]] = blk["acts"].get(entry["outputs"][0], 0) + 1
    # Ties (a weight and a bias used by one op) break by graph position, never by dict order
    # (a saved plan's keys are sorted).
    position = {
        e["fqn"]: k for k, e in enumerate(d["nodes"]) if e["kind"] == "param" and e.get("fqn")
    }
    end = len(d["nodes"])
    use = {
        fqn: (
            first_use.get(d["nodes"][position[fqn]]["name"], end) if fqn in position else end,
            position.get(fqn, end),
            fqn,
        )
        for fqn in d["params"]
    }
    for fqn in sorted(d["params"], key=lambda f: use[f]):
        p = d["params"][fqn]
        name = block_of(p["module_path"])
        blk = raw.setdefault(name, {"params": [], "acts": {}, "seconds": 0.0, "memory_bytes": 0.0})
        order.setdefault(name, use[fqn][0])
        blk["params"].append(
            (fqn[len(name) + 1 :] if fqn.startswith(name + ".") else fqn, p["placement"])
        )
    out: list[dict[str, Any]] = []
    for name in sorted(raw, key=lambda n: order.get(n, len(d["nodes"]))):
        blk = raw[name]
        acts = sorted(blk["acts"].items(), key=lambda kv: -kv[1])
        prefix, _, index = name.rpartition(".")
        last = out[-1] if out else None
        if (
            last is not None
            and index.isdigit()
            and last["prefix"] == prefix
            and last["params"] == blk["params"]
            and last["activations"] == acts
            and int(index) == last["last"] + 1
        ):
            last["last"] = int(index)
            last["seconds"] = (last["seconds"] * last["count"] + blk["seconds"]) / (
                last["count"] + 1
            )
            last["memory_bytes"] = (last["memory_bytes"] * last["count"] + blk["memory_bytes"]) / (
                last["count"] + 1
            )
            last["count"] += 1
            last["name"] = f"{prefix}.{last['first']}-{index}"
            continue
        out.append(
            {
                "name": name,
                "prefix": prefix if index.isdigit() else None,
                "first": int(index) if index.isdigit() else None,
                "last": int(index) if index.isdigit() else None,
                "count": 1,
                "params": blk["params"],
                "activations": acts,
                "seconds": blk["seconds"],
                "memory_bytes": blk["memory_bytes"],
            }
        )
    return out


def legend(d: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """How to read the layouts, with an example taken from ``rows`` (:func:`blocks`)."""
    names = d["mesh"]["axis_names"]
    lines = [
        f"Placements: one per mesh axis ({','.join(names)}). S<k> = split along tensor dim k, "
        "R = replicated, P = partial sums (reduced where consumed)."
    ]
    acts = max((r["activations"] for r in rows), key=len, default=[])
    if acts:
        layout, count = acts[0]
        on = ", ".join(f"{p} on {a}" for p, a in zip(layout.split(","), names))
        lines.append(f"'{layout} x{count}' = {count} activations laid out {on}.")
    merged = next((r for r in rows if r["count"] > 1), None)
    if merged:
        lines.append(
            f"'{merged['name']}' = {merged['count']} alike blocks; time and memory are the mean per block."
        )
    return lines


def headline(d: dict[str, Any]) -> dict[str, Any]:
    pred = d["predicted"]
    mesh = d["mesh"]
    model = d["model"]
    segments = d["checkpoint"]["segments"]
    return {
        "model": model["name"],
        "num_params": model["num_params"],
        "num_nodes": model["num_nodes"],
        "mesh": " x ".join(f"{n}={s}" for n, s in zip(mesh["axis_names"], mesh["shape"])),
        "device": mesh["device"]["name"],
        "recipe": d["recipe"],
        "step_s": pred["step_s"],
        "compute_s": pred["breakdown"]["compute_s"],
        "comm_s": _comm_s(pred["breakdown"]),
        "recompute_s": pred["breakdown"].get("recompute_s", 0.0),
        "peak_memory_bytes": pred["peak_memory_bytes"],
        "budget_bytes": d["memory_budget_bytes"],
        "mfu": mfu(d),
        "train_flops": model.get("train_flops"),
        "compute_dtype": _PEAK_DTYPE.get(d["options"].get("mixed_precision")),
        "zero": zero_label(d["zero"]),
        "num_segments": len(segments),
        "solver": _solver_line(d["solver"]),
    }


def _solver_line(sol: dict[str, Any]) -> str:
    """'highs optimal, gap 0.00%'; with a gap, the objective and the lower bound it is from."""
    line = f"{sol['backend']} {sol['status']}, gap {sol['gap']:.2%}"
    if sol["gap"] > 0:
        line += f" (step {sol['objective_s']:.5g} s, bound {sol['bound_s']:.5g} s)"
    return line


def details(d: dict[str, Any]) -> dict[str, Any]:
    """What ``--verbose`` adds: the ZeRO stage table, every ZeRO configuration considered and why
    the chosen one won, the recomputed segments and the solver's report."""
    zero = d["zero"]
    pred = d["predicted"]
    chosen_key = per_stage_key(zero)
    per_stage = zero.get("per_stage") or {chosen_key: pred}
    return {
        # A fixed order: a saved plan's keys are sorted, a live one's are not.
        "memory_keys": sorted(
            pred["memory"], key=lambda k: (_MEMORY_ORDER.index(k) if k in _MEMORY_ORDER else 99, k)
        ),
        "per_stage": [
            {"stage": key, "chosen": key == chosen_key, **fig} for key, fig in per_stage.items()
        ],
        "considered": [{**row, "label": zero_label(row)} for row in zero.get("considered") or []],
        "zero_reason": zero.get("reason"),
        "segments": d["checkpoint"]["segments"],
        "checkpoint_mode": d["checkpoint"].get("mode", "auto"),
        "solver": d["solver"],
    }


def summary_data(d: dict[str, Any]) -> dict[str, Any]:
    """Everything the summary shows, as plain data (the terminal and the HTML report draw it)."""
    rows = blocks(d)
    return {
        "sentence": sentence(d),
        "headline": headline(d),
        "recipes": recipe_rows(d),
        "legend": legend(d, rows),
        "blocks": rows,
        "warnings": list(d["warnings"]),
        "details": details(d),
    }


def planning_note(d: dict[str, Any], *, live: bool) -> str:
    """The planning time line: this run's ('planned in ...') or the original run's, said so."""
    t = d.get("timings") or {}
    total = sum(t.values())
    parts = ", ".join(
        f"{label} {t[key]:.2f} s"
        for key, label in (
            ("capture_s", "capture"),
            ("strategies_s", "strategies"),
            ("solve_s", "solve"),
        )
        if key in t
    )
    when = "planned in" if live else "planned earlier in"
    return f"{when} {total:.2f} s" + (f" ({parts})" if parts else "")


__all__ = ["block_of", "per_stage_key", "planning_note", "sentence", "summary_data", "zero_label"]
