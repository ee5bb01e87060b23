"""Where a measured pipeline step goes, term by term, from the ranks' task timelines.

Used by ``benchmarks/pipeline_cost_check.py``: every microbatch forward and backward of every
rank is timestamped (the monotonic clock, shared by the machine's processes), so one step splits
into:

- ``forward_s`` / ``backward_s`` per stage: the mean wall seconds of its microbatch forwards and
  backwards (what ``PipelineModule.busy_s`` adds up);
- ``local_s``: per task whose input was already there, its start less the rank's previous task's
  end (the schedule's Python, posting the send and the next receive);
- ``dependency_s``: per task that waited on a neighbour, its start less that neighbour's task's
  end (the transfer, the receiver's wake-up);
- ``head_s``: the step's start to the first forward (inputs split, the schedule's set-up);
  ``tail_s``: the last task's end to the step's end (gradient reduction after the last backward,
  the loss broadcast);
- ``lone_speedup``: per rank and kind, the mean seconds of the tasks that overlapped another
  rank's task over those that ran alone (the speed-up ``busy_rank_speed`` prices).

:func:`term_chain` then replaces the plan's terms one at a time by the measured ones in the
planner's own simulation (``planner.shared_cores``), per step, and reports each step's figure:
``plan`` (the prediction), ``compute`` (measured stage seconds, no lone speed-up: they carry the
contention they met), ``gaps`` (plus the measured mean gap per task as the wait, no separate
send), ``fixed`` (plus head and tail); ``measured / fixed`` is what the terms leave unexplained
(how the task times vary along the critical path).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

from autopar.planner.pipeline_schedule import StageCost
from autopar.planner.shared_cores import shared_schedule_time
from autopar.tools.calibration_pipeline import lone_speedup, step_terms


def record_tasks(pmodel: Any) -> None:
    """Appends ``(kind, start, end)`` of each microbatch forward (``"F"``) and backward
    (``"B"``) of ``pmodel``'s stages to ``pmodel.tasks``, and that of the step's loss broadcast
    (``"L"``) to ``pmodel.phases`` (the caller empties both per step)."""

    def timed(kind: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                pmodel.tasks.append((kind, start, time.perf_counter()))
                pmodel.task_cpu.append(time.thread_time() - cpu)

        return call

    pmodel.tasks, pmodel.task_cpu = [], []
    for stage in pmodel._stages:
        stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = timed("B", stage.backward_one_chunk)
    broadcast = pmodel._broadcast_loss

    def timed_broadcast(losses: Any) -> Any:
        start = time.perf_counter()
        try:
            return broadcast(losses)
        finally:
            pmodel.phases.append(("L", start, time.perf_counter()))

    pmodel.phases = []
    pmodel._broadcast_loss = timed_broadcast


def ends_terms(steps: list[Any]) -> dict[str, float]:
    """The measured head and tail of each step (``steps[k][i] = (start, end, tasks, phases)`` of
    rank ``i``), medians over the steps, in seconds: ``head_s`` (the earliest rank's start to
    the first forward), of it ``skew_s`` (the earliest start to rank 0's: the ranks leave the
    barrier before a step at different times); ``tail_s`` (the last task's end to the last
    rank's end), split on the rank that ran the last task into ``python_s`` (to its loss
    broadcast), ``broadcast_s`` (its broadcast call) and ``others_s`` (its end to the last
    rank's end: the broadcast's root completing)."""
    rows: dict[str, list[float]] = {k: [] for k in ("head_s", "skew_s", "tail_s", "python_s",
                                                    "broadcast_s", "others_s")}  # fmt: skip
    for ranks in steps:
        start, end = min(r[0] for r in ranks), max(r[1] for r in ranks)
        last = max(range(len(ranks)), key=lambda i: ranks[i][2][-1][2])
        task_end = ranks[last][2][-1][2]
        _, a, b = next(p for p in ranks[last][3] if p[0] == "L")
        first = min(t[1] for t in ranks[0][2] if t[0] == "F")
        for key, value in (("head_s", first - start), ("skew_s", ranks[0][0] - start),
                           ("tail_s", end - task_end), ("python_s", a - task_end),
                           ("broadcast_s", b - a), ("others_s", end - ranks[last][1])):  # fmt: skip
            rows[key].append(value)
    return {k: statistics.median(v) for k, v in rows.items()}


def model_tail_s(case: dict[str, Any], task_wait_s: float) -> float:
    """What the planner's simulation puts after the last backward (stage 0's, in GPipe and
    1F1B): the half send and the wait it charges after every task (the wait stands for the
    wake-up on the loss broadcast), then the priced tail (``planner.pipeline_ends``)."""
    return case["stages"][0]["p2p_s"] / 2 + task_wait_s + case["predicted"].get("tail_s", 0.0)


def term_chain(case: dict[str, Any], steps: list[Any], device: Any) -> dict[str, Any]:
    """Per step, the plan's prediction with its terms replaced one at a time by the measured
    ones (module docstring); medians over steps, and the measured terms' medians."""
    m, schedule = case["microbatches"], case["schedule"]
    p2p = [s["p2p_s"] for s in case["stages"]]
    chain: dict[str, list[float]] = {"compute": [], "gaps": [], "fixed": [], "measured": []}
    per_step = [step_terms([r[:3] for r in ranks], schedule, m) for ranks in steps]
    for t in per_step:
        measured = [StageCost(forward_s=f, backward_s=b, p2p_s=s)
                    for f, b, s in zip(t["forward_s"], t["backward_s"], p2p, strict=True)]  # fmt: skip
        compute = shared_schedule_time(measured, microbatches=m, schedule=schedule,
                                       busy_rank_speed={}, task_wait_s=device.task_wait_s)  # fmt: skip
        bare = [StageCost(forward_s=s.forward_s, backward_s=s.backward_s) for s in measured]
        gaps = shared_schedule_time(bare, microbatches=m, schedule=schedule, busy_rank_speed={},
                                    task_wait_s=t["gap_s"])  # fmt: skip
        chain["compute"].append(compute.step_s)
        chain["gaps"].append(gaps.step_s)
        chain["fixed"].append(gaps.step_s + t["head_s"] + t["tail_s"])
        chain["measured"].append(t["step_s"])
    out: dict[str, Any] = {k: statistics.median(v) for k, v in chain.items()}
    out["residual"] = statistics.median(a / b for a, b in zip(chain["measured"], chain["fixed"]))
    for key in ("local_s", "dependency_s", "gap_s", "head_s", "tail_s"):
        out[key] = statistics.median(t[key] for t in per_step)
    for key in ("forward_s", "backward_s"):
        out[key] = [statistics.median(t[key][i] for t in per_step) for i in range(len(p2p))]
    out["lone_speedup"], out["together_ranks"] = lone_speedup(per_step)
    out["plan"] = case["predicted"]["step_s"]
    return out


