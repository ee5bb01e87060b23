"""The wait for a core, measured from a pipeline's timelines (``autopar.tools.calibration_wake``),
on hand-made steps."""

from __future__ import annotations

import pytest

from autopar.tools.calibration_wake import (
    _first_free,
    core_wait,
    core_wait_figures,
    core_wait_gaps,
    gap_quantiles,
    gaps_by_others,
    quantiles_by_others,
)

# 2 stages on 1 core, GPipe, 2 microbatches: (start, end, [(kind, start, end)]) per rank.
# Stage 1's F0 becomes ready at 1.0 (stage 0's F0 ends) while stage 0's F1 runs (1.0-3.0) and
# starts at 2.0, before that task ends: let in by the scheduler after 1.0 s. Every other gap
# begins with the core free: stage 0's F1 (0.0), stage 1's F1, B0, B1 and stage 0's B0, B1
# (0.5 each).
STEP = [
    (0.0, 11.0, [("F", 0.0, 1.0), ("F", 1.0, 3.0), ("B", 7.5, 8.5), ("B", 9.5, 10.5)]),
    (0.0, 11.0, [("F", 2.0, 4.0), ("F", 4.5, 5.0), ("B", 5.5, 7.0), ("B", 7.5, 9.0)]),
]


def test_gaps_split_by_whether_every_core_ran_another_ranks_task():
    free, full = core_wait_gaps(STEP, "gpipe", 2, cores=1)
    assert sorted(free) == pytest.approx([0.0, 0.5, 0.5, 0.5, 0.5, 0.5])
    assert full == [pytest.approx((1.0, 2.0))]  # its gap, and the core freeing 2.0 s after
    assert core_wait_gaps(STEP, "gpipe", 2, cores=2)[1] == []  # a core to spare: no wait


def test_the_wait_is_the_waited_seconds_over_the_ranks_let_in():
    base = 2.5 / 6
    figures = core_wait_figures([STEP], "gpipe", 2, cores=1)
    assert figures["core_wait_s"] == pytest.approx(1.0 - base)
    assert figures["core_wait_gaps"] == {"free": 6, "full": 1, "let_in": 1}
    # One let in after 3 s (2 s over the base of 1 s), one cut short when the core freed
    # after 2 s (1 s waited, no event): 3 s over 1 event.
    assert core_wait([1.0, 1.0], [(3.0, 5.0), (4.0, 2.0)]) == pytest.approx(3.0)
    assert core_wait([1.0], []) is None and core_wait([], [(3.0, 5.0)]) is None


def test_a_core_is_free_when_fewer_tasks_than_cores_run():
    assert _first_free([(0.0, 5.0), (4.0, 8.0)], 1.0, cores=1) == 8.0  # the next one kept it
    assert _first_free([(0.0, 5.0), (4.0, 8.0)], 1.0, cores=2) == 1.0
    assert _first_free([(0.0, 5.0), (5.0, 8.0)], 1.0, cores=1) == 5.0  # back to back: free


def test_calibration_records_the_quantiles_of_every_gap():
    """Session 27: the gaps' distribution, the one that began with every core busy (1.0 s)
    among the six that began with a core free (0.0 and five of 0.5 s)."""
    figures = core_wait_figures([STEP], "gpipe", 2, cores=1)
    assert figures["task_gap_s"] == gap_quantiles([0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0])
    assert gap_quantiles([0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 1.0], count=4) == [0.0, 0.5, 0.5, 1.0]
    assert gap_quantiles([3.0, 1.0, 2.0, 4.0], count=2) == [2.0, 4.0]  # levels 0.25 and 0.75
    assert gap_quantiles([-1e-6, 2.0], count=2) == [0.0, 2.0]  # a start before ready: 0
    assert gap_quantiles([]) == []


def test_each_gap_counts_the_other_ranks_in_a_task_when_it_became_ready():
    """Session 29: stage 1's F0 became ready (1.0) while stage 0's F1 ran; every other gap
    began with the other rank between tasks (stage 0's B0 is ready at 7.0, when stage 1's B0
    has just ended and its B1 not begun)."""
    pairs = gaps_by_others(STEP, "gpipe", 2)
    assert sorted(pairs) == [(0.0, 0), (0.5, 0), (0.5, 0), (0.5, 0), (0.5, 0), (0.5, 0), (1.0, 1)]
    assert quantiles_by_others(pairs, least=1) == {
        "0": gap_quantiles([0.0, 0.5, 0.5, 0.5, 0.5, 0.5]),
        "1": gap_quantiles([1.0]),
    }
    # Too few gaps at one other rank for a table of their own: count 0's takes them all.
    assert quantiles_by_others(pairs, least=2) == {"0": gap_quantiles([p for p, _ in pairs])}
    assert quantiles_by_others(pairs, least=8) == {}
    # The top count's table holds every count above it; a count with no gap has no table.
    many = [(0.001, 0)] * 5 + [(0.002, 2)] * 3 + [(0.004, 3)] * 2
    assert quantiles_by_others(many, least=5) == {
        "0": gap_quantiles([0.001] * 5),
        "2": gap_quantiles([0.002] * 3 + [0.004] * 2),
    }
    # Calibration writes them beside task_gap_s; one step is too few gaps for a table.
    assert core_wait_figures([STEP], "gpipe", 2, cores=1)["task_gap_by_others_s"] == {}
