"""Pricing a pipeline schedule and choosing its cut points: the inter-op half of stage planning.

Plain numbers only (no graph, no torch): the stage planner (``planner.pipeline``) hands in, for
each stage position ``i`` of ``p`` and each block count ``k``, the priced stage
(:class:`StageCost`, from the intra-op ILP via ``planner.stage_pricing``), and gets back the cut
points and the step time.

Schedule model (per microbatch, stage ``i`` takes ``t_i = forward_i + backward_i + p2p_i``,
where ``p2p_i`` is its sends: the activation to stage ``i+1`` and the gradient to ``i-1``):

- GPipe and 1F1B: ``T = sum_i t_i + (m - 1) * max_i t_i``. The first microbatch crosses every
  stage once; the others follow at the pace of the slowest stage. The bubble is
  ``T - m * max_i t_i = sum_i t_i - max_i t_i``, i.e. ``(p - 1) / (m + p - 1)`` of the step for
  equal stages. The two schedules take the same time; they differ in the activations a stage
  keeps in flight: GPipe ``m`` microbatches, 1F1B ``min(p - i, m)`` on stage ``i``.
- Interleaved 1F1B with ``v`` virtual stages per rank (``p * v`` chunks, chunk ``c`` on rank
  ``c % p``): ``T = m * max_r t_r + (p - 1) * max_c t_c`` with ``t_r`` the sum of rank ``r``'s
  chunks: the bubble is divided by ``v``, the point-to-point transfers multiplied by ``v``.
  Rank ``r`` keeps ``min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)`` chunk-microbatches in
  flight (Megatron-LM's warm-up count plus the one being computed).

Once per step each stage also synchronises its gradients over its data-parallel ranks (not
overlapped with the pipeline): the step adds the slowest stage's ``step_s``. It also adds the
step's head and tail (``head_s``, ``tail_s``: what the runtime does before the first forward
and after the last backward, priced by :mod:`planner.pipeline_ends`), so
``T = head + pipeline + tail + sync``; both are idle time of every rank.

Cut points (:func:`best_cuts`) minimise ``T`` exactly: for each candidate bound ``M`` on the
slowest stage (the distinct stage times, ascending from the smallest feasible bottleneck), a
dynamic programme over (stages placed, blocks covered) minimises ``sum t_i`` with every
``t_i <= M``; ``S(M) + (m - 1) * M`` bounds the true objective of that solution from above and
equals it at the optimum's own bottleneck, so the minimum over ``M`` is the optimum. The scan
stops once ``S(inf) + (m - 1) * M`` cannot beat the best found.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopar.planner.split_schedules import (
    SPLIT_SCHEDULES,
    action_orders,
    rank_in_flight,
    simulate,
)
from autopar.planner.stages import stage_rank

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", *SPLIT_SCHEDULES)
"""Schedules the stage planner offers. The split-backward ones (``zero-bubble``, ``zbv``,
``dualpipev``) are priced by simulating torch's action order (:mod:`planner.split_schedules`),
with 2 stages per rank."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCost:
    """One priced stage (a contiguous run of blocks, maybe with the model's ends)."""

    forward_s: float
    """Per microbatch."""
    backward_s: float
    """Per microbatch, recomputation included."""
    weight_s: float = 0.0
    """The parameter-gradient part of ``backward_s`` (the weight pass of a split-backward
    schedule: planner.split_schedules)."""
    p2p_s: float = 0.0
    """Per microbatch: this stage's sends (activation forward, gradient backward)."""
    step_s: float = 0.0
    """Once per step: gradient synchronisation over the stage's data-parallel ranks."""
    peak_memory_bytes: float = 0.0
    """With the activations its schedule keeps in flight."""
    memory: dict[str, float] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    """What was chosen inside the stage (ZeRO, recomputed blocks, layouts)."""

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s + self.p2p_s


