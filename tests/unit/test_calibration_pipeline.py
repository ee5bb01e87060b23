"""The calibration pipeline's figures from a task timeline (``autopar.tools.calibration_pipeline``):
the gaps between tasks, the wait the simulation charges, the lone tasks' speed-up and the
``busy_rank_speed`` scaled to it, the compute level against the planner's price of the tasks,
on hand-made 2-stage GPipe timelines; the profile keeps them."""

from __future__ import annotations

import dataclasses
import math

import pytest

from autopar.planner.pipeline_schedule import StageCost
from autopar.planner.shared_cores import shared_schedule_time
from autopar.tools.calibration_pipeline import (
    LEVEL_RANGE,
    lone_speedup,
    pipeline_busy_rank_speed,
    pipeline_compute_level,
    priced_stage_tasks,
    round_figures,
    step_terms,
)
from cost_models import get_device, load_profile, save_profile
from cost_models.calibrate import build_profile
from cost_models.compute import matmul_flops

# 2 stages, m = 2, forward 1 s, backward 2 s; per rank (start, end, tasks in its order).
# Rank 0: F0 0.5-1.5 (head 0.5), F1 2.0-3.0 (local gap 0.5), B0 6.7-8.7 (waits for rank 1's B0,
# ended 6.6: dependency 0.1), B1 9.5-11.5 (rank 1's B1 ended 9.0: dependency 0.5).
# Rank 1: F0 1.7-2.7 (dependency 0.2), F1 3.3-4.3 (dependency 0.3), B0 4.6-6.6 (local 0.3),
# B1 7.0-9.0 (local 0.4). Both end at 12.0 (tail 0.5).
GAPS = [
    (0.0, 12.0, [("F", 0.5, 1.5), ("F", 2.0, 3.0), ("B", 6.7, 8.7), ("B", 9.5, 11.5)]),
    (0.1, 12.0, [("F", 1.7, 2.7), ("F", 3.3, 4.3), ("B", 4.6, 6.6), ("B", 7.0, 9.0)]),
]
# No gaps; each rank's first forward and last backward run alone at twice the speed of the
# tasks that overlap the other rank's (rank 0's F1 and B0, rank 1's F0 and B1).
LONE = [
    (0.0, 12.0, [("F", 0.0, 1.0), ("F", 1.0, 3.0), ("B", 6.0, 10.0), ("B", 10.0, 12.0)]),
    (0.0, 12.0, [("F", 1.0, 3.0), ("F", 3.0, 4.0), ("B", 4.0, 6.0), ("B", 6.0, 10.0)]),
]


def test_a_timeline_splits_into_compute_gaps_head_and_tail():
    terms = step_terms(GAPS, "gpipe", 2)
    assert terms["step_s"] == pytest.approx(12.0)
    assert terms["forward_s"] == pytest.approx([1.0, 1.0])
    assert terms["backward_s"] == pytest.approx([2.0, 2.0])
    assert terms["local_s"] == pytest.approx((0.5 + 0.3 + 0.4) / 3)
    assert terms["dependency_s"] == pytest.approx((0.2 + 0.3 + 0.1 + 0.5) / 4)
    assert terms["gap_s"] == pytest.approx(2.3 / 7)
    assert terms["head_s"] == pytest.approx(0.5) and terms["tail_s"] == pytest.approx(0.5)
    with pytest.raises(AssertionError, match="rank 0 ran B where the schedule's order has F"):
        step_terms([(0.0, 1.0, [("B", 0, 1)] * 4), GAPS[1]], "gpipe", 2)


def test_the_wait_is_the_measured_gap_less_the_priced_send():
    """The simulation charges half a stage's sends and the wait after every task, so the wait
    is the gap (2.3 / 7) less 0.1. Session 10's fit: the closed form's 3 x 3.2 plus 6 waits is
    the measured 12.0, so 0.4 (it also takes up the head and tail)."""
    figures = round_figures([GAPS, GAPS], [0.2, 0.2], microbatches=2)
    assert figures["task_wait_s"] == pytest.approx(2.3 / 7 - 0.1)
    assert figures["fitted_task_wait_s"] == pytest.approx(0.4, abs=1e-6)
    assert figures["forward_s"] == pytest.approx([1.0, 1.0])
    assert round_figures([GAPS], [1.0, 1.0], microbatches=2)["task_wait_s"] == 0.0