def terms_markdown(world: int, rows: list[tuple[str, dict[str, Any], float]]) -> str:
    """``rows``: (configuration, :func:`term_chain`'s figures, the profile's wait per task)."""
    lines = [
        "| ranks | model / schedule / m | plan ms | with measured compute ms | with measured"
        " gaps ms | with head and tail ms | measured ms | measured / last | stage F+B ms"
        " predicted / measured | gap per task ms: local, dependency (profile's wait) |"
        " head, tail ms | lone speed-up in the run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for key, c, (wait, predicted_stage) in rows:
        stage = ", ".join(
            f"{p * 1e3:.0f}/{(f + b) * 1e3:.0f}"
            for p, f, b in zip(predicted_stage, c["forward_s"], c["backward_s"], strict=True)
        )
        lines.append(
            f"| {world} | {key} | {c['plan'] * 1e3:.0f} | {c['compute'] * 1e3:.0f} | "
            f"{c['gaps'] * 1e3:.0f} | {c['fixed'] * 1e3:.0f} | {c['measured'] * 1e3:.0f} | "
            f"{c['residual']:.2f} | {stage} | {c['local_s'] * 1e3:.1f}, "
            f"{c['dependency_s'] * 1e3:.1f} ({wait * 1e3:.1f}) | {c['head_s'] * 1e3:.1f}, "
            f"{c['tail_s'] * 1e3:.1f} | {c['lone_speedup']:.2f} |"
        )
    return "\n".join(lines)


def fitted_speeds(case: dict[str, Any], row: dict[str, Any]) -> tuple[float, float, float]:
    """``(stage scale, lone speed-up, rms log error)``: the shared-cores simulation of the plan's
    stages, their forward and backward scaled by ``stage scale`` and ``busy_rank_speed`` set to
    ``{1: lone speed-up, 2+: 1}``, fitted (grid search) to the measured step and busiest rank's
    busy seconds. Separates the level (calibrated speed) from how much faster a rank computing
    alone really runs in the pipeline (the profile's ``busy_rank_speed[1]``)."""
    step, busy = row["step_s"], (1 - row["bubble"]) * row["step_s"]
    best = (math.inf, 0.0, 0.0)
    for scale in (k / 100 for k in range(10, 151)):
        stages = [
            StageCost(forward_s=s["forward_s"] * scale, backward_s=s["backward_s"] * scale,
                      p2p_s=s["p2p_s"])
            for s in case["stages"]
        ]  # fmt: skip
        for lone in (k / 20 for k in range(20, 81)):
            sim = shared_schedule_time(stages, microbatches=case["microbatches"],
                                       schedule=case["schedule"],
                                       busy_rank_speed={"1": lone, "2": 1.0})  # fmt: skip
            err = math.log(sim.step_s / step) ** 2 + math.log(sim.compute_s / busy) ** 2
            best = min(best, (err, scale, lone))
    return best[1], best[2], math.sqrt(best[0] / 2)


def fit_text(path: str) -> str:
    """``fitted_speeds`` for every configuration of a ``--out`` JSON (``--fit-from``)."""
    with open(path) as f:
        data = json.load(f)
    cases = {c["key"]: c for c in data["cases"]}
    lines = [
        "| model / schedule / m | stage scale | lone speed-up | rms log error |",
        "|---|---|---|---|",
    ]
    for row in data["table"]:
        scale, lone, err = fitted_speeds(cases[row["key"]], row)
        lines.append(f"| {row['key']} | {scale:.2f} | {lone:.2f} | {err:.3f} |")
    return "\n".join(lines)


def summary_text(paths: list[str]) -> str:
    """Over the configurations of several ``--out`` JSONs (``--summary``): how many are within
    20% (step after and before, at the current rate, idle share), the measured head and tail
    against the model's, and how the step follows the drift probe: the least-squares slope and
    correlation of log(measured / predicted step) on log(calibrated / current matmul FLOP/s)
    over every repetition (1: the step slows down as the matmul does; the profile beside each
    JSON gives the calibrated rate)."""
    import os

    rows, xs, ys = [], [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        world = len(data["table"][0]["busy_per_microbatch_s"])
        with open(os.path.join(os.path.dirname(path), f"pipeline_profile_{world}.json")) as f:
            calibrated = json.load(f)["device"]["peak_flops"]["float32"]
        predicted = {c["key"]: c["predicted"]["step_s"] for c in data["cases"]}
        rows += data["table"]
        for key, reps in data["measured"].items():
            for rep in reps:
                xs.append(math.log(calibrated / rep["matmul_flops_before"]))
                ys.append(math.log(rep["step_s"] / predicted[key]))
    ratios = {
        "step, after": [r["step_s"] / r["predicted_step_s"] for r in rows],
        "step, before": [r["step_s"] / r["before_step_s"] for r in rows],
        "step at the current rate, after": [r["now_ratio"] for r in rows],
        "step at the current rate, before": [r["now_ratio_before"] for r in rows],
        "idle share, after": [r["bubble"] / r["predicted_idle"] for r in rows],
        "idle share, before": [r["bubble"] / r["before_idle"] for r in rows],
        "idle share at the current rate": [r["now_idle_ratio"] for r in rows],
        "step, schedule model on measured stages": [
            r["step_s"] / r["formula_step_s"] for r in rows
        ],
        "tail, measured / model": [r["ends"]["tail_s"] / r["model_tail_s"] for r in rows],
    }
    lines = [f"{len(rows)} configurations; within 20% (measured / predicted, range):"]
    for name, values in ratios.items():
        inside = sum(0.8 <= v <= 1.2 for v in values)
        lines.append(f"  {name}: {inside} of {len(values)} ({min(values):.2f}-{max(values):.2f},"
                     f" median {statistics.median(values):.2f})")  # fmt: skip

    def span(get: Any) -> str:
        values = [get(r) * 1e3 for r in rows]
        return f"{min(values):.1f}-{max(values):.1f}"

    lines.append(
        f"head ms: measured {span(lambda r: r['ends']['head_s'])} (skew "
        f"{span(lambda r: r['ends']['skew_s'])}), priced 0; tail ms: measured "
        f"{span(lambda r: r['ends']['tail_s'])} (Python {span(lambda r: r['ends']['python_s'])},"
        f" broadcast call {span(lambda r: r['ends']['broadcast_s'])}, root "
        f"{span(lambda r: r['ends']['others_s'])}), model {span(lambda r: r['model_tail_s'])} "
        f"(priced broadcast {span(lambda r: r['predicted_tail_s'])}); tail share of the step "
        f"{span(lambda r: r['ends']['tail_s'] / r['step_s'] / 1e3 * 100)}%"
    )
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    lines.append(
        f"log(measured / predicted step) on log(calibrated / current matmul FLOP/s) over "
        f"{len(xs)} repetitions: slope {slope:.2f}, correlation "
        f"{statistics.correlation(xs, ys):.2f}, intercept {math.exp(my - slope * mx):.2f}"
    )
    return "\n".join(lines)


def drift_text(measured: dict[str, Any], device: Any) -> str:
    """The drift probe against the machine's load and the run's clock: every repetition of every
    configuration, calibrated over probed matmul FLOP/s beside the 1-minute load average and the
    seconds since the first one, with the least-squares slope of the ratio over each. A load
    change (other processes) shows as a ratio that follows the load; a systematic slowdown of
    our own run (heat, memory, a leak) as one that grows with time at the same load."""
    rows = sorted((r["at_s"], r["load"], device.peak_flops["float32"] / r["matmul_flops_before"])
                  for reps in measured.values() for r in reps)  # fmt: skip
    start = rows[0][0]

    def slope(xs: list[float], ys: list[float]) -> float:
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        den = sum((x - mx) ** 2 for x in xs)
        return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0

    times, loads, ratios = ([r[k] for r in rows] for k in range(3))
    times = [t - start for t in times]
    corr = statistics.correlation(loads, ratios) if len(set(loads)) > 1 else 0.0
    # The ratio's time trend with the load's part taken out (residual after the load fit).
    per_load = slope(loads, ratios)
    residual = [r - per_load * (x - statistics.fmean(loads)) for r, x in zip(ratios, loads)]
    return (
        f"drift probe (calibrated / current matmul FLOP/s) over {len(rows)} repetitions: "
        f"{min(ratios):.2f}-{max(ratios):.2f}; load average {min(loads):.1f}-{max(loads):.1f}; "
        f"correlation with load {corr:.2f} (slope {per_load:.3f} per unit of load); trend "
        f"{slope(times, ratios) * 60:+.3f} per minute raw, {slope(times, residual) * 60:+.3f} "
        f"per minute at constant load, over {times[-1]:.0f} s"
    )


def per_stage_text(table: list[dict[str, Any]]) -> str:
    """Per stage: predicted seconds per microbatch vs measured busy seconds per microbatch."""
    lines = ["per stage, ms per microbatch: predicted (fwd+bwd+p2p) vs measured busy"]
    for row in table:
        pairs = ", ".join(
            f"{p * 1e3:.2f}/{b * 1e3:.2f}"
            for p, b in zip(row["predicted_stage_s"], row["busy_per_microbatch_s"])
        )
        lines.append(
            f"  {row['key']:22} {pairs}   (SGD step {row['optimizer_s'] * 1e3:.1f} ms; "
            f"calibrated / current matmul speed {row['speed_factor']:.2f})"
        )
    return "\n".join(lines)


def before_speed(profile: Any) -> dict[str, float]:
    """Session 24's ``busy_rank_speed`` of this profile (the check's "before"): the wall-clock
    curve calibration recorded beside the CPU one (``task_wait.wall_level_speed``, session 25);
    for an older profile, its own curve divided by its compute level (session 12's model)."""
    meta = getattr(profile, "meta", None) or {}
    wall = meta.get("measurements", {}).get("task_wait", {}).get("wall_level_speed")
    if wall is not None:
        return dict(wall)
    level = compute_level(profile)
    return {k: v / level for k, v in profile.device.busy_rank_speed.items()}


def cpu_terms(case: dict[str, Any], steps: list[Any]) -> dict[str, Any] | None:
    """The stages' work and share of a core, from each task's thread CPU seconds (``steps[k][i]
    = (start, end, tasks, phases, cpu)``; None for runs without them): ``cpu_level``, the plan's
    price of the tasks over their CPU seconds (the profile's ``cpu_compute_level`` when the work
    is priced right), and ``share`` by the number of ranks computing during a task (itself
    included, rounded): CPU over wall seconds, what the cores' sharing gave the tasks. Sums over
    tasks, not medians: a few tasks that waited long for a core weigh as they do in the step."""
    if any(len(rank) < 5 for ranks in steps for rank in ranks):
        return None
    price = cpu_total = 0.0
    shares: dict[int, list[float]] = {}
    for ranks in steps:
        spans = [(i, kind, a, b, cpu) for i, rank in enumerate(ranks)
                 for (kind, a, b), cpu in zip(rank[2], rank[4], strict=True)]  # fmt: skip
        for i, kind, a, b, cpu in spans:
            if cpu <= 0 or b <= a:
                continue
            overlap = sum(max(0.0, min(b, d) - max(a, c)) for j, _, c, d, _ in spans if j != i)
            price += case["stages"][i]["forward_s" if kind == "F" else "backward_s"]
            cpu_total += cpu
            bucket = shares.setdefault(round(1 + overlap / (b - a)), [0.0, 0.0])
            bucket[0] += cpu
            bucket[1] += b - a
    return {
        "cpu_level": price / cpu_total,
        "share": {k: min(1.0, c / w) for k, (c, w) in sorted(shares.items())},
    }


def cpu_text(table: list[dict[str, Any]], profile: Any) -> str:
    """Per configuration: the stages' price over CPU seconds against the profile's CPU level,
    and the share of a core by ranks computing against the profile's curve over that level."""
    meta = (getattr(profile, "meta", None) or {}).get("measurements", {}).get("task_wait", {})
    level = meta.get("cpu_compute_level")
    speed = profile.device.busy_rank_speed
    lines = [f"work and sharing (thread CPU seconds): profile CPU level {level}, other runnable "
             f"threads {meta.get('foreign_threads')}, cores {meta.get('cores')}",
             "| model / schedule / m | stages' price / CPU s | share of a core by ranks computing:"
             " measured (model) |", "|---|---:|---|"]  # fmt: skip
    for row in table:
        got = row.get("cpu")
        if got is None:
            continue
        model = {k: speed.get(str(k), 0.0) / level if level else float("nan") for k in got["share"]}
        shares = ", ".join(f"{k}: {v:.2f} ({model[k]:.2f})" for k, v in got["share"].items())
        lines.append(f"| {row['key']} | {got['cpu_level']:.2f} | {shares} |")
    return "\n".join(lines)


def compute_level(profile: Any) -> float:
    """The compute level ``autopar calibrate`` multiplied the profile's ``busy_rank_speed`` by
    (``meta.measurements.task_wait.compute_level``, clamped as calibration clamps it); 1.0 for
    a profile without one (before session 13, presets)."""
    from autopar.tools.calibration_pipeline import LEVEL_RANGE

    meta = getattr(profile, "meta", None) or {}
    level = meta.get("measurements", {}).get("task_wait", {}).get("compute_level")
    return 1.0 if level is None else min(max(level, LEVEL_RANGE[0]), LEVEL_RANGE[1])


def level_reference_flops(profile: Any) -> float:
    """The matmul FLOP/s at which calibration took the profile's compute level: the median of
    the rate probed before each of its pipeline rounds (``rounds[i].matmul_flops``, session 13)
    where recorded, else the profile's ``peak_flops`` (which the level is priced against). The
    check's "at the current rate" scales the levelled model by this over the current rate: the
    level already holds the speed of its moment, so the peak would count the drift since the
    peak was timed twice."""
    meta = getattr(profile, "meta", None) or {}
    rounds = meta.get("measurements", {}).get("task_wait", {}).get("rounds", [])
    rates = [r.get("matmul_flops") for r in rounds]
    if rates and all(rates):
        return statistics.median(rates)
    return profile.device.peak_flops["float32"]
