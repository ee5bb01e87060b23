"""Calibration of a pipeline's per-task wait (``DeviceSpec.task_wait_s``) and of how much faster
its lone tasks run (``busy_rank_speed``) on CPU ranks.

A pipeline rank does more than compute and send: between two of its tasks (one microbatch's
forward or backward) it waits to be woken by the receive it posted, gloo's threads run, and the
schedule's Python picks the next action. On ranks that share cores under load this was 7-11 ms
per task (README, "Session 9"), more than the transfer the link's ``broadcast`` fit prices.

Measured as it happens: every rank of the job runs one stage of a short GPipe pipeline
(torch's ``PipelineStage`` and ``ScheduleGPipe``, as :mod:`autopar.runtime.pipeline` drives
them) whose stage is ``PIPELINE_LAYERS`` ``width x width`` linear layers at ``rows`` rows per
microbatch, with ``width`` calibration's largest matmul size (tasks of 10-30 ms here, the order
of a small model's stage). Every task's start and end are recorded on every rank (the
monotonic clock the machine's processes share), so each step splits into its terms
(:func:`step_terms`): the compute per task, the gap before each task (after the rank's own
previous task, or after the neighbour's task it waited for), the head and the tail.

- The wait is the measured mean gap less the half of a stage's priced sends that the
  simulation charges beside it after every task (session 10 fitted the wait to the step
  instead, which made it absorb every other error of the simulated step; that figure is kept
  as ``fitted_task_wait_s``).
- The lone speed-up is how much longer a task overlapped by other ranks' tasks took than one
  that ran alone (:func:`lone_speedup`); :func:`pipeline_busy_rank_speed` scales calibration's
  probe (a matmul timed for seconds with ``k`` ranks computing) to it: the probe measured 1.3-2.1
  alone on 2 ranks while the pipelines ran their lone tasks 1.0-1.5x faster (README, "Session
  11").
- The compute level (session 13) is how fast the pipeline's tasks ran against the planner's
  own price of them (each linear's roofline on the profile being written, every rank busy) at
  the speed that curve gives the ranks computing during them (:func:`pipeline_compute_level`);
  ``busy_rank_speed`` is multiplied by it, so the simulation prices a stage at the speed a
  pipeline's tasks meet, not at the speed of calibration's single ops timed in a hot loop with
  every rank busy (1.2-1.6x slower on 2 ranks here, README "Session 13").

- Session 25: where the rounds recorded thread CPU seconds, ``busy_rank_speed`` is instead the
  tasks' CPU level (the planner's price over CPU seconds: within 0.87-1.10x of the checked
  stages' in 3 of 4 runs, README "Session 25") times each count's share of the cores,
  ``min(1, cores / (k + g))`` with ``g`` the other processes' runnable threads at the quietest round
  (``calibration_level.foreign_threads``, ``shared_core_speed``): the wall-clock curve above
  carried the share of calibration's moment in three fitted factors; it is kept, recorded
  only, as ``wall_level_speed``. Session 26: the wait for a core (:mod:`calibration_wake`).

Median over rounds of a few steps. GPUs and one rank: not measured (0, the probe's speeds).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopar.tools.calibration_level import (
    CPU_LEVEL_RANGE,
    cpu_compute_level,
    foreign_threads,
    gather_task_cpu,
    round_cpu_figures,
    round_cpu_share,
    shared_core_speed,
    timed_task,
)
from autopar.tools.calibration_rates import matmul_cpu_share, matmul_rate_now, priced_stage_tasks
from autopar.tools.calibration_wake import core_wait_figures
from solver.parallel import usable_cores  # the cores the ranks of a CPU job share

__all__ = ["matmul_rate_now", "priced_stage_tasks"]  # moved; importable from here as before

PIPELINE_ROWS = 128
"""Rows per microbatch of the calibration pipeline (its activation: ``rows x width`` fp32,
about 390 KiB at width 768, the size of a small model's stage boundary)."""
PIPELINE_MICROBATCHES = 8
"""Session 29 (was 4): at 8 its gaps match the check's pipelines' (mean 2.1 ms, 97.5th 11 ms)."""
PIPELINE_LAYERS = 4
"""Linear layers per stage: tasks of about 10-30 ms at width 768 on these cores, the order of
the stages the pipeline check runs (1-2 transformer blocks of width 256 at 2-8 rows x 128)."""


def _timed_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """Records the span of each microbatch forward and backward in ``spans``."""

        spans: list[tuple[str, float, float]]

        def forward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return timed_task(
                self, "F", lambda: super(TimedStage, self).forward_one_chunk(*args, **kwargs)
            )

        def backward_one_chunk(self, *args: Any, **kwargs: Any) -> Any:
            return timed_task(
                self, "B", lambda: super(TimedStage, self).backward_one_chunk(*args, **kwargs)
            )

    return TimedStage


def fit_task_wait(
    step_s: float,
    forward_s: list[float],
    backward_s: list[float],
    p2p_s: list[float],
    *,
    microbatches: int,
    schedule: str = "gpipe",
) -> float:
    """The ``task_wait_s`` that makes the simulated step of stages with these per-microbatch
    seconds equal ``step_s`` (0 if it is shorter already); bisection to 1e-7 s."""
    from autopar.planner.pipeline_schedule import StageCost
    from autopar.planner.shared_cores import shared_schedule_time

    stages = [
        StageCost(forward_s=f, backward_s=b, p2p_s=s)
        for f, b, s in zip(forward_s, backward_s, p2p_s, strict=True)
    ]

    def simulated(wait: float) -> float:
        return shared_schedule_time(
            stages, microbatches=microbatches, schedule=schedule, busy_rank_speed={},
            task_wait_s=wait,
        ).step_s  # fmt: skip

    low, high = 0.0, step_s
    if simulated(low) >= step_s:
        return 0.0
    while high - low > 1e-7:
        mid = (low + high) / 2
        low, high = (mid, high) if simulated(mid) < step_s else (low, mid)
    return (low + high) / 2


def step_terms(ranks: list[Any], schedule: str, microbatches: int) -> dict[str, Any]:
    """One measured step of a GPipe or 1F1B pipeline split into its terms: ``ranks[i] =
    (start, end, tasks)`` of rank ``i`` (stage ``i``), ``tasks`` its ``(kind, start, end)`` in
    the order it ran them (``"F"``/``"B"``, the shared monotonic clock). Returns seconds:
    ``forward_s`` / ``backward_s`` per stage (mean per task); ``local_s``, the mean gap before a
    task whose input was there (the rank's previous task's end to its start: the schedule's
    Python, posting sends and receives); ``dependency_s``, the mean gap before a task that
    waited on a neighbour (that neighbour's task's end to its start: transfer and wake-up);
    ``gap_s`` over both; ``head_s`` (step start to the first forward) and ``tail_s`` (last
    task's end to the step's end); ``alone``: per task (rank, kind, seconds, share of it
    overlapped by other ranks' tasks)."""
    from autopar.planner.shared_cores import rank_order

    p, m = len(ranks), microbatches
    start, end = min(r[0] for r in ranks), max(r[1] for r in ranks)
    spans = {}
    for i, (_, _, tasks) in enumerate(ranks):
        for (kind, j), (got, a, b) in zip(rank_order(schedule, i, p, m), tasks, strict=True):
            assert got == kind, f"rank {i} ran {got} where the schedule's order has {kind}"
            spans[(kind, i, j)] = (a, b)
    dependency, local = [], []
    for i in range(p):
        previous = None
        for kind, j in rank_order(schedule, i, p, m):
            a, _ = spans[(kind, i, j)]
            before = spans.get((kind, i - 1 if kind == "F" else i + 1, j))
            if before is not None and (previous is None or before[1] > previous):
                dependency.append(a - before[1])
            elif previous is not None:
                local.append(a - previous)
            previous = spans[(kind, i, j)][1]

    def mean_of(kind: str, i: int) -> float:
        seconds = [b - a for (k, r, _), (a, b) in spans.items() if (k, r) == (kind, i)]
        return statistics.fmean(seconds)

    return {
        "step_s": end - start,
        "forward_s": [mean_of("F", i) for i in range(p)],
        "backward_s": [mean_of("B", i) for i in range(p)],
        "local_s": statistics.fmean(local) if local else 0.0,
        "dependency_s": statistics.fmean(dependency),
        "gap_s": statistics.fmean(local + dependency),
        "head_s": spans[("F", 0, 0)][0] - start,
        "tail_s": end - max(b for _, b in spans.values()),
        "alone": _alone_and_together(spans),
    }


def _alone_and_together(spans: dict[tuple[str, int, int], tuple[float, float]]) -> list[Any]:
    """Per task: (rank, kind, seconds, share of it overlapped by other ranks' tasks, mean
    number of ranks computing during it, itself included)."""
    out = []
    for (kind, i, _), (a, b) in spans.items():
        overlap = [(max(a, c), min(b, d)) for (_, r, _), (c, d) in spans.items() if r != i]
        overlap = [(x, y) for x, y in overlap if y > x]
        seconds = b - a
        if seconds <= 0:
            continue
        ranks = 1 + sum(y - x for x, y in overlap) / seconds  # a rank runs one task at a time
        out.append((i, kind, seconds, _union_length(overlap) / seconds, ranks))
    return out


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def lone_speedup(per_step: list[dict[str, Any]]) -> tuple[float, float]:
    """How much faster a pipeline's task runs alone: per (rank, kind), the mean seconds of its
    tasks overlapped over 90% by other ranks' tasks over the mean of those overlapped under 10%
    (alone); the median over the (rank, kind) pairs that have both, and the mean number of ranks
    computing during the overlapped tasks. ``(nan, nan)`` where no pair has both."""
    groups: dict[tuple[int, str], tuple[list[float], list[float], list[float]]] = {}
    for terms in per_step:
        for rank, kind, seconds, shared, ranks in terms["alone"]:
            alone, together, counts = groups.setdefault((rank, kind), ([], [], []))
            if shared < 0.1:
                alone.append(seconds)
            elif shared > 0.9:
                together.append(seconds)
                counts.append(ranks)
    pairs = [(statistics.fmean(t) / statistics.fmean(a), statistics.fmean(c))
             for a, t, c in groups.values() if a and t]  # fmt: skip
    if not pairs:
        return math.nan, math.nan
    return statistics.median(r for r, _ in pairs), statistics.fmean(c for _, c in pairs)


def round_figures(
    timelines: list[list[Any]], p2p_s: list[float], *, microbatches: int, schedule: str = "gpipe"
) -> dict[str, Any]:
    """One calibration round's figures from its steps' timelines (:func:`step_terms`' input;
    ``p2p_s`` the priced sends per microbatch of each stage): medians over the steps of the
    step, per-stage forward and backward, the gaps and the lone speed-up, and the wait,
    ``task_wait_s``: the measured mean gap between tasks less the half of a stage's sends the
    simulation charges after every task beside it (at least 0). ``fitted_task_wait_s`` is
    session 10's figure, the wait that makes the simulated step equal the measured one."""
    terms = [step_terms(ranks, schedule, microbatches) for ranks in timelines]
    p = len(p2p_s)
    step = statistics.median(t["step_s"] for t in terms)
    forward = [statistics.median(t["forward_s"][r] for t in terms) for r in range(p)]
    backward = [statistics.median(t["backward_s"][r] for t in terms) for r in range(p)]
    gap = statistics.median(t["gap_s"] for t in terms)
    speedup, together = lone_speedup(terms)
    concurrency = {kind: [statistics.median(_mean_ranks(t["alone"], r, kind) for t in terms)
                          for r in range(p)] for kind in "FB"}  # fmt: skip
    return {
        "step_s": step, "forward_s": forward, "backward_s": backward, "gap_s": gap,
        "task_wait_s": max(0.0, gap - statistics.fmean(p2p_s) / 2),
        "fitted_task_wait_s": fit_task_wait(step, forward, backward, p2p_s,
                                            microbatches=microbatches, schedule=schedule),
        "local_s": statistics.median(t["local_s"] for t in terms),
        "dependency_s": statistics.median(t["dependency_s"] for t in terms),
        # None (JSON null) where no task ran both alone and overlapped in the round.
        "lone_speedup": None if math.isnan(speedup) else speedup,
        "together_ranks": None if math.isnan(together) else together,
        # Mean ranks computing during each stage's forwards and backwards (itself included).
        "forward_ranks": concurrency["F"], "backward_ranks": concurrency["B"],
    }  # fmt: skip


def _mean_ranks(alone: list[Any], rank: int, kind: str) -> float:
    """Mean over ``rank``'s tasks of ``kind`` of the number of ranks computing during each
    (``step_terms``' ``alone``). Unweighted: the seconds per unit of work ``speed_at``
    interpolates are linear in the count, so a stage's mean task seconds is its work times the
    seconds per unit at this mean (within one interval of measured counts)."""
    return statistics.fmean(n for r, k, _, _, n in alone if (r, k) == (rank, kind))


def measure_task_wait(
    width: int,
    links: Mapping[str, Any],
    device: torch.device,
    log: Callable[[str], None],
    *,
    rounds: int = 3,
    steps: int = 3,
    rows: int = PIPELINE_ROWS,
    layers: int = PIPELINE_LAYERS,
    rate_sizes: Sequence[int] = (),
) -> tuple[float, Mapping[str, Any]]:
    """``DeviceSpec.task_wait_s`` (module docstring) and the measurements behind it, among
    them ``lone_speedup`` and ``together_ranks`` (:func:`lone_speedup` of the pipeline's tasks),
    which :func:`pipeline_busy_rank_speed` turns into the profile's ``busy_rank_speed``.

    Args:
        width: the stage's layer width (calibration's largest matmul size).
        links: the calibrated links by axis name; a send is priced on ``pp``'s (else the
            first axis's) ``broadcast`` fit, as the planner prices a stage's sends.
        rate_sizes: matmul sizes of :func:`matmul_rate_now`, timed before each round (its
            ``matmul_flops``); none when empty.
    """
    from torch.distributed.pipelining import ScheduleGPipe

    from cost_models import send_time_s

    world, rank = dist.get_world_size(), dist.get_rank()
    if device.type != "cpu" or world == 1:
        return 0.0, {}
    m = PIPELINE_MICROBATCHES
    torch.manual_seed(rank)
    group = dist.new_group(list(range(world)))
    layer_stack = nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))
    stage = _timed_stage_class()(layer_stack, rank, world, device, group=group)
    schedule = ScheduleGPipe(stage, m, loss_fn=lambda out, target: (out - target).square().sum())
    x = torch.randn(m * rows, width)

    cpu_steps: list[list[list[float]]] = []

    def one_step() -> list[Any]:
        stage.spans, stage.cpu_spans = [], []
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=torch.zeros(m * rows, width))
        else:
            schedule.step()
        flat = [start, time.perf_counter()]
        for kind, a, b in stage.spans:
            flat += [float(kind == "B"), a, b]
        every = [torch.zeros(len(flat), dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, torch.tensor(flat, dtype=torch.float64))
        cpu_steps.append(gather_task_cpu(stage.cpu_spans, world))
        return [
            (float(t[0]), float(t[1]), [("FB"[int(t[k])], float(t[k + 1]), float(t[k + 2]))
                                        for k in range(2, len(t), 3)])
            for t in every
        ]  # fmt: skip

    one_step()  # warm-up: shape inference, first-call costs
    link = links.get("pp") or next(iter(links.values()))
    send = send_time_s(float(rows * width * 4), link)
    p2p = [send * ((i > 0) + (i < world - 1)) for i in range(world)]
    per_round: list[dict[str, Any]] = []
    every_step: list[Any] = []
    for _ in range(rounds):
        rate = matmul_rate_now(rate_sizes, device) if rate_sizes else None
        cpu_steps.clear()
        timelines = [one_step() for _ in range(steps)]
        every_step += timelines
        per_round.append(dict(round_figures(timelines, p2p, microbatches=m), matmul_flops=rate,
                              **round_cpu_figures(cpu_steps)))  # fmt: skip
    wait = statistics.median(r["task_wait_s"] for r in per_round)
    dist.destroy_process_group(group)
    detail = {"schedule": "gpipe", "microbatches": m, "rows": rows, "width": width, "layers": layers,
              "p2p_s": p2p, "rounds": per_round,
              "fitted_task_wait_s": statistics.median(r["fitted_task_wait_s"] for r in per_round),
              **_median_speedup(per_round),
              **core_wait_figures(every_step, "gpipe", m, usable_cores())}  # fmt: skip
    log(f"pipeline wait per task (GPipe, {world} stages, m={m}): {wait * 1e3:.2f} ms measured "
        f"between tasks ({detail['fitted_task_wait_s'] * 1e3:.2f} ms fitted to the step); a "
        f"rank alone ran {detail['lone_speedup']:.2f}x its speed beside "
        f"{detail['together_ranks']:.1f} computing ranks")  # fmt: skip
    return wait, detail


def _median_speedup(per_round: list[dict[str, Any]]) -> dict[str, float]:
    """The rounds' median lone speed-up and the concurrency it was measured against (1 and
    the job's all-busy count when no round saw both kinds of task)."""
    seen = [r for r in per_round if r["lone_speedup"] is not None]
    if not seen:
        return {"lone_speedup": 1.0, "together_ranks": 1.0}
    return {
        key: statistics.median(r[key] for r in seen) for key in ("lone_speedup", "together_ranks")
    }


def pipeline_busy_rank_speed(
    probe: Mapping[str, float], lone_speedup: float, together_ranks: float
) -> dict[str, float]:
    """``busy_rank_speed`` as a pipeline's ranks meet it: calibration's probe (a matmul timed
    with ``k`` ranks computing, the others waiting in an all-reduce, seconds at a time) gives
    the curve's shape, the pipeline's own tasks its size. A task alone ran ``lone_speedup``
    times faster than one beside ``together_ranks`` computing ranks (on average); the probe's
    speeds are raised to the power that makes the curve say the same,
    ``speed(1) / speed(together_ranks) = lone_speedup`` (exponent clamped to [0, 1.5]: 0, no
    speed-up, where the pipeline's lone tasks were no faster). Unchanged where the probe saw no
    speed-up to scale."""
    from autopar.planner.shared_cores import speed_at

    span = speed_at(probe, 1) / speed_at(probe, max(1, round(together_ranks)))
    if not probe or span <= 1.0 + 1e-9:
        return dict(probe)
    power = min(1.5, max(0.0, math.log(max(lone_speedup, 1e-9)) / math.log(span)))
    return {k: v**power for k, v in probe.items()}


LEVEL_RANGE = (0.25, 4.0)
"""The compute level is clamped to this range (a round whose timings went wrong)."""


def pipeline_compute_level(
    rounds: list[Mapping[str, Any]],
    priced_forward: list[float],
    priced_backward: list[float],
    speed: Mapping[str, float],
    *,
    peak_flops: float | None = None,
) -> float | None:
    """How fast calibration's pipeline computed against the planner's price of its tasks: the
    median, over rounds, stages and kinds, of the priced seconds over the measured ones times
    the speed ``speed`` gives the ranks computing during them (``speed_at``, interpolated at
    the tasks' mean concurrency). 1: the simulation, fed the priced stages, reproduces the
    pipeline's compute. None for rounds without concurrencies (profiles before session 13).
    With ``peak_flops`` (the profile's), each round's prices are first scaled to the matmul rate
    probed right before it (``peak_flops / matmul_flops``): the level without the load's drift
    between calibration's op timings and the round; None where a round has no probe."""
    from autopar.planner.shared_cores import speed_at

    if peak_flops is not None and any(r.get("matmul_flops") is None for r in rounds):
        return None
    ratios = [
        price * (1.0 if peak_flops is None else peak_flops / r["matmul_flops"])
        / (seconds * speed_at(speed, ranks))
        for r in rounds if "forward_ranks" in r
        for kind, prices in (("forward", priced_forward), ("backward", priced_backward))
        for price, seconds, ranks in zip(prices, r[f"{kind}_s"], r[f"{kind}_ranks"], strict=True)
    ]  # fmt: skip
    return statistics.median(ratios) if ratios else None


def with_pipeline_figures(
    spec: Any,
    width: int,
    links: Mapping[str, Any],
    device: torch.device,
    log: Callable[[str], None],
    details: dict[str, Any],
    *,
    rounds: int,
    rate_sizes: Sequence[int] = (),
) -> Any:
    """``spec`` (a ``DeviceSpec``) with the calibration pipeline's figures: ``task_wait_s``
    and, where the probe measured one, ``busy_rank_speed`` shaped by the pipeline's lone tasks
    (:func:`pipeline_busy_rank_speed`) and times its compute level
    (:func:`pipeline_compute_level`, clamped to ``LEVEL_RANGE``). Records the pipeline's
    measurements in ``details["task_wait"]`` (with ``priced_forward_s`` / ``priced_backward_s``,
    ``compute_level`` and, recorded only, ``compute_level_at_round_rate``: the level against
    the matmul rate probed before each round, ``rate_sizes``) and the probe's speeds in
    ``details["busy_rank_speed"]["probe"]``. Where the rounds recorded CPU seconds the speed is
    :func:`calibration_level.shared_core_speed` of the CPU level and the other threads met
    (``cores``, ``foreign_threads``; the curve above kept as ``wall_level_speed``)."""
    import dataclasses

    # Recorded only (session 15): the share of a core a rank gets with every rank computing,
    # the moment calibration's op prices stand for (benchmarks/pipeline_cpu.py).
    ops_share = matmul_cpu_share(rate_sizes or (width,), device) if device.type == "cpu" else None
    wait, details["task_wait"] = measure_task_wait(width, links, device, log, rounds=rounds,
                                                   rate_sizes=rate_sizes)  # fmt: skip
    spec = dataclasses.replace(spec, task_wait_s=wait)
    probe, timed = dict(spec.busy_rank_speed), details["task_wait"]
    if not probe or not timed:
        return spec
    details["busy_rank_speed"]["probe"] = probe
    speed = pipeline_busy_rank_speed(probe, timed["lone_speedup"], timed["together_ranks"])
    priced = priced_stage_tasks(spec, width=width, rows=timed["rows"], layers=timed["layers"],
                                world=len(timed["p2p_s"]))  # fmt: skip
    level = pipeline_compute_level(timed["rounds"], *priced, speed)
    timed["priced_forward_s"], timed["priced_backward_s"] = priced
    timed["compute_level"] = level
    # Recorded only (session 15): the level in thread CPU seconds and the share of a core the
    # pipeline's tasks got; busy_rank_speed does not use them.
    timed["cpu_compute_level"] = cpu_compute_level(timed["rounds"], *priced)
    shares = [s for s in map(round_cpu_share, timed["rounds"]) if s is not None]
    timed["cpu_share"] = statistics.median(shares) if shares else None
    timed["ops_cpu_share"], timed["ops_cpu_flops"] = ops_share or (None, None)
    timed["compute_level_at_round_rate"] = pipeline_compute_level(
        timed["rounds"], *priced, speed, peak_flops=spec.peak_flops["float32"]
    )
    if level is not None:
        speed = {k: v * min(max(level, LEVEL_RANGE[0]), LEVEL_RANGE[1]) for k, v in speed.items()}
        log(f"pipeline compute level: its tasks ran {level:.2f}x the planner's price")
    # Session 25: the CPU level times the cores' share where recorded; the wall curve kept.
    timed["wall_level_speed"] = speed
    cores = usable_cores()
    foreign = foreign_threads(timed["rounds"], cores or 1)
    if timed.get("core_wait_s") is not None and len(timed["p2p_s"]) > cores:  # sessions 26-29
        gaps = {k: timed[k] for k in ("task_gap_s", "task_gap_by_others_s")}
        spec = dataclasses.replace(spec, core_wait_s={str(cores): timed["core_wait_s"]}, **gaps)
        log(f"wait for a core with every core busy: {timed['core_wait_s'] * 1e3:.2f} ms")
    timed["cores"], timed["foreign_threads"] = cores, foreign
    if timed["cpu_compute_level"] is not None and foreign is not None:
        cpu_level = min(max(timed["cpu_compute_level"], CPU_LEVEL_RANGE[0]), CPU_LEVEL_RANGE[1])
        speed = shared_core_speed(cpu_level, len(timed["p2p_s"]), cores or 1, foreign)
        log(f"pipeline CPU level {cpu_level:.2f} (price over CPU seconds), {foreign:.2f} other "
            f"runnable threads at the quietest round, {cores} cores")  # fmt: skip
    log(
        "speed per rank by ranks computing: " + ", ".join(f"{k}: {v:.2f}" for k, v in speed.items())
    )
    return dataclasses.replace(spec, busy_rank_speed=speed)
