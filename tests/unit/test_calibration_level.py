"""The calibration pipeline's compute level in thread CPU time (``autopar.tools.calibration_level``)
and the pipeline check's pricing at the ranks' CPU share (``benchmarks/pipeline_cpu.py``), from
recorded timings: nothing here is timed."""

from __future__ import annotations

import pytest

from autopar.tools.calibration_level import (
    cpu_compute_level,
    cpu_share,
    foreign_threads,
    round_cpu_figures,
    round_cpu_share,
    shared_core_speed,
    task_cpu_means,
    timed_task,
)
from benchmarks.pipeline_cpu import priced_at_share, repetition_figures

# A round of calibration's 2-stage pipeline as recorded: wall seconds per task (forward,
# backward per stage) and the thread CPU seconds the same tasks took.
ROUND = {
    "forward_s": [0.020, 0.030],
    "backward_s": [0.040, 0.060],
    "forward_cpu_s": [0.010, 0.015],
    "backward_cpu_s": [0.020, 0.030],
}


def test_task_cpu_means_are_per_kind():
    spans = [("F", 0.01), ("F", 0.03), ("B", 0.05)]
    assert task_cpu_means(spans) == pytest.approx((0.02, 0.05))
    assert task_cpu_means([("F", 0.01)]) == pytest.approx((0.01, 0.0))


def test_a_rounds_cpu_figures_are_the_median_over_its_steps():
    # Three steps of 2 ranks: [[forward, backward] of rank 0, of rank 1].
    steps = [[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]], [[2.0, 9.0], [4.0, 1.0]]]
    figures = round_cpu_figures(steps)
    assert figures["forward_cpu_s"] == [2.0, 4.0]
    assert figures["backward_cpu_s"] == [6.0, 4.0]


def test_the_cpu_level_is_the_price_over_the_cpu_seconds():
    # Priced as the CPU seconds: level 1; priced twice as long: 2; the wall seconds (twice the
    # CPU) do not enter it.
    assert cpu_compute_level([ROUND], [0.010, 0.015], [0.020, 0.030]) == pytest.approx(1.0)
    assert cpu_compute_level([ROUND], [0.020, 0.030], [0.040, 0.060]) == pytest.approx(2.0)
    # The median over rounds, stages and kinds: one slow round does not move it.
    slow = dict(ROUND, forward_cpu_s=[0.1, 0.1], backward_cpu_s=[0.2, 0.2])
    rounds = [ROUND, ROUND, slow]
    assert cpu_compute_level(rounds, [0.010, 0.015], [0.020, 0.030]) == pytest.approx(1.0)


def test_no_cpu_level_without_cpu_figures():
    old = {k: v for k, v in ROUND.items() if "cpu" not in k}
    assert cpu_compute_level([old], [0.01, 0.01], [0.02, 0.02]) is None
    zero = dict(ROUND, forward_cpu_s=[0.0, 0.0], backward_cpu_s=[0.0, 0.0])
    assert cpu_compute_level([zero], [0.01, 0.01], [0.02, 0.02]) is None
    assert round_cpu_share(old) is None


def test_the_share_is_cpu_over_wall_at_most_one():
    assert round_cpu_share(ROUND) == pytest.approx(0.5)
    assert cpu_share(0.3, 0.4) == pytest.approx(0.75)
    assert cpu_share(0.41, 0.4) == 1.0
    with pytest.raises(ValueError, match="positive seconds"):
        cpu_share(0.0, 1.0)


def test_timed_task_records_wall_and_thread_cpu_spans():
    class Stage:
        spans: list = []
        cpu_spans: list = []

    stage = Stage()
    stage.spans, stage.cpu_spans = [], []
    assert timed_task(stage, "B", lambda: 7) == 7
    (kind, start, end), (cpu_kind, cpu) = stage.spans[0], stage.cpu_spans[0]
    assert (kind, cpu_kind) == ("B", "B") and end >= start and cpu >= 0.0


# Two ranks' rows of a repetition's two steps: step wall, busy, tasks' CPU, tasks' wall.
ROWS = [
    [[1.0, 0.6, 0.30, 0.60], [1.0, 0.8, 0.40, 0.80]],
    [[1.2, 0.7, 0.30, 0.60], [1.1, 0.9, 0.40, 0.80]],
]


def test_a_repetition_gives_the_step_idle_and_each_ranks_share():
    figures = repetition_figures(ROWS)
    assert figures["step_s"] == pytest.approx(1.1)  # median of the slowest ranks' 1.0 and 1.2
    assert figures["idle"] == pytest.approx((0.2 + (1 - 0.9 / 1.2)) / 2)
    assert figures["shares"] == pytest.approx([0.5, 0.5])