def test_lone_tasks_give_the_pipelines_speed_up():
    terms = step_terms(LONE, "gpipe", 2)
    assert terms["gap_s"] == pytest.approx(0.0)
    assert lone_speedup([terms]) == pytest.approx((2.0, 2.0))
    # A timeline where no task runs alone has no figure: None in the round, 1 in the profile.
    assert all(math.isnan(x) for x in lone_speedup([step_terms(GAPS, "gpipe", 2)]))
    assert round_figures([GAPS], [0.0, 0.0], microbatches=2)["lone_speedup"] is None


def test_busy_rank_speed_takes_the_probes_shape_and_the_pipelines_size():
    assert pipeline_busy_rank_speed({"1": 2.0, "2": 1.0}, 2.0**0.5, 2.0) == pytest.approx(
        {"1": 2.0**0.5, "2": 1.0}
    )
    four = {"1": 4.0, "2": 2.0, "4": 1.0}
    # Beside 2 computing ranks the probe says 2x alone; the pipeline saw 2x: unchanged.
    assert pipeline_busy_rank_speed(four, 2.0, 2.0) == pytest.approx(four)
    # Saw 1.41x: every speed is the probe's square root.
    half = pipeline_busy_rank_speed(four, 2.0**0.5, 2.2)
    assert half == pytest.approx({k: v**0.5 for k, v in four.items()})
    # No faster alone (noise below 1 included): every rank count at the all-busy speed.
    assert pipeline_busy_rank_speed(four, 0.8, 2.0) == pytest.approx(dict.fromkeys(four, 1.0))
    assert pipeline_busy_rank_speed({}, 2.0, 2.0) == {}
    assert pipeline_busy_rank_speed({"1": 1.0, "2": 1.0}, 3.0, 2.0) == {"1": 1.0, "2": 1.0}


def test_the_pipelines_figures_round_trip_in_the_profile_and_old_profiles_load(tmp_path):
    device = dataclasses.replace(
        get_device("cpu"), busy_rank_speed={"1": 1.1, "2": 1.0}, task_wait_s=0.00245
    )
    figures = round_figures([GAPS], [0.2, 0.2], microbatches=2)
    meta = {"measurements": {"busy_rank_speed": {"probe": {"1": 1.58, "2": 1.0}},
                             "task_wait": {"rounds": [figures], "lone_speedup": 1.1,
                                           "together_ranks": 1.98,
                                           "fitted_task_wait_s": 0.0032}}}  # fmt: skip
    profile = build_profile(device=device, links={}, meta=meta)
    save_profile(profile, tmp_path / "p.json")
    loaded = load_profile(tmp_path / "p.json")
    assert loaded.device == device and loaded.meta == profile.meta
    assert loaded.meta["measurements"]["task_wait"]["rounds"][0]["lone_speedup"] is None
    # A session-10 profile (no probe, no gaps) loads with its figures as they were.
    old = {"version": 1, "device": {"base": "cpu", "busy_rank_speed": {"1": 1.3, "2": 1.0},
                                    "task_wait_s": 0.002}}  # fmt: skip
    assert load_profile(old).device.busy_rank_speed == {"1": 1.3, "2": 1.0}


def test_the_rounds_keep_the_ranks_computing_during_each_stages_tasks():
    """LONE: each stage's forwards are one alone and one beside the other rank's, so both kinds
    average 1.5 ranks on both stages; GAPS: rank 0's F0 and B1 and rank 1's F1 run alone."""
    figures = round_figures([LONE], [0.0, 0.0], microbatches=2)
    assert figures["forward_ranks"] == pytest.approx([1.5, 1.5])
    assert figures["backward_ranks"] == pytest.approx([1.5, 1.5])
    gaps = round_figures([GAPS], [0.0, 0.0], microbatches=2)
    # Rank 0's F1 (2.0-3.0) is overlapped 0.7 s by rank 1's F0 (1.7-2.7): 1.7 ranks.
    assert gaps["forward_ranks"][0] == pytest.approx((1.0 + 1.7) / 2)


