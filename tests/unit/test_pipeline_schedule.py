"""The pipeline schedule's price and the cut points' dynamic programme (planner.pipeline_schedule):
hand counts of bubbles and in-flight activations, and the DP against brute force."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.planner.pipeline_schedule import (
    StageCost,
    best_cuts,
    even_sizes,
    in_flight,
    schedule_time,
)


def _stage(t: float, *, sync: float = 0.0) -> StageCost:
    return StageCost(forward_s=t / 3, backward_s=2 * t / 3, step_s=sync)


def test_equal_stages_have_the_textbook_bubble():
    # p = 4 stages of 1 s per microbatch, m = 8: (m + p - 1) = 11 s, bubble (p - 1) = 3 s.
    t = schedule_time([_stage(1.0)] * 4, microbatches=8, schedule="1f1b")
    assert t.step_s == pytest.approx(11.0)
    assert t.bubble_s == pytest.approx(3.0)
    assert t.bubble_fraction == pytest.approx(3 / 11)
    assert t.compute_s == pytest.approx(8.0)


def test_unequal_stages_run_at_the_slowest_pace_and_sync_once():
    # Stages of 1, 2, 1 s, m = 4: the first microbatch takes 4 s, the other 3 follow every 2 s.
    t = schedule_time(
        [_stage(1.0, sync=0.5), _stage(2.0, sync=0.25), _stage(1.0)],
        microbatches=4,
        schedule="gpipe",
    )
    assert t.step_s == pytest.approx(4 + 3 * 2 + 0.5)
    assert t.bubble_s == pytest.approx(2.0)
    assert t.collectives_s == pytest.approx(0.5)


def test_interleaving_divides_the_bubble_by_the_virtual_stages():
    # p = 2 ranks, v = 2 chunks each of 0.5 s, m = 4: each rank works 1 s per microbatch.
    t = schedule_time([_stage(0.5)] * 4, microbatches=4, schedule="interleaved-1f1b", num_ranks=2)
    plain = schedule_time([_stage(1.0)] * 2, microbatches=4, schedule="1f1b")
    assert t.step_s == pytest.approx(4 * 1.0 + 1 * 0.5)
    assert t.bubble_s == pytest.approx(plain.bubble_s / 2)


def test_in_flight_counts():
    assert [in_flight("1f1b", i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", i, 4, 2) for i in range(4)] == [2, 2, 2, 1]
    assert [in_flight("gpipe", i, 4, 8) for i in range(4)] == [8] * 4
    # Megatron-LM's interleaved warm-up: 2 (p - r - 1) + (v - 1) p, plus the one in progress.
    assert in_flight("interleaved-1f1b", 0, 4, 8, 2) == 2 * 3 + 4 + 1
    assert in_flight("interleaved-1f1b", 3, 4, 8, 2) == 0 + 4 + 1
    assert in_flight("interleaved-1f1b", 0, 4, 2, 2) == 4  # capped at m * v
    # Split-backward schedules: counted on torch's order (planner.split_schedules), from an F
    # until the microbatch's W: ZBV's rank 0 holds 8 = m chunk-microbatches.
    assert in_flight("zbv", 0, 4, 8, 2) == 8
    with pytest.raises(ValueError, match="not priced"):
        in_flight("looped", 0, 4, 8)


def _brute(times, n, p, m):
    best = None
    for cuts in itertools.combinations(range(1, n), p - 1):
        edges = (0, *cuts, n)
        sizes = [edges[i + 1] - edges[i] for i in range(p)]
        ts = [times[i][k] for i, k in enumerate(sizes)]
        if any(math.isinf(t) for t in ts):
            continue
        value = sum(ts) + (m - 1) * max(ts)
        best = value if best is None else min(best, value)
    return best


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 8),
    p=st.integers(1, 4),
    m=st.integers(1, 9),
    data=st.data(),
)
def test_cut_dp_matches_brute_force(n, p, m, data):
    times = [
        [math.inf]
        + [data.draw(st.one_of(st.floats(0.1, 10.0), st.just(math.inf))) for _ in range(n)]
        for _ in range(p)
    ]

    def table(i, k):
        t = times[i][k]
        return None if math.isinf(t) else _stage(t)

    found = best_cuts(table, num_blocks=n, num_stages=p, microbatches=m)
    expected = _brute(times, n, p, m) if p <= n else None
    if expected is None:
        assert found is None
        return
    sizes, value = found
    assert sum(sizes) == n and all(k >= 1 for k in sizes)
    assert value == pytest.approx(expected, rel=1e-12)
    ts = [times[i][k] for i, k in enumerate(sizes)]
    assert sum(ts) + (m - 1) * max(ts) == pytest.approx(expected, rel=1e-12)


def test_even_sizes_put_the_remainder_first():
    assert even_sizes(10, 4) == [3, 3, 2, 2]
    assert even_sizes(8, 8) == [1] * 8
