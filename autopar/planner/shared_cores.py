"""A GPipe / 1F1B step on ranks that share cores: the schedule simulated, microbatch by microbatch.

The closed form of :mod:`planner.pipeline_schedule` assumes a stage takes the same time whether
the other stages compute or wait. On ranks that share CPU cores (gloo ranks on one machine) that
is false: a stage computing alone (a pipeline's ramp-up and drain, or while the others wait for
its activation) runs several times faster than with every rank computing, the condition under
which ``autopar calibrate`` measured the device. ``DeviceSpec.busy_rank_speed`` holds the
measured per-rank speed for ``k`` ranks computing at once, relative to the stage's price (its
level, the speed with every rank computing, is calibration's pipeline's: not always 1; since
session 25 the pipeline's CPU level times ``min(1, cores / (k + g))``).

The simulation runs the schedule's per-rank order of forwards ``F(j)`` and backwards ``B(j)``
(GPipe: every forward, then every backward; 1F1B: ``min(p - i - 1, m)`` warm-up forwards on stage
``i``, then one forward and one backward alternately, then the remaining backwards; microbatches
in order), with the dependencies ``F(i, j)`` after ``F(i - 1, j)`` and ``B(i, j)`` after
``B(i + 1, j)``. A task is its compute (the stage's ``forward_s`` or ``backward_s``, priced at the
all-busy speed) followed by half the stage's per-microbatch ``p2p_s`` (its send) and the
device's ``task_wait_s`` (the rank's wake-up on its next receive, gloo's threads and the schedule's
Python between tasks, measured by ``autopar calibrate``), neither of which holds a core. Compute progresses at ``speed(busy ranks)`` (processor sharing): between two events every
computing rank advances by ``dt * speed(k)`` with ``k`` the ranks computing in that interval (each
stage's ``ranks_per_stage`` ranks count). ``speed`` interpolates ``busy_rank_speed`` linearly in
seconds per unit of work between measured counts and is constant beyond them.

Waiting for a core (session 26): ranks that outnumber the cores do not share them as evenly
as processor sharing says. A rank whose task becomes ready while every core runs another rank's
task waits, idle, until one of those tasks ends or the device's ``core_wait_s`` (the scheduler's
latency for a woken rank against ranks that compute; ``autopar calibrate`` measures it) has
passed, whichever comes first; only then does it compute and share. Measured on 4 gloo ranks
on 2 cores, a rank woken then waited up to 20-30 ms and the four ranks never computed at once,
while the sharing alone had them all compute a fifth of the step (README "Session 26"). Without
a ``core_wait_s`` (presets, GPUs, older profiles, ranks no more than the cores) nothing waits.

The gaps' spread (session 27): on 4 gloo ranks on 2 cores the gap between a task becoming ready
and its start has a long tail (mean 2-3 ms, 90th percentile 10-30 ms on the middle stages), on 2
ranks not (about 1 ms, 90th percentile 1-4 ms). A pipeline's step is the longest of its paths,
so random gaps lengthen it (and the idle share) beyond their mean: with the check's own gaps
drawn per task the measured idle at 8 microbatches was reproduced, with their mean it was not
(README "Session 27"). Where the device holds the gaps' measured quantiles (``task_gap_s``),
each task's gap is drawn from them around its priced mean (half the send and ``task_wait_s``;
never below 0) and the result is the mean of :data:`GAP_DRAWS` simulations with fixed seeds;
the waits for a core are then in the drawn gaps, and ``core_wait_s`` is not charged. Where the
device holds them per count of the other ranks computing (``task_gap_by_others_s``, session
29: the gaps lengthen with that count), a task's gap is drawn from the table of the count of
ranks the simulation has computing when the task becomes ready (the largest count at or below
it with a table, else the smallest), still around ``task_gap_s``'s mean.

With ``speed == 1`` and equal stages this is exactly the closed form; for unequal stages it is the
event-exact makespan of the schedule's order (1F1B can then beat the closed form, which charges
the slowest stage GPipe's whole ramp). The wait lies on every task of the critical path: the
busiest rank's own ``2 m`` tasks and, for equal stages, the ``2 (p - 1)`` tasks of the ramp-up and
drain on the others, so it adds ``(2 m + 2 (p - 1)) * task_wait_s`` to the step and counts as idle
time, as it does in a measured step (``PipelineModule.busy_s`` excludes it); the wait after a
rank's last task is its wake-up on the loss broadcast. The step's priced head and tail
(:mod:`planner.pipeline_ends`) come before and after the simulated schedule, every rank idle.
Interleaved 1F1B keeps the closed form.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autopar.planner.pipeline_schedule import ScheduleTime, StageCost

GAP_DRAWS = 32
"""Simulations averaged when the device has measured gap quantiles (``task_gap_s``)."""


def speed_at(busy_rank_speed: Mapping[str, float], busy: float) -> float:
    """Per-rank speed with ``busy`` ranks computing (module docstring; 1.0 for an empty table);
    ``busy`` may be a mean count (interpolated alike)."""
    if not busy_rank_speed:
        return 1.0
    points = sorted((int(k), 1.0 / v) for k, v in busy_rank_speed.items())
    if busy <= points[0][0]:
        return 1.0 / points[0][1]
    for (k0, s0), (k1, s1) in zip(points, points[1:]):
        if busy <= k1:
            return 1.0 / (s0 + (s1 - s0) * (busy - k0) / (k1 - k0))
    return 1.0 / points[-1][1]


def rank_order(
    schedule: str, position: int, num_stages: int, microbatches: int
) -> list[tuple[str, int]]:
    """The stage's tasks in the order it runs them: ``("F", j)`` and ``("B", j)``."""
    m = microbatches
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"schedule {schedule!r} is not simulated; use 'gpipe' or '1f1b'")
    warmup = min(num_stages - position - 1, m)
    order = [("F", j) for j in range(warmup)]
    for j in range(m - warmup):
        order += [("F", warmup + j), ("B", j)]
    return order + [("B", j) for j in range(m - warmup, m)]


