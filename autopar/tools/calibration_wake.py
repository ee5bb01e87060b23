"""How long a pipeline rank waits for a core when the job's ranks outnumber the cores
(``DeviceSpec.core_wait_s``), from the calibration pipeline's timelines.

On 4 gloo ranks sharing 2 cores the pipeline cost check measured more idle time than the
simulation of processor sharing predicts (0.38-0.41 of the step against 0.23-0.25 at 8
microbatches) while its steps were right: a rank whose task became ready while the two cores
ran other ranks' tasks often did not start for 10-30 ms, so the four ranks never computed at
once and the waiting for the cores fell in the gaps between tasks, not inside them (README,
"Session 26"). The simulation (:mod:`autopar.planner.shared_cores`) therefore lets such a rank
wait, idle, until one of those tasks ends or ``core_wait_s`` has passed.

Measured here on calibration's own pipeline (GPipe, every rank one stage): for each task, the
moment it became ready (its rank's previous task's end or the end of the neighbour's task it
needed, whichever is later) and its gap (ready to start). Gaps that began with fewer than
``cores`` other ranks in a task set the base, the wait the simulation already charges after
every task (half a send and ``task_wait_s``: their mean). Gaps that began with every core
running another rank's task are the waits for a core: one that started before any of those
tasks ended was let in by the scheduler (an event, its wait the gap less the base); one that
started after was let in by the core freeing (its wait was cut short there). Taking the wait
as memoryless, its mean is the waited seconds over the events (the exponential's estimate
with cut-short samples), what :func:`core_wait` returns.

The gaps' spread (session 27, ``DeviceSpec.task_gap_s``): the wait's mean did not reproduce
the idle share at 8 microbatches on 4 stages, the gaps drawn from their distribution did (a
step is the longest of the schedule's paths, and a long tail lengthens the longest path more
than its mean does; README "Session 27"). :func:`gap_quantiles` of every gap, a core free or
not, is what calibration writes for the simulation to draw from. Session 29: the gaps lengthen
with the job's other ranks computing when a task becomes ready (the check's 4-stage runs: means
1.0-1.5 ms with none, 1.6-2.0 with one, 2.1-3.2 with two), and a pipeline with more
microbatches spends more of its tasks beside computing ranks than calibration's does;
:func:`gaps_by_others` keeps that count per gap and ``task_gap_by_others_s`` their quantiles
per count, which the simulation draws from by the count it has at each task.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = [
    "GAP_QUANTILES",
    "MIN_CLASS_GAPS",
    "core_wait",
    "core_wait_figures",
    "core_wait_gaps",
    "gap_quantiles",
    "gaps_by_others",
    "quantiles_by_others",
]

GAP_QUANTILES = 20
"""Quantiles of the gaps calibration records (levels ``(n + 0.5) / GAP_QUANTILES``)."""


MIN_CLASS_GAPS = 40
"""Fewest gaps behind one count's quantiles in ``task_gap_by_others_s``: the counts at and above
the largest with at least this many gaps at or beyond it share its table."""


def _gaps(
    ranks: Sequence[Any], schedule: str, microbatches: int
) -> Iterator[tuple[float, float, list[tuple[float, float]]]]:
    """Per task but each rank's first of the step (``ranks[i] = (start, end, tasks, ...)`` of
    rank ``i``, ``tasks`` its ``(kind, start, end)`` in order, as
    ``calibration_pipeline.step_terms`` takes them): its gap, its ready moment (its rank's
    previous task's end or the end of the neighbour's task it needed, whichever is later) and
    the other ranks' tasks not ended by then."""
    from autopar.planner.shared_cores import rank_order

    p = len(ranks)
    spans: dict[tuple[str, int, int], tuple[float, float]] = {}
    for i, rank in enumerate(ranks):
        for (kind, j), (_, a, b) in zip(rank_order(schedule, i, p, microbatches), rank[2]):
            spans[(kind, i, j)] = (a, b)
    for i in range(p):
        previous = None
        for kind, j in rank_order(schedule, i, p, microbatches):
            a, b = spans[(kind, i, j)]
            needed = spans.get((kind, i - 1 if kind == "F" else i + 1, j))
            ends = [e for e in (previous, needed and needed[1]) if e is not None]
            previous = b
            if not ends:
                continue  # the step's first task: its gap is the head
            ready = max(ends)
            yield a - ready, ready, [(c, d) for (_, r, _), (c, d) in spans.items()
                                     if r != i and d > ready]  # fmt: skip