def test_the_compute_level_is_how_fast_the_pipeline_ran_against_its_price():
    """LONE's tasks are priced at 2 s forward and 4 s backward with every rank busy: at the
    curve {1: 2, 2: 1} the lone ones take 1 and 2 s, the overlapped ones 2 and 4 s, as LONE
    ran: level 1. Priced twice as slow, level 2; a round of a profile before the concurrencies
    were kept gives none."""
    rounds = [round_figures([LONE], [0.0, 0.0], microbatches=2)]
    curve = {"1": 2.0, "2": 1.0}
    assert pipeline_compute_level(rounds, [2.0, 2.0], [4.0, 4.0], curve) == pytest.approx(1.0)
    assert pipeline_compute_level(rounds, [4.0, 4.0], [8.0, 8.0], curve) == pytest.approx(2.0)
    # Without the lone speed-up in the curve, the same tasks ran 1.33x faster than priced.
    flat = {"1": 1.0, "2": 1.0}
    assert pipeline_compute_level(rounds, [2.0, 2.0], [4.0, 4.0], flat) == pytest.approx(4 / 3)
    old = [{k: v for k, v in rounds[0].items() if not k.endswith("_ranks")}]
    assert pipeline_compute_level(old, [2.0, 2.0], [4.0, 4.0], curve) is None
    # Against the rate probed before the round: the machine ran at half the profile's peak
    # then, so the same tasks ran twice as fast as priced at that moment.
    probed = [dict(rounds[0], matmul_flops=50.0)]
    at_rate = pipeline_compute_level(probed, [2.0, 2.0], [4.0, 4.0], curve, peak_flops=100.0)
    assert at_rate == pytest.approx(2.0)
    assert pipeline_compute_level(rounds, [2.0] * 2, [4.0] * 2, curve, peak_flops=1.0) is None
    assert LEVEL_RANGE[0] < 1 < LEVEL_RANGE[1]


def test_the_simulation_at_a_level_prices_stages_that_much_faster():
    """``busy_rank_speed`` times a level is the same step as the stages' compute over it."""
    stages = [StageCost(forward_s=1.0, backward_s=2.0, p2p_s=0.1),
              StageCost(forward_s=1.5, backward_s=2.5, p2p_s=0.1)]  # fmt: skip
    curve, level = {"1": 1.6, "2": 1.0}, 1.4
    for schedule in ("gpipe", "1f1b"):
        scaled = shared_schedule_time(stages, microbatches=4, schedule=schedule,
                                      busy_rank_speed={k: v * level for k, v in curve.items()},
                                      task_wait_s=0.01)  # fmt: skip
        faster = [StageCost(forward_s=s.forward_s / level, backward_s=s.backward_s / level,
                            p2p_s=s.p2p_s) for s in stages]  # fmt: skip
        same = shared_schedule_time(faster, microbatches=4, schedule=schedule,
                                    busy_rank_speed=curve, task_wait_s=0.01)  # fmt: skip
        assert scaled.step_s == pytest.approx(same.step_s)
        assert scaled.compute_s == pytest.approx(same.compute_s)


def test_the_calibration_stage_is_priced_as_the_planner_prices_linear_layers():
    """At width 1024 the matmuls dominate: a forward is 4 linears' FLOPs at the matmul rate;
    a backward twice that, less stage 0's first input gradient (no gradient wanted there)."""
    device = get_device("cpu")
    rate = device.peak_flops["float32"] * device.matmul_efficiency
    forward, backward = priced_stage_tasks(device, width=1024, rows=256, layers=4, world=2)
    one = matmul_flops(256, 1024, 1024) / rate
    assert forward == pytest.approx([4 * one, 4 * one], rel=0.02)
    assert backward[1] == pytest.approx(8 * one, rel=0.02)
    assert backward[0] == pytest.approx(7 * one, rel=0.02)