def in_flight(
    schedule: str, position: int, num_ranks: int, microbatches: int, virtual: int = 1
) -> int:
    """Microbatches (chunk-microbatches under interleaving) whose activations the stage at
    pipeline rank ``position`` keeps at once (see the module docstring)."""
    if schedule in SPLIT_SCHEDULES:
        return rank_in_flight(schedule, num_ranks, microbatches, virtual)[position]
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(num_ranks - position, microbatches)
    if schedule == "interleaved-1f1b":
        warmup = 2 * (num_ranks - position - 1) + (virtual - 1) * num_ranks
        return min(microbatches * virtual, warmup + 1)
    raise ValueError(f"schedule {schedule!r} is not priced; choose from {PIPELINE_SCHEDULES}")


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleTime:
    step_s: float
    bubble_s: float
    compute_s: float
    """Forward and backward of the slowest rank, all microbatches."""
    p2p_s: float
    """The slowest rank's point-to-point sends, all microbatches."""
    collectives_s: float
    """The once-per-step gradient synchronisation (slowest stage)."""
    head_s: float = 0.0
    """Before the first forward (:mod:`planner.pipeline_ends`)."""
    tail_s: float = 0.0
    """After the last backward: the loss broadcast, tied weights' gradient sum."""

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.step_s if self.step_s > 0 else 0.0

    def to_json(self) -> dict[str, float]:
        return {
            "step_s": self.step_s,
            "bubble_s": self.bubble_s,
            "bubble_fraction": self.bubble_fraction,
            "compute_s": self.compute_s,
            "p2p_s": self.p2p_s,
            "collectives_s": self.collectives_s,
            "head_s": self.head_s,
            "tail_s": self.tail_s,
        }


def schedule_time(
    stages: Sequence[StageCost],
    *,
    microbatches: int,
    schedule: str,
    num_ranks: int | None = None,
    busy_rank_speed: Mapping[str, float] | None = None,
    ranks_per_stage: int = 1,
    task_wait_s: float = 0.0,
    core_wait_s: Mapping[str, float] | None = None,
    task_gap_s: Sequence[float] = (),
    task_gap_by_others_s: Mapping[str, Sequence[float]] | None = None,
    head_s: float = 0.0,
    tail_s: float = 0.0,
) -> ScheduleTime:
    """The step of ``stages`` (in pipeline order; ``num_ranks`` < len(stages) for interleaving,
    chunk ``c`` on rank ``c % num_ranks``) under ``schedule`` (module docstring), with the
    step's ``head_s`` and ``tail_s`` (:mod:`planner.pipeline_ends`) around it.

    With a measured ``busy_rank_speed`` (``DeviceSpec``'s: ranks sharing cores) GPipe and 1F1B
    over several stages are simulated instead (:mod:`planner.shared_cores`), each stage being
    ``ranks_per_stage`` ranks, and so are they with a measured ``task_wait_s`` (charged after
    every task); ``core_wait_s`` (``DeviceSpec``'s) adds the waits for a core there, and
    ``task_gap_s`` (``DeviceSpec``'s) the gaps' measured spread instead (per count of the other
    ranks computing where ``task_gap_by_others_s`` holds it)."""
    m = microbatches
    simulated = busy_rank_speed or task_wait_s > 0
    if simulated and schedule in ("gpipe", "1f1b") and len(stages) > 1:
        from autopar.planner.shared_cores import shared_schedule_time  # imports this module

        return shared_schedule_time(
            stages,
            microbatches=m,
            schedule=schedule,
            busy_rank_speed=busy_rank_speed or {},
            ranks_per_stage=ranks_per_stage,
            task_wait_s=task_wait_s,
            core_wait_s=core_wait_s,
            task_gap_s=task_gap_s,
            task_gap_by_others_s=task_gap_by_others_s,
            head_s=head_s,
            tail_s=tail_s,
        )
    ranks = len(stages) if num_ranks is None else num_ranks
    sync = max(s.step_s for s in stages)
    if schedule in SPLIT_SCHEDULES:
        return _split_time(stages, m, schedule, ranks, sync, head_s, tail_s)
    if schedule == "interleaved-1f1b":
        per_rank = [stages[r::ranks] for r in range(ranks)]
        slowest = max(per_rank, key=lambda chunks: sum(c.time_s for c in chunks))
        rank_s = sum(c.time_s for c in slowest)
        bubble = (ranks - 1) * max(s.time_s for s in stages)
        pipeline = m * rank_s + bubble
        work = [sum(c.forward_s + c.backward_s for c in slowest), sum(c.p2p_s for c in slowest)]
    else:
        times = [s.time_s for s in stages]
        slowest_stage = stages[int(np.argmax(times))]
        bubble = sum(times) - max(times)
        pipeline = m * max(times) + bubble
        work = [slowest_stage.forward_s + slowest_stage.backward_s, slowest_stage.p2p_s]
    return ScheduleTime(
        step_s=head_s + pipeline + tail_s + sync,
        bubble_s=bubble,
        compute_s=m * work[0],
        p2p_s=m * work[1],
        collectives_s=sync,
        head_s=head_s,
        tail_s=tail_s,
    )


