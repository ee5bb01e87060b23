"""Text for pipelined plans and stage searches: the stages, where the time goes, the ranked
table of candidates. Reads only the plan JSON (a loaded plan prints like a live one)."""

from __future__ import annotations

from typing import Any

from autopar.options import format_bytes, format_seconds


def search_table(search: dict[str, Any], *, limit: int = 12) -> list[str]:
    """The ranked table of ``stage_search`` (fastest first), with megatron-3d and the best
    plan without stages."""
    rows = list(search["candidates"][:limit])
    extra = [("megatron-3d", search.get("megatron_3d")), ("no stages", search.get("no_stages"))]
    header = (
        f"{'':12} {'mesh pp x dp x tp':>18} {'stages':>6} {'microbatches':>12} {'schedule':>17} "
        f"{'step':>12} {'peak memory':>12} {'bubble':>7}"
    )
    accumulate = search.get("accumulate", 1)
    lines = (
        [
            f"No pipeline stages: this plan is for one microbatch of 1/{accumulate} of the batch, run "
            f"{accumulate} times per optimizer step (gradient accumulation)"
        ]
        if accumulate > 1
        else []
    )
    lines += [
        f"Stage search: {len(search['candidates'])} candidates kept, "
        f"{search.get('probes', 0)} intra-op ILPs, {search.get('seconds', 0.0):.1f} s",
        header,
    ]
    labelled = [(f"#{k + 1}", row) for k, row in enumerate(rows)]
    labelled += [(label, row) for label, row in extra if row is not None]
    for label, row in labelled:
        mesh = "x".join(map(str, row["mesh"]))
        stages = row["stages"] * row.get("virtual_stages", 1)
        lines.append(
            f"{label:12} {mesh:>18} {stages:>6} {row['microbatches']:>12} {row['schedule']:>17} "
            f"{format_seconds(row['step_s']):>12} {format_bytes(row['peak_memory_bytes']):>12} "
            f"{row.get('bubble_fraction', 0.0):>7.1%}"
        )
    return lines


def pipeline_summary(d: dict[str, Any]) -> str:
    """The summary of a pipelined plan: headline, time breakdown, stages, the recipes priced
    alongside and the search's table."""
    pipe = d["pipeline"]
    mesh = "x".join(map(str, d["mesh"]["shape"]))
    predicted = d["predicted"]
    step = predicted["step_s"]
    schedule = pipe["schedule"]
    if pipe.get("virtual_stages", 1) > 1:
        schedule += f" ({pipe['virtual_stages']} virtual stages per rank)"
    ranks = d["mesh"]["shape"][0]
    lines = [
        f"{d['model']['name']}: {ranks} pipeline stages x {pipe['microbatches']} microbatches, "
        f"{schedule}, on mesh pp x dp x tp = {mesh} ({d['mesh']['device']['name']})",
        f"Predicted step {format_seconds(step)}, peak memory "
        f"{format_bytes(predicted['peak_memory_bytes'])} per device (budget "
        f"{format_bytes(d['memory_budget_bytes'])})",
    ]
    b = predicted["breakdown"]
    parts = [
        ("compute", b["compute_s"]),
        ("bubble", b.get("pipeline_bubble_s", 0.0)),
        ("p2p", b.get("p2p_s", 0.0)),
        ("collectives", b["grad_sync_s"]),
    ]
    lines.append(
        "Where the time goes: "
        + ", ".join(f"{name} {format_seconds(s)} ({s / step:.1%})" for name, s in parts if step)
    )
    lines.append("")
    lines.append(
        f"{'stage':>5} {'blocks':>9} {'ranks':>13} {'fwd/mb':>11} {'bwd/mb':>11} {'p2p/mb':>11} "
        f"{'ZeRO':>4} {'recomp.':>7} {'in flight':>9} {'peak':>11}"
    )
    stack = pipe["stack"]
    for stage in pipe["stages"]:
        p = stage.get("predicted", {})
        first, last = stage["blocks"]
        ranks_text = f"{stage['ranks'][0]}-{stage['ranks'][-1]}" if stage.get("ranks") else "-"
        lines.append(
            f"{stage['index']:>5} {f'{first}-{last - 1}':>9} {ranks_text:>13} "
            f"{format_seconds(p.get('forward_s', 0.0)):>11} "
            f"{format_seconds(p.get('backward_s', 0.0)):>11} "
            f"{format_seconds(p.get('p2p_s', 0.0)):>11} {int(p.get('zero_stage', 0)):>4} "
            f"{int(p.get('recomputed_blocks', 0)):>7} {int(p.get('in_flight', 0)):>9} "
            f"{format_bytes(p.get('peak_memory_bytes', 0.0)):>11}"
        )
    lines.append(
        f"(blocks of {stack}; cuts at {', '.join(s['first_fqn'] for s in pipe['stages'][1:])})"
    )
    if d.get("baselines"):
        lines.append("")
        for name, base in d["baselines"].items():
            ratio = base["step_s"] / step if step else float("nan")
            lines.append(
                f"{name}: step {format_seconds(base['step_s'])} ({ratio:.2f}x the plan), peak "
                f"{format_bytes(base['peak_memory_bytes'])}, mesh "
                f"{'x'.join(map(str, base.get('mesh', [])))}, {base.get('microbatches', 1)} "
                f"microbatches, {base.get('schedule', '-')}"
            )
    if d.get("warnings"):
        lines.append("")
        lines.append(f"Warnings ({len(d['warnings'])}):")
        lines.extend(f"- {w}" for w in d["warnings"])
    if d.get("stage_search"):
        lines.append("")
        lines.extend(search_table(d["stage_search"]))
    return "\n".join(lines)
