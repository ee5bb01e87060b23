"""The calibration pipeline's compute level in thread CPU time (session 15).

On a machine whose cores are shared by more runnable threads than it has (2-4 ranks on 2 cores,
beside other users' processes), a task's wall seconds are its CPU seconds over the share of a
core the rank got while it ran. Calibration's wall timings carry the share of their own moment,
and the steps checked minutes later run at another one (calibrated over current matmul rate
0.18-3.22 in session 13's checks). The CPU seconds of a task do not depend on the share, so
calibration records, for each task of its pipeline, the thread CPU seconds
(``time.thread_time``: the rank's compute runs on its calling thread, with one intra-op thread
and autograd's CPU backward on the caller) beside the wall span:

- :func:`cpu_compute_level` is the planner's price of the tasks (every rank busy, the
  profile's roofline) over their thread CPU seconds: a stage priced ``t`` by the planner needs
  ``t / level`` CPU seconds;
- :func:`cpu_share` is CPU seconds over wall seconds: the share of a core the tasks got.

A check (``benchmarks/pipeline_cpu.py``) then prices each stage at ``t / level / share``, with
the share the steps' own tasks got, which separates what the model predicts (the work, the
schedule, the sends) from what the load decides (the share).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist


def timed_task(stage: Any, kind: str, call: Callable[[], Any]) -> Any:
    """Runs ``call`` (one microbatch's forward or backward of ``stage``), appends ``(kind,
    start, end)`` on the monotonic clock (which every process of the machine shares) to
    ``stage.spans`` and ``(kind, thread CPU seconds)`` to ``stage.cpu_spans``."""
    start, cpu = time.perf_counter(), time.thread_time()
    try:
        return call()
    finally:
        stage.spans.append((kind, start, time.perf_counter()))
        stage.cpu_spans.append((kind, time.thread_time() - cpu))


def task_cpu_means(cpu_spans: Sequence[tuple[str, float]]) -> tuple[float, float]:
    """Mean thread CPU seconds of the forward (``"F"``) and the backward (``"B"``) tasks; 0
    for a kind with no task."""
    means = []
    for kind in "FB":
        seconds = [s for k, s in cpu_spans if k == kind]
        means.append(statistics.fmean(seconds) if seconds else 0.0)
    return means[0], means[1]


def gather_task_cpu(cpu_spans: Sequence[tuple[str, float]], world: int) -> list[list[float]]:
    """Every rank's :func:`task_cpu_means` (rank ``i`` runs stage ``i``): ``[[forward,
    backward], ...]`` by rank."""
    mine = torch.tensor(task_cpu_means(cpu_spans), dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    return [[float(v) for v in t] for t in every]


def round_cpu_figures(per_step: Sequence[Sequence[Sequence[float]]]) -> dict[str, list[float]]:
    """A round's CPU seconds per stage: the median over its steps (each step
    :func:`gather_task_cpu`'s rows) of each stage's mean forward and backward task."""
    stages = range(len(per_step[0]))
    return {
        "forward_cpu_s": [statistics.median(s[i][0] for s in per_step) for i in stages],
        "backward_cpu_s": [statistics.median(s[i][1] for s in per_step) for i in stages],
    }


def cpu_compute_level(
    rounds: Sequence[Mapping[str, Any]],
    priced_forward: Sequence[float],
    priced_backward: Sequence[float],
) -> float | None:
    """The planner's price of calibration's pipeline tasks over their thread CPU seconds: the
    median over rounds, stages and kinds of ``priced / cpu``. None where no round recorded CPU
    seconds (profiles before session 15) or every recorded figure is 0."""
    ratios = [
        price / cpu
        for r in rounds if "forward_cpu_s" in r
        for kind, prices in (("forward", priced_forward), ("backward", priced_backward))
        for price, cpu in zip(prices, r[f"{kind}_cpu_s"], strict=True) if cpu > 0
    ]  # fmt: skip
    return statistics.median(ratios) if ratios else None


def cpu_share(cpu_s: float, wall_s: float) -> float:
    """The share of a core a thread got: its CPU seconds over the wall seconds they took,
    clamped to (0, 1] (a clock's granularity can make a short span read above 1)."""
    if wall_s <= 0 or cpu_s <= 0:
        raise ValueError(
            f"cpu_share needs positive seconds (cpu {cpu_s}, wall {wall_s}): time a task "
            "that ran, with time.thread_time and time.perf_counter around the same call"
        )
    return min(1.0, cpu_s / wall_s)


def round_cpu_share(round_: Mapping[str, Any]) -> float | None:
    """The share of a core calibration's pipeline tasks got in one round: their CPU seconds
    over their wall seconds, summed over stages and kinds. None without CPU figures."""
    if "forward_cpu_s" not in round_:
        return None
    cpu = sum(round_["forward_cpu_s"]) + sum(round_["backward_cpu_s"])
    wall = sum(round_["forward_s"]) + sum(round_["backward_s"])
    return cpu_share(cpu, wall) if cpu > 0 and wall > 0 else None


CPU_LEVEL_RANGE = (0.25, 16.0)
"""The CPU level is clamped to this range (a round whose timings went wrong); it is the price
over CPU seconds, so ranks that share few cores (price at every rank busy) read above 1."""


def foreign_threads(rounds: Sequence[Mapping[str, Any]], cores: int) -> float | None:
    """How many other processes' threads competed for the cores while calibration's pipeline
    ran, at its quietest round (session 25). With ``k`` of the job's ranks computing beside
    ``g`` other runnable threads a rank gets ``min(1, cores / (k + g))`` of a core
    (:func:`shared_core_speed`; between counts as the planner's simulation interpolates,
    ``shared_cores.speed_at``), so each stage's and kind's CPU share in a round, at the mean
    number of ranks computing during its tasks (``forward_ranks`` / ``backward_ranks``), gives
    the least ``g`` that explains it (0 where the share is what the job's own ranks leave:
    a share of a whole core says nothing about load it did not meet). A round's figure is the
    median over its stages and kinds; the least over rounds is kept: on a machine shared with
    other users' jobs whose load comes and goes within seconds, the quietest round is the job's
    own sharing plus the load that stayed. None without CPU figures (before session 15)."""
    per_round = []
    for r in rounds:
        if "forward_cpu_s" not in r or "forward_ranks" not in r:
            continue
        world = len(r["forward_s"])
        threads = [
            _threads_for_share(cpu_share(cpu, wall), ranks, world, cores)
            for kind in ("forward", "backward")
            for cpu, wall, ranks in zip(
                r[f"{kind}_cpu_s"], r[f"{kind}_s"], r[f"{kind}_ranks"], strict=True
            )  # fmt: skip
            if cpu > 0 and wall > 0
        ]
        if threads:
            per_round.append(statistics.median(threads))
    return min(per_round) if per_round else None


def _threads_for_share(share: float, ranks: float, world: int, cores: int) -> float:
    """The least number of other runnable threads for which a task beside ``ranks`` computing
    ranks gets ``share`` of a core under :func:`shared_core_speed` (bisection; the share falls
    as the threads grow)."""
    from autopar.planner.shared_cores import speed_at

    def got(threads: float) -> float:
        return speed_at(shared_core_speed(1.0, world, cores, threads), ranks)

    if got(0.0) <= share:
        return 0.0
    low, high = 0.0, 1.0
    while got(high) > share and high < 1e6:  # bounded: a share above what any load gives
        low, high = high, high * 2
    while high - low > 1e-6:
        mid = (low + high) / 2
        low, high = (mid, high) if got(mid) > share else (low, mid)
    return (low + high) / 2


def shared_core_speed(level: float, world: int, cores: int, foreign: float) -> dict[str, float]:
    """``busy_rank_speed`` from the CPU level (session 25): with ``k`` of the job's ``world``
    ranks computing beside ``foreign`` other runnable threads on ``cores`` cores, a rank's
    compute runs at ``level`` (the planner's price over CPU seconds, :func:`cpu_compute_level`)
    times its share of a core, ``min(1, cores / (k + foreign))``; one entry per count."""
    if world < 1 or cores < 1 or foreign < 0 or level <= 0:
        raise ValueError(
            f"shared_core_speed needs world >= 1, cores >= 1, foreign >= 0 and level > 0; got "
            f"world {world}, cores {cores}, foreign {foreign}, level {level}"
        )
    return {str(k): level * min(1.0, cores / (k + foreign)) for k in range(1, world + 1)}