def _split_time(
    stages: Sequence[StageCost],
    m: int,
    schedule: str,
    ranks: int,
    sync: float,
    head_s: float,
    tail_s: float,
) -> ScheduleTime:
    """A split-backward schedule's step, simulated on torch's action order
    (:mod:`planner.split_schedules`); the bubble is the busiest rank's idle time."""
    orders = action_orders(schedule, ranks, m, len(stages) // ranks)
    placed = [stage_rank(schedule, s, ranks) for s in range(len(stages))]
    sim = simulate(orders, stages, placed)
    busiest = int(np.argmax(sim.busy_s))
    return ScheduleTime(
        step_s=head_s + sim.pipeline_s + tail_s + sync,
        bubble_s=sim.pipeline_s - sim.busy_s[busiest],
        compute_s=sim.busy_s[busiest] - sim.p2p_s[busiest],
        p2p_s=sim.p2p_s[busiest],
        collectives_s=sync,
        head_s=head_s,
        tail_s=tail_s,
    )


StageTable = Callable[[int, int], StageCost | None]
"""(position, number of blocks) -> the priced stage, or None where it does not fit."""


def best_cuts(
    table: StageTable, *, num_blocks: int, num_stages: int, microbatches: int
) -> tuple[list[int], float] | None:
    """Block counts per stage minimising the GPipe/1F1B pipeline time ``sum t_i + (m-1) max t_i``
    and that time, or None when no split fits (a stage of that size does not fit its memory
    budget at its position). Exact; see the module docstring. The once-per-step ``step_s`` is
    added by :func:`schedule_time` on the stages chosen."""
    p, n, m = num_stages, num_blocks, microbatches
    if p > n:
        return None
    max_k = n - p + 1
    times = np.full((p, max_k + 1), math.inf)
    for i in range(p):
        for k in range(1, max_k + 1):
            cost = table(i, k)
            if cost is not None:
                times[i, k] = cost.time_s
    bottleneck = _min_bottleneck(times, n)
    if not math.isfinite(bottleneck):
        return None
    unbounded = _min_sum(times, n, math.inf)
    assert unbounded is not None
    best: tuple[list[int], float] | None = None
    for cap in np.unique(times[np.isfinite(times)]):
        if cap < bottleneck:
            continue
        if best is not None and unbounded[1] + (m - 1) * cap >= best[1]:
            break
        found = _min_sum(times, n, float(cap))
        if found is None:
            continue
        sizes, total = found
        actual = total + (m - 1) * max(times[i, k] for i, k in enumerate(sizes))
        if best is None or actual < best[1] - 1e-15:
            best = (sizes, actual)
    return best


def _shifted(n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Index ``j - k`` for covered-block counts ``j = 0..n`` and stage sizes ``k = 1..width-1``,
    and where it is negative (that size does not fit in ``j`` blocks)."""
    j = np.arange(n + 1)[:, None]
    k = np.arange(1, width)[None, :]
    before = j - k
    return np.maximum(before, 0), before < 0


def _min_sum(times: np.ndarray, n: int, cap: float) -> tuple[list[int], float] | None:
    """Sizes minimising the sum of stage times with each stage time <= cap."""
    p, width = times.shape
    capped = np.where(times <= cap, times, math.inf)
    before, invalid = _shifted(n, width)
    cost = np.full(n + 1, math.inf)
    cost[0] = 0.0
    choices = np.zeros((p, n + 1), dtype=np.int64)
    for i in range(p):
        candidates = cost[before] + capped[i, 1:][None, :]
        candidates[invalid] = math.inf
        best = np.argmin(candidates, axis=1)
        cost = candidates[np.arange(n + 1), best]
        choices[i] = best + 1
    if not math.isfinite(cost[n]):
        return None
    sizes, j = [], n
    for i in range(p - 1, -1, -1):
        k = int(choices[i, j])
        sizes.append(k)
        j -= k
    return sizes[::-1], float(cost[n])


def _min_bottleneck(times: np.ndarray, n: int) -> float:
    """The smallest possible slowest-stage time over all splits (a minimax programme)."""
    p, width = times.shape
    before, invalid = _shifted(n, width)
    worst = np.full(n + 1, math.inf)
    worst[0] = 0.0
    for i in range(p):
        candidates = np.maximum(worst[before], times[i, 1:][None, :])
        candidates[invalid] = math.inf
        worst = candidates.min(axis=1)
    return float(worst[n])


def even_sizes(num_blocks: int, num_stages: int) -> list[int]:
    """Blocks per stage as evenly as possible, earlier stages taking the remainder (the split
    of ``planner.stages.even_stages``)."""
    base, extra = divmod(num_blocks, num_stages)
    return [base + (1 if k < extra else 0) for k in range(num_stages)]
