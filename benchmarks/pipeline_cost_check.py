"""The pipeline cost model against measured gloo steps: step time and bubble, GPipe and 1F1B.

    PYTHONPATH=. python benchmarks/pipeline_cost_check.py --world 2      # 2 stages on 2 ranks
    PYTHONPATH=. python benchmarks/pipeline_cost_check.py --world 4      # 4 stages, 4 ranks

For one world size ``p`` (2 ranks, one per core; 4 ranks oversubscribe the 2 cores):

1. ``autopar calibrate`` on ``p`` gloo ranks with a 1-D mesh named ``pp`` (so the profile
   carries the contention of ``p`` ranks on this machine), or ``--profile`` reuses one;
2. for each model (a 4-block GPT and LLaMA of width 256), schedule (GPipe, 1F1B) and
   microbatch count (2, 4, 8): ``autopar.plan(model, Mesh.spec((p,), ("pp",), profile=...),
   batch, stages=p, microbatches=m, schedule=s)``: the stage planner chooses the cuts, and the
   plan's ``pipeline.predicted`` holds the predicted step and bubble fraction;
3. one spawn of ``p`` ranks builds every plan (``autoparallelize(..., pipeline=plan.pipeline)``)
   and times ``pmodel.step`` (forward and backward of the whole schedule, the loss broadcast;
   the SGD step after it is timed apart and not part of the figure, as the plan does not price
   it): ``--reps`` repetitions of ``--steps`` steps, the configurations interleaved within each
   repetition so that load from other processes hits them alike.

Measured figures, per configuration:

- step: a step's time is the slowest rank's (a barrier before each step); a repetition's
  figure is the median over its steps; the table gives the median and min-max over
  repetitions;
- the current rate: calibration's matmul fit on every rank at once (as calibration measures
  ``peak_flops``, about 0.6 s) right before each repetition of a configuration's steps (and
  after them, kept in the JSON); calibrated over probed FLOP/s scales the stages' forward and
  backward, so "at the current rate" is the plan's schedule priced at the machine's speed of
  that moment, paired with that repetition's steps (median over repetitions); the profile was
  calibrated "calibration age" seconds before (its file's time with ``--profile``);
- ranks run in their own sessions, as calibration and torchrun run them (README "Session 9");
- bubble: per rank, ``busy`` is ``PipelineModule.busy_s``, the wall seconds inside its stage's
  microbatch forwards and backwards (``PipelineStage.forward_one_chunk`` /
  ``backward_one_chunk``); the bubble of a step is ``1 - max_r busy_r / step``: the idle share
  of the busiest rank, the quantity the plan's ``bubble_fraction`` predicts (the slowest
  stage's idle time ``sum_i t_i - max_i t_i`` over the step). The mean over ranks of
  ``1 - busy_r / step`` is printed too.

"after" is the plan's prediction (session 27: with the gaps' measured spread, ``task_gap_s``); "before" is session 26's model, the same stages and profile without it
(with ``core_wait_s``; the "at the current rate" column's before: session 24's curve, ``pipeline_terms.before_speed``). Each task's thread CPU seconds split a stage's time into its
work and its share of a core (``pipeline_terms.cpu_terms``, printed by ``cpu_text``). The measured head and tail come from timestamps (``pipeline_terms.ends_terms``):
the head from the earliest rank's start to the first forward (of it the ranks' skew leaving the
barrier); the tail from the last task's end to the last rank's end, split into the Python
before the loss broadcast, the broadcast call and the broadcast's root completing on another
rank; the model's tail is what the simulation puts after the last backward
(``pipeline_terms.model_tail_s``: the wait after the last task plus the priced broadcast).

Every task is timestamped too; a second table splits each step into its terms (the simulation
with measured compute, then gaps, then head and tail: ``benchmarks/pipeline_terms.py``).

Prints markdown tables and writes ``--out``'s JSON. ``--summary JSON...`` counts what is within
20% over such JSONs (``summary_text``); ``--reprice JSON...`` prints their main table with
today's columns (``reprice_text``); ``--fit-from JSON`` fits each configuration's stage scale
and lone-rank speed-up to its measured step and busy time (``fitted_speeds``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from autopar.models import GPT, GPTConfig, Llama, LlamaConfig
from benchmarks.pipeline_terms import (
    before_speed,
    compute_level,
    cpu_terms,
    cpu_text,
    drift_text,
    ends_terms,
    fit_text,
    level_reference_flops,
    model_tail_s,
    per_stage_text,
    record_tasks,
    summary_text,
    term_chain,
    terms_markdown,
)

WIDTH, LAYERS, VOCAB = 256, 4, 1024


def build(name: str, batch: int, seq: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A 4-block model of width 256 (untied head) and a fixed global batch."""
    torch.manual_seed(0)
    if name == "gpt":
        config = GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=LAYERS, n_head=8,
                           n_embd=WIDTH, tie_weights=False)  # fmt: skip
        model: torch.nn.Module = GPT(config)
    else:
        config = LlamaConfig(vocab_size=VOCAB, dim=WIDTH, n_layers=LAYERS, n_heads=8,
                             n_kv_heads=4, ffn_hidden=688, max_seq_len=seq)  # fmt: skip
        model = Llama(config)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (batch, seq), generator=g)
    return model, (idx, torch.roll(idx, -1, dims=1))


