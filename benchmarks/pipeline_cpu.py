"""Pipeline cost model checked at the ranks' CPU share (issue 15, session 15).

The same plans as ``benchmarks/pipeline_cost_check.py`` (a 4-block GPT and LLaMA of width 256,
global batch 16 x seq 128, SGD; GPipe and 1F1B; 2/4/8 microbatches; ``stages = ranks``), with a
profile calibrated in the same run (``--profile`` reuses one), run in one spawn, configurations
interleaved within each of ``--reps`` repetitions of ``--steps`` steps.

On 2 cores shared by 2-4 ranks and other users, a stage's wall seconds are its CPU seconds
over the share of a core its rank got, and that share moves within seconds. The profile's
``cpu_compute_level`` (``autopar.tools.calibration_level``) says how many thread CPU seconds
the planner's price of a task stands for; the steps record each rank's thread CPU seconds and
wall seconds inside its stage's microbatch forwards and backwards. Per repetition:

- **at the steps' CPU share**: the plan's stages, each forward and backward priced at
  ``t / cpu_level / share_i`` (``share_i``: rank ``i``'s CPU seconds over wall seconds in its
  tasks during that repetition), the plan's sends, the profile's wait per task, head and tail,
  simulated by the planner's ``schedule_time`` without the busy-rank curve (the share already
  is what the ranks got); measured step over that, median over repetitions;
- **raw**: measured over the plan's own predicted step (the profile's wall rates);
- bubble: predicted ``1 - compute / step`` of the priced schedule (``predicted idle`` in
  ``pipeline_cost_check``), measured ``1 - max_r busy_r / step``.

``PYTHONPATH=. python benchmarks/pipeline_cpu.py --world 2 --lock /tmp/autopar-timing.lock``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.pipeline_cost_check import _gathered, _load, build, plan_cases, timing_lock

WITHIN = 0.2
OPS, LEVEL = "ops", "level"
"""The two ways of turning a priced second into CPU seconds: the share of a core calibration's
op timings ran at (``ops_cpu_share``), or the calibration pipeline's tasks' level
(``1 / cpu_compute_level``)."""


def record_task_cpu(pmodel: Any) -> None:
    """Adds each microbatch forward's and backward's thread CPU seconds and wall seconds of
    ``pmodel``'s stages to ``pmodel.task_cpu = [cpu_s, wall_s]`` (the caller resets it)."""

    def timed(method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                pmodel.task_cpu[0] += time.thread_time() - cpu
                pmodel.task_cpu[1] += time.perf_counter() - start

        return call

    pmodel.task_cpu = [0.0, 0.0]
    for stage in pmodel._stages:
        stage.forward_one_chunk = timed(stage.forward_one_chunk)
        stage.backward_one_chunk = timed(stage.backward_one_chunk)


def run_rank(rank: int, world: int, cases: list[dict[str, Any]], args: Any) -> dict[str, Any]:
    """Builds every case's module on this rank, then times them interleaved; per step and rank:
    the step's wall seconds, ``busy_s`` and the tasks' CPU and wall seconds."""
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
        record_task_cpu(pmodel)
        built[case["key"]] = (pmodel, opt, batch)
    out: dict[str, Any] = {key: [] for key in built}
    for _ in range(args.reps):
        for key, (pmodel, opt, batch) in built.items():
            rows = []
            for _ in range(args.steps):
                dist.barrier()
                pmodel.task_cpu[:] = [0.0, 0.0]
                start = time.perf_counter()
                pmodel.step(*batch)
                wall = time.perf_counter() - start
                opt.step()
                opt.zero_grad()
                rows.append(_gathered([wall, pmodel.busy_s, *pmodel.task_cpu]).tolist())
            out[key].append({"rows": rows, "at_s": time.time(), "load": os.getloadavg()[0]})
    return {"measured": out}


def repetition_figures(rows: Sequence[Sequence[Sequence[float]]]) -> dict[str, Any]:
    """A repetition's figures from its steps' rows (per rank: step wall, busy, task CPU, task
    wall): the median step (slowest rank), the median measured idle share and each rank's CPU
    share in its tasks over the repetition (CPU seconds over wall seconds, summed over steps)."""
    from autopar.tools.calibration_level import cpu_share

    steps = [max(r[0] for r in step) for step in rows]
    idle = [1 - max(r[1] for r in step) / s for step, s in zip(rows, steps, strict=True)]
    ranks = range(len(rows[0]))
    shares = [
        cpu_share(sum(step[i][2] for step in rows), sum(step[i][3] for step in rows)) for i in ranks
    ]
    return {"step_s": statistics.median(steps), "idle": statistics.median(idle), "shares": shares}


def priced_at_share(
    case: Mapping[str, Any],
    shares: Sequence[float],
    cpu_per_priced: float,
    task_wait_s: float,
) -> Any:
    """The plan's schedule with stage ``i``'s forward and backward at ``t x cpu_per_priced /
    shares[i]`` (module docstring: the CPU seconds a priced second stands for, at the share of
    a core rank ``i``'s tasks got), its sends, the wait per task and the plan's head and tail."""
    from autopar.planner.pipeline_schedule import StageCost, schedule_time

    stages = [
        StageCost(
            forward_s=s["forward_s"] * cpu_per_priced / share,
            backward_s=s["backward_s"] * cpu_per_priced / share,
            p2p_s=s["p2p_s"],
            step_s=s["grad_sync_s"],
        )
        for s, share in zip(case["stages"], shares, strict=True)
    ]
    predicted = case["predicted"]
    return schedule_time(
        stages, microbatches=case["microbatches"], schedule=case["schedule"],
        task_wait_s=task_wait_s, head_s=predicted.get("head_s", 0.0),
        tail_s=predicted.get("tail_s", 0.0),
    )  # fmt: skip


def summarize(
    cases: Sequence[Mapping[str, Any]],
    measured: Mapping[str, Any],
    cpu_per_priced: Mapping[str, float],
    task_wait_s: float,
) -> list[dict[str, Any]]:
    """Per configuration: predicted (at each repetition's share, for each way of turning the
    profile's prices into CPU seconds, ``cpu_per_priced``; raw) and measured step and idle
    share, their ratios (median over repetitions of a repetition's ratio)."""
    table = []
    for case in cases:
        reps = [repetition_figures(r["rows"]) for r in measured[case["key"]]]
        steps = [r["step_s"] for r in reps]
        by_way = {}
        for way, factor in cpu_per_priced.items():
            priced = [priced_at_share(case, r["shares"], factor, task_wait_s) for r in reps]
            by_way[way] = {
                "predicted_s": statistics.median(t.step_s for t in priced),
                "ratio": statistics.median(r["step_s"] / t.step_s for r, t in zip(reps, priced)),
                "predicted_idle": statistics.median(1 - t.compute_s / t.step_s for t in priced),
            }
        table.append({
            "key": case["key"],
            "blocks": [s["blocks"] for s in case["stages"]],
            **by_way[OPS], "by_way": by_way,
            "step_s": statistics.median(steps), "step_min_s": min(steps),
            "step_max_s": max(steps),
            "raw_predicted_s": case["predicted"]["step_s"],
            "raw_ratio": statistics.median(steps) / case["predicted"]["step_s"],
            "predicted_bubble": case["predicted"]["bubble_fraction"],
            "idle": statistics.median(r["idle"] for r in reps),
            "shares": [statistics.median(r["shares"][i] for r in reps)
                       for i in range(len(reps[0]["shares"]))],
            "load": [r["load"] for r in measured[case["key"]]],
        })  # fmt: skip
    return table


def markdown(world: int, table: Sequence[Mapping[str, Any]]) -> str:
    lines = [
        "| ranks | model / schedule / m | cuts | predicted ms at the CPU share: ops (level) | "
        "measured ms (min-max) | measured / predicted: ops (level) | raw: predicted ms, ratio | "
        "predicted bubble | predicted idle: ops | measured idle | CPU share per rank |",
        "|---|---|---|---|---|---|---|---:|---:|---:|---|",
    ]
    for r in table:
        cuts = "+".join(str(len(b)) for b in r["blocks"])
        level = r["by_way"][LEVEL]
        lines.append(
            f"| {world} | {r['key']} | {cuts} | {r['predicted_s'] * 1e3:.0f} "
            f"({level['predicted_s'] * 1e3:.0f}) | {r['step_s'] * 1e3:.0f} "
            f"({r['step_min_s'] * 1e3:.0f}-{r['step_max_s'] * 1e3:.0f}) | {r['ratio']:.2f} "
            f"({level['ratio']:.2f}) | {r['raw_predicted_s'] * 1e3:.0f}, {r['raw_ratio']:.2f} | "
            f"{r['predicted_bubble']:.3f} | {r['predicted_idle']:.3f} | {r['idle']:.3f} | "
            + ", ".join(f"{s:.2f}" for s in r["shares"])
            + " |"
        )
    n = len(table)
    hits = {w: sum(abs(r["by_way"][w]["ratio"] - 1) <= WITHIN for r in table) for w in (OPS, LEVEL)}
    raw = sum(abs(r["raw_ratio"] - 1) <= WITHIN for r in table)
    lines.append(
        f"\nwithin 20%: {hits[OPS]} of {n} at the CPU share (ops), {hits[LEVEL]} of {n} "
        f"(level); raw {raw} of {n}"
    )
    return "\n".join(lines)


def cpu_per_priced(profile: Any) -> dict[str, float]:
    """The profile's two conversions of a priced second into CPU seconds (``OPS``, ``LEVEL``),
    from what calibration recorded (``meta.measurements.task_wait``)."""
    waits = (profile.meta or {}).get("measurements", {}).get("task_wait", {})
    if waits.get("cpu_compute_level") is None or waits.get("ops_cpu_share") is None:
        raise ValueError(
            "the profile has no cpu_compute_level / ops_cpu_share (calibrated before session "
            "15): calibrate again (drop --profile) to record the thread CPU seconds"
        )
    return {OPS: waits["ops_cpu_share"], LEVEL: 1.0 / waits["cpu_compute_level"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, choices=[2, 4])
    parser.add_argument("--profile", default=None, help="reuse a profile (else calibrate)")
    parser.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/out")
    parser.add_argument("--lock", default=None, metavar="PATH",
                        help="flock this file while calibrating and while timing")  # fmt: skip
    args = parser.parse_args(argv)
    from autopar.runtime.spawn import spawn_ranks
    from autopar.tools.calibration import calibrate
    from cost_models import load_profile, save_profile

    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    print(f"load at start: {_load()}", flush=True)
    if args.profile:
        profile = load_profile(args.profile)
    else:
        with timing_lock(args.lock, "calibration"):
            profile = calibrate((args.world,), ("pp",), nproc=args.world, verbose=False)
        save_profile(profile, os.path.join(args.out, f"pipeline_cpu_profile_{args.world}.json"))
    factors = cpu_per_priced(profile)
    cases = plan_cases(args.world, profile, args)
    print(f"planned {len(cases)} configurations in {time.perf_counter() - start:.0f} s", flush=True)
    with timing_lock(args.lock, "the timed steps"):
        ranks = spawn_ranks(run_rank, args.world, cases, args, timeout_s=1800, pg_timeout_s=600)
    measured = ranks[0]["measured"]
    path = os.path.join(args.out, f"pipeline_cpu_{args.world}.json")
    with open(path, "w") as f:  # the steps first: a summary that fails keeps them
        json.dump({"argv": sys.argv, "measured": measured, "cases": cases}, f, default=str)
    table = summarize(cases, measured, factors, profile.device.task_wait_s)
    waits = profile.meta["measurements"]["task_wait"]
    print(f"profile: CPU seconds per priced second {factors}; calibration pipeline's CPU share "
          f"{waits['cpu_share']:.3f}; task_wait_s {profile.device.task_wait_s * 1e3:.2f} ms, matmul "
          f"{profile.device.peak_flops['float32'] / 1e9:.1f} GFLOP/s")  # fmt: skip
    print(f"load at end: {_load()}; {time.perf_counter() - start:.0f} s in all")
    print(markdown(args.world, table))
    with open(path, "w") as f:
        json.dump({"argv": sys.argv, "table": table, "measured": measured,
                   "cpu_per_priced": factors, "cases": cases}, f, indent=1, default=str)  # fmt: skip
    print(f"command: PYTHONPATH=. python benchmarks/pipeline_cpu.py {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