def core_wait_gaps(
    ranks: Sequence[Any], schedule: str, microbatches: int, cores: int
) -> tuple[list[float], list[tuple[float, float]]]:
    """One step's gaps (:func:`_gaps`' ``ranks``): the gaps that began with a core free, and
    per gap that began with every core running another rank's task, ``(gap, seconds until a
    core was free)``."""
    free: list[float] = []
    full: list[tuple[float, float]] = []
    for gap, ready, other in _gaps(ranks, schedule, microbatches):
        freed = _first_free(other, ready, cores)
        if freed <= ready:
            free.append(gap)
        else:
            full.append((gap, freed - ready))
    return free, full


def gaps_by_others(
    ranks: Sequence[Any], schedule: str, microbatches: int
) -> list[tuple[float, int]]:
    """One step's gaps (:func:`_gaps`' ``ranks``), each with the number of the job's other
    ranks in a task at its ready moment."""
    return [(gap, sum(1 for c, _ in other if c <= ready))
            for gap, ready, other in _gaps(ranks, schedule, microbatches)]  # fmt: skip


def quantiles_by_others(
    pairs: Sequence[tuple[float, int]], least: int = MIN_CLASS_GAPS
) -> dict[str, list[float]]:
    """:func:`gap_quantiles` per count of other ranks computing (``pairs`` from
    :func:`gaps_by_others`): one table per count below the top count ``K`` (the largest count
    with at least ``least`` gaps at ``K`` or more), and ``K``'s table of every gap at ``K`` or
    more; a count with no gap has no table. Empty where fewer than ``least`` gaps in all."""
    counts = sorted({k for _, k in pairs})
    top = max((k for k in counts if sum(1 for _, c in pairs if c >= k) >= least), default=None)
    if top is None:
        return {}
    out = {str(k): gap_quantiles([g for g, c in pairs if c == k]) for k in counts if k < top}
    out[str(top)] = gap_quantiles([g for g, c in pairs if c >= top])
    return out


def _first_free(spans: Sequence[tuple[float, float]], ready: float, cores: int) -> float:
    """The first moment from ``ready`` on at which fewer than ``cores`` of ``spans`` (other
    ranks' tasks, one rank's never overlapping) are running: tasks that start while others end
    keep the cores busy."""
    running = sum(1 for c, _ in spans if c <= ready)
    if running < cores:
        return ready
    changes = sorted([(d, -1) for _, d in spans] + [(c, 1) for c, _ in spans if c > ready])
    for t, step in changes:  # at equal times the ends come first: a core is free there
        running += step
        if running < cores:
            return t
    return float("inf")


def core_wait(free: Sequence[float], full: Sequence[tuple[float, float]]) -> float | None:
    """The mean wait for a core (module docstring) from :func:`core_wait_gaps`' samples of
    several steps; None where no gap began with every core busy or none began with a core free
    (no base)."""
    if not full or not free:
        return None
    base = statistics.fmean(free)
    waited = events = 0.0
    for gap, until_free in full:
        if gap < until_free:  # let in while the cores were still busy
            events += 1
            waited += max(0.0, gap - base)
        else:
            waited += max(0.0, until_free - base)
    return waited / max(events, 1.0)


def gap_quantiles(gaps: Sequence[float], count: int = GAP_QUANTILES) -> list[float]:
    """``count`` quantiles of ``gaps`` (levels ``(n + 0.5) / count``, ascending, each >= 0: a
    start a clock tick before its ready moment is a gap of 0); empty for no gaps."""
    ordered = sorted(max(0.0, g) for g in gaps)
    if not ordered:
        return []
    return [ordered[min(len(ordered) - 1, int((n + 0.5) / count * len(ordered)))]
            for n in range(count)]  # fmt: skip


def core_wait_figures(
    timelines: Sequence[Sequence[Any]], schedule: str, microbatches: int, cores: int
) -> dict[str, Any]:
    """The calibration record of the wait for a core over ``timelines`` (steps of
    :func:`core_wait_gaps`' ``ranks``): ``core_wait_s`` (None where not measured), the gaps
    counted, the base, ``task_gap_s`` (every gap's :func:`gap_quantiles`) and
    ``task_gap_by_others_s`` (:func:`quantiles_by_others`)."""
    free: list[float] = []
    full: list[tuple[float, float]] = []
    by_others: list[tuple[float, int]] = []
    for ranks in timelines:
        got = core_wait_gaps(ranks, schedule, microbatches, cores)
        free += got[0]
        full += got[1]
        by_others += gaps_by_others(ranks, schedule, microbatches)
    return {
        "core_wait_s": core_wait(free, full),
        "core_wait_gaps": {
            "free": len(free),
            "full": len(full),
            "let_in": sum(g < u for g, u in full),
        },  # fmt: skip
        "core_wait_base_s": statistics.fmean(free) if free else None,
        "task_gap_s": gap_quantiles(free + [gap for gap, _ in full]),
        "task_gap_by_others_s": quantiles_by_others(by_others),
    }