def plan_cases(world: int, profile: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One planned configuration per (model, schedule, microbatches), in one process."""
    import autopar

    mesh = autopar.Mesh.spec((world,), ("pp",), profile=profile)
    cases = []
    for model_name in args.models:
        for schedule in args.schedules:
            for m in args.microbatches:
                if schedule == "1f1b" and m < world:
                    continue  # torch's Schedule1F1B refuses fewer microbatches than stages
                model, batch = build(model_name, args.batch, args.seq)
                plan = autopar.plan(model, mesh, batch, stages=world, microbatches=m,
                                    schedule=schedule, optimizer="sgd",
                                    model_name=model_name)  # fmt: skip
                pipeline = plan.pipeline
                cases.append({
                    "key": f"{model_name}/{schedule}/m{m}",
                    "model": model_name, "schedule": schedule, "microbatches": m,
                    "pipeline": pipeline,
                    "predicted": dict(pipeline.predicted),
                    "stages": [dict(s.predicted, blocks=list(s.blocks)) for s in pipeline.stages],
                })  # fmt: skip
    return cases


def _gathered(values: list[float]) -> torch.Tensor:
    """``values`` of every rank: a (world, len(values)) tensor."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.stack(every)


def matmul_rate() -> float:
    """fp32 FLOP/s now as calibration measures ``peak_flops``: every rank timing calibration's
    matmul sizes (256, 512, 768) at once, mean over ranks, the through-origin fit; the single
    512^3 probe used before was not the quantity calibration fits (README, session 8). A
    barrier before each size and 2 trials of at least 0.1 s: the ranks leave a configuration's
    steps at different times, and a short probe (about 60 ms, session 9) let 4 ranks overlap
    only partly, reading fast."""
    from autopar.tools.calibration import CalibrationConfig
    from autopar.tools.timing import mean_over_ranks, time_callable
    from cost_models.calibrate import fit_rate
    from cost_models.compute import matmul_flops

    config, times = CalibrationConfig(), []
    for n in config.matmul_sizes:
        a = torch.randn(n, n)
        dist.barrier()
        times.append(time_callable(lambda a=a: a @ a, device=torch.device("cpu"),
                                   min_time_s=0.1, trials=2))  # fmt: skip
    times = mean_over_ranks(times, torch.device("cpu"))
    flops = [matmul_flops(n, n, n) for n in config.matmul_sizes]
    return fit_rate(flops, times, through_origin=True)[0]


def run_rank(rank: int, world: int, cases: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    """Build every case's module on this rank, then time them interleaved (module docstring)."""
    import autopar
    from autopar.tools.sessions import own_scheduling_group

    own_scheduling_group()  # one session per rank, as calibration and torchrun run them
    mesh = autopar.Mesh.from_world((world,), ("pp",))
    built = {}
    for case in cases:
        model, batch = build(case["model"], args.batch, args.seq)
        pmodel = autopar.autoparallelize(model, mesh, batch, pipeline=case["pipeline"],
                                         optimizer="sgd", price_baselines=False)  # fmt: skip
        opt = torch.optim.SGD(pmodel.parameters(), lr=1e-3)
        for _ in range(2):  # warm-up: first-call costs, the schedule's shape inference
            pmodel.step(*batch)
            opt.step()
            opt.zero_grad()
        built[case["key"]] = (pmodel, opt, batch)
        record_tasks(pmodel)
    out: dict[str, Any] = {key: [] for key in built}
    timelines: dict[str, list[Any]] = {key: [] for key in built}
    for _ in range(args.reps):
        for key, (pmodel, opt, batch) in built.items():
            before = matmul_rate()  # machine speed right before the steps (drift probe)
            rows = []
            for _ in range(args.steps):
                dist.barrier()
                pmodel.tasks, pmodel.phases, pmodel.task_cpu = [], [], []
                start = time.perf_counter()
                pmodel.step(*batch)
                wall = time.perf_counter() - start
                timelines[key].append(
                    [start, start + wall, pmodel.tasks, pmodel.phases, pmodel.task_cpu]
                )
                start = time.perf_counter()
                opt.step()
                opt.zero_grad()
                rows.append(_gathered([wall, pmodel.busy_s, time.perf_counter() - start]))
            # The probe after the steps too (geometric mean, kept in the JSON): the load of
            # other processes changes within seconds on a shared machine.
            rate = (before * matmul_rate()) ** 0.5
            out[key].append(dict(_repetition(rows), matmul_flops=rate, matmul_flops_before=before,
                                 at_s=time.time(), load=os.getloadavg()[0]))  # fmt: skip
    return {"measured": out, "timelines": timelines}


def _repetition(rows: list[torch.Tensor]) -> dict[str, Any]:
    """Medians over a repetition's steps (each row: per rank wall, busy, optimizer seconds)."""
    steps = [float(r[:, 0].max()) for r in rows]
    return {
        "step_s": statistics.median(steps),
        "bubble": statistics.median(1 - float(r[:, 1].max()) / s for r, s in zip(rows, steps)),
        "bubble_mean": statistics.median(
            float((1 - r[:, 1] / s).mean()) for r, s in zip(rows, steps)
        ),
        "busy_s": [statistics.median(float(r[k, 1]) for r in rows) for k in range(len(rows[0]))],
        "optimizer_s": statistics.median(float(r[:, 2].max()) for r in rows),
    }


def drift_removed(case: dict[str, Any], speed: float, busy_rank_speed: Any, task_wait_s: float,
                  *, ends: bool, core_wait_s: Any = None, task_gap_s: Any = (),
                  task_gap_by_others_s: Any = None) -> Any:  # fmt: skip
    """The plan's schedule with every stage's forward and backward scaled by ``speed``
    (calibrated matmul FLOP/s over the FLOP/s the probe measured right before the steps): the
    prediction at the machine's current rate; ``ends``: with the plan's priced head and tail
    (session 12), else without (session 11's model)."""
    from autopar.planner.pipeline_schedule import StageCost, schedule_time

    stages = [
        StageCost(forward_s=s["forward_s"] * speed, backward_s=s["backward_s"] * speed,
                  p2p_s=s["p2p_s"], step_s=s["grad_sync_s"])
        for s in case["stages"]
    ]  # fmt: skip
    head, tail = (case["predicted"].get(k, 0.0) if ends else 0.0 for k in ("head_s", "tail_s"))
    return schedule_time(
        stages, microbatches=case["microbatches"], schedule=case["schedule"],
        busy_rank_speed=busy_rank_speed, task_wait_s=task_wait_s, core_wait_s=core_wait_s,
        task_gap_s=task_gap_s, task_gap_by_others_s=task_gap_by_others_s, head_s=head, tail_s=tail,
    )  # fmt: skip


def from_measured_stages(
    case: dict[str, Any], busy_per_microbatch: list[float], task_wait_s: float
) -> Any:
    """The schedule model fed with the MEASURED stage work (busy seconds per microbatch), the
    plan's point-to-point seconds and the profile's wait per task: checks the schedule model
    apart from the compute model."""
    from autopar.planner.pipeline_schedule import StageCost, schedule_time

    stages = [
        StageCost(forward_s=busy, backward_s=0.0, p2p_s=s["p2p_s"])
        for busy, s in zip(busy_per_microbatch, case["stages"], strict=True)
    ]
    return schedule_time(stages, microbatches=case["microbatches"], schedule=case["schedule"],
                         task_wait_s=task_wait_s)  # fmt: skip


def _paired(measured: list[float], times: list[Any], *, idle: bool = False) -> float:
    """Median over repetitions of a repetition's measured step (or idle share) over the step
    (idle share) predicted at that repetition's current rate."""
    return statistics.median(
        x / ((1 - t.compute_s / t.step_s) if idle else t.step_s) for x, t in zip(measured, times)
    )


def summarize(
    cases: list[dict[str, Any]], measured: dict[str, Any], profile: Any, calibrated_at: float
) -> list[dict[str, Any]]:
    """Per configuration: the plan's prediction after and before (module docstring), each with
    the calibrated profile and at the current rate (each repetition's steps against the schedule
    priced at the rate probed right before them, median over repetitions), the measured step and
    idle share, and the schedule model fed the measured stage seconds."""
    device = profile.device
    calibrated_flops = device.peak_flops["float32"]
    speed, wait = device.busy_rank_speed, device.task_wait_s
    unleveled = before_speed(profile)
    reference = {True: level_reference_flops(profile), False: calibrated_flops}
    table = []
    for case in cases:
        reps = measured[case["key"]]
        busy = [
            statistics.median(r["busy_s"][k] for r in reps) / case["microbatches"]
            for k in range(len(reps[0]["busy_s"]))
        ]
        formula = from_measured_stages(case, busy, wait)
        before = drift_removed(case, 1.0, speed, wait, ends=True, core_wait_s=device.core_wait_s)
        factors = [calibrated_flops / r["matmul_flops_before"] for r in reps]
        now = {e: [drift_removed(case, reference[e] / r["matmul_flops_before"],
                                 speed if e else unleveled, wait, ends=True,
                                 core_wait_s=device.core_wait_s if e else None,
                                 task_gap_s=device.task_gap_s if e else (),
                                 task_gap_by_others_s=device.task_gap_by_others_s if e else None)
                   for r in reps] for e in (True, False)}  # fmt: skip
        steps = [r["step_s"] for r in reps]
        bubbles = [r["bubble"] for r in reps]
        predicted = case["predicted"]

        table.append({
            "key": case["key"],
            "blocks": [s["blocks"] for s in case["stages"]],
            "predicted_step_s": predicted["step_s"],
            "before_step_s": before.step_s,
            "before_idle": 1 - before.compute_s / before.step_s,
            "predicted_bubble": predicted["bubble_fraction"],
            "predicted_tail_s": predicted.get("tail_s", 0.0),
            "step_s": statistics.median(steps), "step_min_s": min(steps), "step_max_s": max(steps),
            "bubble": statistics.median(bubbles), "bubble_min": min(bubbles),
            "bubble_max": max(bubbles),
            "bubble_mean": statistics.median(r["bubble_mean"] for r in reps),
            "predicted_idle": 1 - predicted["compute_s"] / predicted["step_s"],
            "speed_factor": statistics.median(factors),
            "speed_factor_min": min(factors), "speed_factor_max": max(factors),
            "now_step_s": statistics.median(t.step_s for t in now[True]),
            "now_ratio": _paired(steps, now[True]), "now_ratio_before": _paired(steps, now[False]),
            "now_idle_ratio": _paired(bubbles, now[True], idle=True),
            "calibration_age_s": [r["at_s"] - calibrated_at for r in reps],
            "load": [r["load"] for r in reps],
            "busy_per_microbatch_s": busy,
            "formula_step_s": formula.step_s, "formula_bubble": formula.bubble_fraction,
            "predicted_stage_s": [s["forward_s"] + s["backward_s"] + s["p2p_s"]
                                  for s in case["stages"]],
            "optimizer_s": statistics.median(r["optimizer_s"] for r in reps),
        })  # fmt: skip
    return table


def markdown(world: int, table: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | model / schedule / m | predicted ms, after (before) | at the current rate ms |"
        " measured ms (min-max) | measured / predicted, after (before) | at the current rate,"
        " after (before) | predicted idle, after (before) | measured idle (min-max) | idle ratio,"
        " after (before; at the current rate) | head ms: measured (of it skew), priced | tail"
        " ms: measured (Python, broadcast, root), model (priced) | schedule model on measured"
        " stages: step ratio | calibrated / current matmul FLOP/s (min-max) | calibration age s |",
        "|---|---|---|---:|---|---|---|---|---|---|---|---|---:|---|---|",
    ]
    for row in table:
        step, before = row["predicted_step_s"], row["before_step_s"]
        idle, e = row["predicted_idle"], row["ends"]
        age = row["calibration_age_s"]
        lines.append(
            f"| {world} | {row['key']} | {step * 1e3:.0f} ({before * 1e3:.0f}) | "
            f"{row['now_step_s'] * 1e3:.0f} | {row['step_s'] * 1e3:.0f} "
            f"({row['step_min_s'] * 1e3:.0f}-{row['step_max_s'] * 1e3:.0f}) | "
            f"{row['step_s'] / step:.3f} ({row['step_s'] / before:.3f}) | "
            f"{row['now_ratio']:.3f} ({row['now_ratio_before']:.3f}) | {idle:.3f} "
            f"({row['before_idle']:.3f}) | {row['bubble']:.3f} ({row['bubble_min']:.3f}-"
            f"{row['bubble_max']:.3f}) | {row['bubble'] / idle:.2f} "
            f"({row['bubble'] / row['before_idle']:.2f}; {row['now_idle_ratio']:.2f}) | "
            f"{e['head_s'] * 1e3:.1f} ({e['skew_s'] * 1e3:.1f}), 0 | {e['tail_s'] * 1e3:.1f} "
            f"({e['python_s'] * 1e3:.1f}, {e['broadcast_s'] * 1e3:.1f}, {e['others_s'] * 1e3:.1f}),"
            f" {row['model_tail_s'] * 1e3:.1f} ({row['predicted_tail_s'] * 1e3:.2f}) | "
            f"{row['step_s'] / row['formula_step_s']:.2f} | {row['speed_factor']:.2f} "
            f"({row['speed_factor_min']:.2f}-{row['speed_factor_max']:.2f}) | "
            f"{min(age):.0f}-{max(age):.0f} |"
        )
    return "\n".join(lines)


def reprice_text(paths: list[str]) -> str:
    """``--reprice``: the main table of earlier ``--out`` JSONs with today's :func:`summarize`
    (their plans' stages, measured steps and the profile beside each JSON), so that a run made
    before a change of the model's columns gets them; the measured head and tail as stored."""
    from cost_models import load_profile

    out = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        world = len(data["table"][0]["busy_per_microbatch_s"])
        profile = load_profile(
            os.path.join(os.path.dirname(path), f"pipeline_profile_{world}.json")
        )
        old = {row["key"]: row for row in data["table"]}
        first = data["measured"][data["table"][0]["key"]][0]["at_s"]
        calibrated_at = first - data["table"][0]["calibration_age_s"][0]
        table = summarize(data["cases"], data["measured"], profile, calibrated_at)
        for row in table:
            row.update(ends=old[row["key"]]["ends"], model_tail_s=old[row["key"]]["model_tail_s"])
        out += [f"{path} (compute level {compute_level(profile):.3f}):", markdown(world, table)]
    return "\n".join(out)


@contextlib.contextmanager
def timing_lock(path: str | None, what: str) -> Iterator[None]:
    """Holds ``flock(path)`` (``--lock``) around ``what``, as ``flock PATH command`` would around
    the whole run, so that planning (minutes on a loaded machine, not timed) leaves the lock to
    the others; prints the wait and the hold."""
    if path is None:
        yield
        return
    asked = time.perf_counter()
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        held = time.perf_counter()
        print(f"lock for {what}: waited {held - asked:.0f} s; {_load()}", flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
            print(f"lock released after {what}: held {time.perf_counter() - held:.0f} s",
                  flush=True)  # fmt: skip


def _load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, choices=[2, 4])
    parser.add_argument("--profile", default=None, help="reuse a profile (else calibrate)")
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--summary", nargs="+", default=None, metavar="JSON",
                        help="only summarize previous --out JSONs (counts within 20%%)")  # fmt: skip
    parser.add_argument("--lock", default=None, metavar="PATH",
                        help="hold this lock file (flock) while calibrating and while timing, "
                             "not while planning (e.g. /tmp/autopar-timing.lock)")  # fmt: skip
    parser.add_argument("--fit-from", default=None, metavar="JSON",
                        help="only fit stage scale and lone speed-up to a previous --out JSON")  # fmt: skip
    parser.add_argument("--reprice", nargs="+", default=None, metavar="JSON",
                        help="only print previous --out JSONs' table with today's columns")  # fmt: skip
    args = parser.parse_args(argv)
    if args.reprice:
        print(reprice_text(args.reprice))
        return 0
    if args.fit_from:
        print(fit_text(args.fit_from))
        return 0
    if args.summary:
        print(summary_text(args.summary))
        return 0
    from autopar.runtime.spawn import spawn_ranks
    from autopar.tools.calibration import calibrate
    from cost_models import load_profile, save_profile

    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    print(f"load at start: {_load()}", flush=True)
    if args.profile:
        profile = load_profile(args.profile)
        calibrated_at = os.path.getmtime(args.profile)
    else:
        with timing_lock(args.lock, "calibration"):
            profile = calibrate((args.world,), ("pp",), nproc=args.world, verbose=False)
        calibrated_at = time.time()
        save_profile(profile, os.path.join(args.out, f"pipeline_profile_{args.world}.json"))
    cases = plan_cases(args.world, profile, args)
    print(f"planned {len(cases)} configurations in {time.perf_counter() - start:.0f} s", flush=True)
    with timing_lock(args.lock, "the timed steps"):
        ranks = spawn_ranks(run_rank, args.world, cases, args, timeout_s=1800, pg_timeout_s=600)
    measured = ranks[0]["measured"]
    timelines = {key: [list(steps) for steps in zip(*(r["timelines"][key] for r in ranks))]
                 for key in measured}  # fmt: skip
    table = summarize(cases, measured, profile, calibrated_at)
    for case, row in zip(cases, table, strict=True):
        row["terms"] = term_chain(case, timelines[case["key"]], profile.device)
        row["ends"] = ends_terms(timelines[case["key"]])
        row["model_tail_s"] = model_tail_s(case, profile.device.task_wait_s)
        row["cpu"] = cpu_terms(case, timelines[case["key"]])
    waits = (profile.meta or {}).get("measurements", {}).get("task_wait", {})
    print(f"busy_rank_speed of the profile: {dict(profile.device.busy_rank_speed)} (before: "
          f"{before_speed(profile)}; wall compute level {compute_level(profile):.3f}, at the "
          f"rounds' probed rate {waits.get('compute_level_at_round_rate')}); task_wait_s "
          f"{profile.device.task_wait_s * 1e3:.2f} ms")  # fmt: skip
    print(f"load at end: {_load()}; {time.perf_counter() - start:.0f} s in all")
    print(markdown(args.world, table))
    print(per_stage_text(table))
    print("where the step goes (benchmarks/pipeline_terms.py):")
    print(terms_markdown(args.world, [
        (r["key"], r["terms"], (profile.device.task_wait_s, r["predicted_stage_s"]))
        for r in table
    ]))  # fmt: skip
    print(drift_text(measured, profile.device))
    print(cpu_text(table, profile))
    path = os.path.join(args.out, f"pipeline_cost_check_{args.world}.json")
    with open(path, "w") as f:
        json.dump({"argv": sys.argv, "table": table, "cases": cases, "measured": measured,
                   "timelines": timelines}, f, indent=1, default=str)  # fmt: skip
    print(
        f"command: PYTHONPATH=. python benchmarks/pipeline_cost_check.py {' '.join(sys.argv[1:])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