def shared_schedule_time(
    stages: Sequence[StageCost],
    *,
    microbatches: int,
    schedule: str,
    busy_rank_speed: Mapping[str, float],
    ranks_per_stage: int = 1,
    task_wait_s: float = 0.0,
    core_wait_s: Mapping[str, float] | None = None,
    task_gap_s: Sequence[float] = (),
    task_gap_by_others_s: Mapping[str, Sequence[float]] | None = None,
    head_s: float = 0.0,
    tail_s: float = 0.0,
) -> ScheduleTime:
    """The step of ``stages`` under ``schedule`` on ranks sharing cores (module docstring),
    after the step's ``head_s`` and before its ``tail_s`` (every rank idle in both);
    ``core_wait_s`` is ``DeviceSpec.core_wait_s`` (``{cores: seconds}``), ``task_gap_s``
    ``DeviceSpec.task_gap_s`` (quantiles: the mean of :data:`GAP_DRAWS` simulations with drawn
    gaps, no ``core_wait_s``; module docstring) and ``task_gap_by_others_s`` the same per
    count of the other ranks computing.

    ``bubble_s`` is the step less the busiest rank's compute and sends (its per-task waits and
    its waits for a core are idle time); ``compute_s`` and ``p2p_s`` are that rank's."""
    p = len(stages)
    if task_gap_s:
        runs = [
            _simulate(stages, microbatches, schedule, busy_rank_speed, ranks_per_stage,
                      task_wait_s, (0, 0.0), _gap_draws(task_gap_s, seed, task_gap_by_others_s))
            for seed in range(GAP_DRAWS)
        ]  # fmt: skip
        now = statistics.fmean(r[0] for r in runs)
        busy = [statistics.fmean(r[1][i] for r in runs) for i in range(p)]
    else:
        cores = next(((int(k), v) for k, v in (core_wait_s or {}).items()), (0, 0.0))
        now, busy = _simulate(stages, microbatches, schedule, busy_rank_speed, ranks_per_stage,
                              task_wait_s, cores, None)  # fmt: skip
    sync = max(s.step_s for s in stages)
    worst = max(range(p), key=lambda i: busy[i] + microbatches * stages[i].p2p_s)
    sends = microbatches * stages[worst].p2p_s
    return ScheduleTime(
        step_s=head_s + now + tail_s + sync,
        bubble_s=now - busy[worst] - sends,
        compute_s=busy[worst],
        p2p_s=sends,
        collectives_s=sync,
        head_s=head_s,
        tail_s=tail_s,
    )