def _case(schedule: str) -> dict:
    stage = {"forward_s": 0.01, "backward_s": 0.02, "p2p_s": 0.0, "grad_sync_s": 0.0}
    return {
        "stages": [stage, stage],
        "microbatches": 4,
        "schedule": schedule,
        "predicted": {"step_s": 1.0, "bubble_fraction": 0.2},
    }


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pricing_at_the_share_divides_the_stages_by_level_and_share(schedule):
    """2 equal stages, m = 4, no sends or wait: (m + p - 1) x (f + b). CPU seconds c per priced second and a share s
    make every task t x c / s; halving the share doubles the step and keeps the bubble."""
    base = priced_at_share(_case(schedule), [1.0, 1.0], 1.0, 0.0)
    assert base.step_s == pytest.approx(5 * 0.03)
    half = priced_at_share(_case(schedule), [0.5, 0.5], 1.0, 0.0)
    assert half.step_s == pytest.approx(2 * base.step_s)
    assert half.bubble_fraction == pytest.approx(base.bubble_fraction)
    leveled = priced_at_share(_case(schedule), [0.5, 0.5], 0.5, 0.0)
    assert leveled.step_s == pytest.approx(base.step_s)
    # One slow rank (share 0.25) stretches the step past the equal-shares one.
    uneven = priced_at_share(_case(schedule), [1.0, 0.25], 1.0, 0.0)
    assert uneven.step_s > priced_at_share(_case(schedule), [0.5, 0.5], 1.0, 0.0).step_s


def test_the_summary_prices_each_way_and_counts_the_rows_within_20_percent():
    """Measured 150 ms at share 1 against stages priced 5 x 30 ms: 1 CPU second per priced
    second predicts it exactly; 0.5 (the pipeline level 2) predicts half of it."""
    from benchmarks.pipeline_cpu import markdown, summarize

    case = dict(_case("gpipe"), key="x/gpipe/m4")
    case["stages"] = [dict(s, blocks=[0]) for s in case["stages"]]
    step = [[0.15, 0.12, 0.12, 0.12], [0.15, 0.12, 0.12, 0.12]]
    measured = {"x/gpipe/m4": [{"rows": [step, step], "load": 1.0}] * 3}
    (row,) = summarize([case], measured, {"ops": 1.0, "level": 0.5}, 0.0)
    assert row["ratio"] == pytest.approx(1.0) and row["predicted_s"] == pytest.approx(0.15)
    assert row["by_way"]["level"]["ratio"] == pytest.approx(2.0)
    assert row["idle"] == pytest.approx(0.2) and row["shares"] == pytest.approx([1.0, 1.0])
    assert "1 of 1 at the CPU share (ops), 0 of 1 (level); raw 0 of 1" in markdown(2, [row])


def test_shared_cores_give_each_computing_rank_its_share_of_a_core_times_the_cpu_level():
    """Session 25: 4 ranks on 2 cores; alone or in pairs each rank has a core, 3 share 2 cores,
    4 get half a core each; 2 other runnable threads take their share from every count."""
    assert shared_core_speed(2.0, 4, 2, 0.0) == pytest.approx(
        {"1": 2.0, "2": 2.0, "3": 4 / 3, "4": 1.0}
    )
    assert shared_core_speed(2.0, 4, 2, 2.0) == pytest.approx(
        {"1": 4 / 3, "2": 1.0, "3": 0.8, "4": 2 / 3}
    )
    assert shared_core_speed(1.5, 2, 8, 1.0) == {"1": 1.5, "2": 1.5}
    for bad in ((0.0, 2, 2, 0.0), (1.0, 0, 2, 0.0), (1.0, 2, 0, 0.0), (1.0, 2, 2, -1.0)):
        with pytest.raises(ValueError, match="shared_core_speed needs"):
            shared_core_speed(*bad)


def _round(shares: list[float], ranks: list[float]) -> dict[str, list[float]]:
    """A 2-stage round whose forward and backward tasks got ``shares`` of a core beside
    ``ranks`` computing ranks (the same for both kinds)."""
    wall = [0.02, 0.03]
    return {
        "forward_s": wall,
        "backward_s": [2 * w for w in wall],
        "forward_cpu_s": [w * s for w, s in zip(wall, shares)],
        "backward_cpu_s": [2 * w * s for w, s in zip(wall, shares)],
        "forward_ranks": ranks,
        "backward_ranks": ranks,
    }


def test_other_threads_are_the_least_that_explain_the_pipelines_share_at_its_quietest_round():
    """2 cores, 2 ranks. With 2 other runnable threads a lone task gets 2/3 of a core and a
    task beside the other rank 1/2; beside 1.5 ranks (the planner's interpolation in seconds
    per unit of work) 1/1.75. A whole core says nothing of load it did not meet: 0. The least
    round counts, and rounds without CPU figures or concurrencies are skipped."""
    loaded = _round([2 / 3, 1 / 2], [1.0, 2.0])
    assert foreign_threads([loaded], 2) == pytest.approx(2.0, abs=1e-5)
    between = _round([1 / 1.75, 1 / 1.75], [1.5, 1.5])
    assert foreign_threads([between], 2) == pytest.approx(2.0, abs=1e-5)
    quiet = _round([1.0, 1.0], [1.5, 2.0])
    assert foreign_threads([quiet], 2) == 0.0
    assert foreign_threads([loaded, _round([0.8, 0.8], [2.0, 2.0])], 2) == pytest.approx(
        0.5, abs=1e-5
    )  # 2 / (2 + 0.5) = 0.8
    old = {k: v for k, v in loaded.items() if not k.endswith("_ranks")}
    assert foreign_threads([old, dict(ROUND)], 2) is None
    assert foreign_threads([old, loaded], 2) == pytest.approx(2.0, abs=1e-5)