def _gap_draws(
    quantiles: Sequence[float],
    seed: int,
    by_others: Mapping[str, Sequence[float]] | None = None,
) -> Callable[[int], float]:
    """Gaps drawn uniformly from ``quantiles`` (a fixed seed: the same prediction every time),
    less their mean: the spread around the gap the simulation already charges. With
    ``by_others`` (``{str(count): quantiles}``), the draw for a task with ``others`` other
    ranks computing comes from the table of the largest count at or below ``others`` (else the
    smallest count's), less the same mean."""
    rng = random.Random(seed)
    mean = statistics.fmean(quantiles)
    tables = sorted((int(k), tuple(v)) for k, v in (by_others or {}).items() if v)

    def draw(others: int) -> float:
        table = quantiles
        if tables:
            table = next((t for k, t in reversed(tables) if k <= others), tables[0][1])
        return table[rng.randrange(len(table))] - mean

    return draw


def _simulate(
    stages: Sequence[StageCost],
    microbatches: int,
    schedule: str,
    busy_rank_speed: Mapping[str, float],
    ranks_per_stage: int,
    task_wait_s: float,
    core_wait: tuple[int, float],
    gap: Callable[[int], float] | None,
) -> tuple[float, list[float]]:
    """One simulated schedule (module docstring): its length and each rank's compute seconds;
    ``core_wait`` is ``(cores, seconds)``, ``gap`` draws each task's deviation from its mean
    gap given the other ranks computing when it becomes ready (None: none)."""
    p = len(stages)
    orders = [rank_order(schedule, i, p, microbatches) for i in range(p)]
    cores, core_wait_s = core_wait
    done: dict[tuple[str, int, int], float] = {}
    nxt = [0] * p  # index of each rank's next task
    # Remaining wait for a core (None: not waiting), compute work, send seconds.
    left: list[list[Any]] = [[None, 0.0, 0.0] for _ in range(p)]
    running = [False] * p
    busy = [0.0] * p  # compute seconds per rank
    speeds = [speed_at(busy_rank_speed, k * ranks_per_stage) for k in range(p + 1)]
    now = 0.0
    while True:
        computing = [i for i in range(p) if running[i] and left[i][0] is None and left[i][1] > 0]
        for i in range(p):
            if running[i] or nxt[i] == len(orders[i]):
                continue
            kind, j = orders[i][nxt[i]]
            before = (kind, i - 1, j) if kind == "F" else (kind, i + 1, j)
            if 0 <= before[1] < p and before not in done:
                continue
            work = stages[i].forward_s if kind == "F" else stages[i].backward_s
            others = len(computing) * ranks_per_stage
            full = cores > 0 and others >= cores
            after = stages[i].p2p_s / 2 + task_wait_s + (gap(others) if gap else 0.0)
            left[i] = [core_wait_s if full else None, work, max(0.0, after)]
            running[i] = True
            if not full and work > 0:
                computing.append(i)
        for i in range(p):  # a core freed, or the wait for one is over: compute
            if left[i][0] is not None and (
                len(computing) * ranks_per_stage < cores or left[i][0] <= 1e-12
            ):
                left[i][0] = None
                computing.append(i)
        active = [i for i in range(p) if running[i]]
        if not active:
            break
        rate = speeds[len(computing)]
        dt = min(
            left[i][0] if left[i][0] is not None else left[i][1] / rate if left[i][1] > 0
            else left[i][2]
            for i in active
        )  # fmt: skip
        now += dt
        for i in active:
            if left[i][0] is not None:
                left[i][0] -= dt
                continue
            if left[i][1] > 0:
                left[i][1] -= dt * rate
                busy[i] += dt
            else:
                left[i][2] -= dt
            left[i][1:] = [x if x > 1e-12 else 0.0 for x in left[i][1:]]  # the phase is over
            if left[i][1:] == [0.0, 0.0]:
                kind, j = orders[i][nxt[i]]
                done[(kind, i, j)] = now
                nxt[i] += 1
                running[i] = False
    assert all(n == len(o) for n, o in zip(nxt, orders)), "schedule deadlocked"
    return now, busy
