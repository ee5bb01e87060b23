"""Pipelines on ranks that share cores: ``DeviceSpec.busy_rank_speed`` and the simulated
GPipe / 1F1B step (``autopar.planner.shared_cores``), against the closed form and by hand."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.planner.pipeline_schedule import StageCost, schedule_time
from autopar.planner.shared_cores import rank_order, speed_at
from cost_models import load_profile
from cost_models.hardware import DeviceSpec, get_device


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (2, 8), (3, 5), (4, 4), (4, 8)])
def test_uniform_speed_gives_the_closed_form(schedule, stages, microbatches):
    equal = [StageCost(forward_s=1.0, backward_s=2.0, p2p_s=0.2, step_s=0.1)] * stages
    closed = schedule_time(equal, microbatches=microbatches, schedule=schedule)
    simulated = schedule_time(
        equal, microbatches=microbatches, schedule=schedule, busy_rank_speed={"1": 1.0}
    )
    for field in ("step_s", "bubble_s", "compute_s", "p2p_s", "collectives_s"):
        assert getattr(simulated, field) == pytest.approx(getattr(closed, field), rel=1e-9)


def test_a_stage_computing_alone_runs_at_its_solo_speed():
    """2 stages, 2 microbatches, GPipe, forward 1 and backward 2 at the all-busy speed, twice
    as fast alone: F0 on stage 0 alone (0.5), F1 and stage 1's F0 together (1.0), stage 1's F1
    alone (0.5), its B0 alone (1.0), its B1 with stage 0's B0 (2.0), stage 0's B1 alone (1.0)."""
    stages = [StageCost(forward_s=1.0, backward_s=2.0)] * 2
    t = schedule_time(
        stages, microbatches=2, schedule="gpipe", busy_rank_speed={"1": 2.0, "2": 1.0}
    )
    assert t.step_s == pytest.approx(6.0)  # the closed form says 9.0
    assert t.compute_s == pytest.approx(4.5) and t.bubble_s == pytest.approx(1.5)
    # Two ranks per stage (dp=2): one stage computing is two busy ranks, the all-busy speed.
    assert schedule_time(
        stages, microbatches=2, schedule="gpipe", busy_rank_speed={"2": 2.0, "4": 1.0},
        ranks_per_stage=2,
    ).step_s == pytest.approx(6.0)  # fmt: skip


def test_unequal_stages_follow_each_schedules_order():
    """Stages of forward 1, 3, 2 (backward twice, sends 0.1), 6 microbatches, uniform speed.
    GPipe: the closed form, 18.3 + 5 * 9.1 = 63.8. 1F1B: stage 1 (the slowest) runs F0 and F1,
    waits for stage 2's B0 until 10.2, then computes its remaining 48.5 with one wait of 0.05
    (stage 2's B5 ends at 52.7, after stage 1's B4 at 52.65), and stage 0's last backward
    (2.05) follows: 60.8, less than the closed form, which charges the slowest stage the
    whole ramp (sum_i t_i - max_i t_i) as GPipe pays it."""
    stages = [StageCost(forward_s=f, backward_s=2 * f, p2p_s=0.1) for f in (1.0, 3.0, 2.0)]
    speed = {"3": 1.0}
    gpipe = schedule_time(stages, microbatches=6, schedule="gpipe", busy_rank_speed=speed)
    one_f_one_b = schedule_time(stages, microbatches=6, schedule="1f1b", busy_rank_speed=speed)
    assert schedule_time(stages, microbatches=6, schedule="1f1b").step_s == pytest.approx(63.8)
    assert gpipe.step_s == pytest.approx(63.8)
    assert one_f_one_b.step_s == pytest.approx(60.8)


def test_1f1b_order_is_warmup_then_alternate_then_drain():
    assert rank_order("1f1b", 0, 3, 4) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)
    ]  # fmt: skip
    assert rank_order("1f1b", 2, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    with pytest.raises(ValueError, match="not simulated"):
        rank_order("interleaved-1f1b", 0, 2, 4)


def test_speed_interpolates_seconds_per_work_between_measured_counts():
    table = {"1": 2.0, "4": 1.0}
    assert speed_at(table, 1) == 2.0 and speed_at(table, 4) == 1.0
    assert speed_at(table, 2) == pytest.approx(1 / (0.5 + 0.5 / 3))
    assert speed_at(table, 8) == 1.0 and speed_at({}, 3) == 1.0


def test_presets_have_no_busy_rank_speed_so_their_plans_keep_the_closed_form():
    h100 = get_device("h100")
    assert not h100.busy_rank_speed and "busy_rank_speed" not in h100.to_dict()
    stages = [StageCost(forward_s=1.0, backward_s=2.0)] * 2
    assert schedule_time(
        stages, microbatches=2, schedule="gpipe", busy_rank_speed=h100.busy_rank_speed
    ).step_s == pytest.approx(9.0)


def test_busy_rank_speed_round_trips_and_bad_values_are_one_line_errors():
    spec = dataclasses.replace(get_device("cpu"), busy_rank_speed={"1": 1.8, "2": 1.0})
    loaded = load_profile({"version": 1, "device": spec.to_dict()}).device
    assert loaded == spec and dict(loaded.busy_rank_speed) == {"1": 1.8, "2": 1.0}
    with pytest.raises(ValueError, match="busy_rank_speed needs rank counts >= 1"):
        DeviceSpec.from_dict({"base": "cpu", "busy_rank_speed": {"0": 1.0}})
    with pytest.raises(ValueError, match="busy_rank_speed needs rank counts >= 1"):
        DeviceSpec.from_dict({"base": "cpu", "busy_rank_speed": {"2": -1.0}})
    with pytest.raises(ValueError, match="busy_rank_speed"):
        load_profile({"version": 1, "device": {"base": "cpu", "busy_rank_speed": {"x": 1.0}}})


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_wait_per_task_lies_on_every_task_of_the_critical_path(schedule):
    """2 stages, 2 microbatches, forward 1 and backward 2, a wait of 0.5 after every task.
    GPipe: stage 0's F0 and F1 end at 1.5 and 3.0 (each with its wait); stage 1's F0 at 3.0,
    its F1 (after stage 0's F1) at 4.5, B0 at 7.0, B1 at 9.5; stage 0's B0 (after stage 1's B0)
    at 9.5 and B1 (after stage 1's B1) at 12.0. 1F1B: stage 1 runs F0 B0 F1 B1, ending 3.0,
    5.5, 7.0, 9.5; stage 0's B0 ends 8.0, B1 12.0. Both: the closed form's 9.0 plus the wait on
    6 tasks, each rank's 4 (2 m) and the ramp's 2 (2 (p - 1)); the waits are idle time."""
    stages = [StageCost(forward_s=1.0, backward_s=2.0)] * 2
    t = schedule_time(stages, microbatches=2, schedule=schedule, task_wait_s=0.5)
    assert t.step_s == pytest.approx(9.0 + 6 * 0.5)
    assert t.compute_s == pytest.approx(6.0) and t.bubble_s == pytest.approx(6.0)
    # Equal stages, any shape: (2 m + 2 (p - 1)) waits, with and without sends and shared cores.
    for p, m in ((2, 8), (4, 4), (4, 8)):
        equal = [StageCost(forward_s=1.0, backward_s=2.0, p2p_s=0.2, step_s=0.1)] * p
        plain = schedule_time(equal, microbatches=m, schedule=schedule)
        waited = schedule_time(equal, microbatches=m, schedule=schedule, task_wait_s=0.25)
        assert waited.step_s - plain.step_s == pytest.approx((2 * m + 2 * (p - 1)) * 0.25)
        speed = {"1": 2.0, str(p): 1.0}
        shared = schedule_time(equal, microbatches=m, schedule=schedule, busy_rank_speed=speed)
        both = schedule_time(
            equal, microbatches=m, schedule=schedule, busy_rank_speed=speed, task_wait_s=0.25
        )
        assert both.step_s > shared.step_s
    # Interleaved 1F1B keeps the closed form.
    assert schedule_time(
        stages * 2, microbatches=4, schedule="interleaved-1f1b", num_ranks=2, task_wait_s=0.5
    ).step_s == schedule_time(
        stages * 2, microbatches=4, schedule="interleaved-1f1b", num_ranks=2
    ).step_s  # fmt: skip


def test_fitting_the_wait_inverts_the_simulation():
    """Calibration's fit (autopar.tools.calibration_pipeline) finds the wait that produced a
    simulated step, on unequal stages with sends."""
    from autopar.tools.calibration_pipeline import fit_task_wait

    forward, backward, p2p = [0.004, 0.006, 0.005], [0.008, 0.011, 0.01], [0.001, 0.002, 0.001]
    stages = [
        StageCost(forward_s=f, backward_s=b, p2p_s=s) for f, b, s in zip(forward, backward, p2p)
    ]
    step = schedule_time(stages, microbatches=4, schedule="gpipe", task_wait_s=0.0073).step_s
    wait = fit_task_wait(step, forward, backward, p2p, microbatches=4)
    assert wait == pytest.approx(0.0073, abs=1e-6)
    no_wait = schedule_time(stages, microbatches=4, schedule="gpipe", busy_rank_speed={"3": 1.0})
    assert fit_task_wait(no_wait.step_s * 0.9, forward, backward, p2p, microbatches=4) == 0.0


def test_task_wait_round_trips_and_old_profiles_load_without_it():
    spec = dataclasses.replace(get_device("cpu"), task_wait_s=0.0081)
    assert spec.to_dict()["task_wait_s"] == 0.0081
    loaded = load_profile({"version": 1, "device": spec.to_dict()}).device
    assert loaded == spec and loaded.task_wait_s == 0.0081
    old = {"version": 1, "device": {"base": "cpu", "busy_rank_speed": {"1": 1.3, "2": 1.0}}}
    assert load_profile(old).device.task_wait_s == 0.0
    assert "task_wait_s" not in get_device("h100").to_dict()  # presets' documents unchanged
    with pytest.raises(ValueError, match="task_wait_s must be >= 0"):
        DeviceSpec.from_dict({"base": "cpu", "task_wait_s": -1e-3})


def test_a_rank_ready_while_every_core_computes_waits_for_a_core():
    """2 stages sharing 1 core (half speed each when both compute), GPipe, 2 microbatches,
    forward 1 and backward 2. Sharing alone: stage 1's F0 shares the core with stage 0's F1
    (2 s each), and its B1 with stage 0's B0 (4 s each): step 12, the busiest rank's compute
    9 s of wall. Waiting for the core (session 26): stage 1's F0 becomes ready while stage 0
    computes and starts when that ends, and stage 1's B1 likewise: the same step (the core does
    the same work), but each task runs alone, 6 s, and the waits are idle time."""
    stages = [StageCost(forward_s=1.0, backward_s=2.0)] * 2
    kw = {"microbatches": 2, "schedule": "gpipe", "busy_rank_speed": {"1": 1.0, "2": 0.5}}
    shared = schedule_time(stages, **kw)
    assert (shared.step_s, shared.compute_s, shared.bubble_s) == pytest.approx((12, 9, 3))
    waited = schedule_time(stages, **kw, core_wait_s={"1": 10.0})
    assert (waited.step_s, waited.compute_s, waited.bubble_s) == pytest.approx((12, 6, 6))
    # A wait shorter than the task: stage 1 starts after 0.5 s and shares the rest (F0 of
    # stage 1 over 1.5-3.0, its B1 alike), so 1 s of each shared pair's stretch is left.
    short = schedule_time(stages, **kw, core_wait_s={"1": 0.5})
    assert (short.step_s, short.compute_s, short.bubble_s) == pytest.approx((12, 8, 4))
    # No wait, or as many cores as ranks: sharing alone, as before.
    assert schedule_time(stages, **kw, core_wait_s={"1": 0.0}) == shared
    assert schedule_time(stages, **kw, core_wait_s={"2": 10.0}) == shared


def test_core_wait_round_trips_and_bad_values_are_one_line_errors():
    spec = dataclasses.replace(get_device("cpu"), core_wait_s={"2": 0.004})
    loaded = load_profile({"version": 1, "device": spec.to_dict()}).device
    assert loaded == spec and dict(loaded.core_wait_s) == {"2": 0.004}
    assert "core_wait_s" not in get_device("cpu").to_dict()  # presets' documents unchanged
    with pytest.raises(ValueError, match="core_wait_s needs core counts >= 1"):
        DeviceSpec.from_dict({"base": "cpu", "core_wait_s": {"0": 0.004}})
    with pytest.raises(ValueError, match="core_wait_s needs core counts >= 1"):
        DeviceSpec.from_dict({"base": "cpu", "core_wait_s": {"2": -1.0}})
    with pytest.raises(ValueError, match="core_wait_s"):
        load_profile({"version": 1, "device": {"base": "cpu", "core_wait_s": {"x": 1.0}}})


def test_the_gaps_spread_lengthens_the_step_and_its_idle_share():
    """Session 27: gaps drawn around the same mean (0.3 s: -0.3 s three times in four, +0.9 s
    once) lengthen the step, the longest of the schedule's paths, and its idle share; gaps
    without spread give the mean's step, and the drawn gaps replace the wait for a core."""
    stages = [StageCost(forward_s=1.0, backward_s=2.0, p2p_s=0.2)] * 4
    run = dict(microbatches=8, schedule="1f1b", busy_rank_speed={"1": 1.0}, task_wait_s=0.5)
    mean = schedule_time(stages, **run)
    flat = schedule_time(stages, **run, task_gap_s=(0.3, 0.3), core_wait_s={"1": 10.0})
    spread = schedule_time(stages, **run, task_gap_s=(0.0, 0.0, 0.0, 1.2))
    assert flat.step_s == pytest.approx(mean.step_s, rel=1e-9)
    assert flat.bubble_s == pytest.approx(mean.bubble_s, rel=1e-9)
    assert spread.step_s > 1.03 * mean.step_s
    assert spread.bubble_fraction > mean.bubble_fraction + 0.02
    assert spread.compute_s == pytest.approx(mean.compute_s, rel=1e-9)  # the same work
    assert schedule_time(stages, **run, task_gap_s=(0.0, 0.0, 0.0, 1.2)) == spread  # seeded


def test_task_gap_round_trips_and_bad_values_are_one_line_errors():
    spec = dataclasses.replace(get_device("cpu"), task_gap_s=[0.0005, 0.001, 0.02])
    loaded = load_profile({"version": 1, "device": spec.to_dict()}).device
    assert loaded == spec and loaded.task_gap_s == (0.0005, 0.001, 0.02)
    assert "task_gap_s" not in get_device("cpu").to_dict()  # presets' documents unchanged
    with pytest.raises(ValueError, match="task_gap_s needs ascending seconds >= 0"):
        DeviceSpec.from_dict({"base": "cpu", "task_gap_s": [0.002, 0.001]})
    with pytest.raises(ValueError, match="task_gap_s"):
        load_profile({"version": 1, "device": {"base": "cpu", "task_gap_s": [-1.0]}})


def test_the_gaps_are_drawn_by_the_ranks_computing_when_a_task_becomes_ready():
    """Session 29: with a table per count of other ranks computing, a task's gap comes from
    its count's table (the largest count at or below it with a table, else the smallest),
    around ``task_gap_s``'s mean: a table for every count alike is the pooled one; a long gap
    for tasks ready beside computing ranks lengthens the step more than one for tasks ready
    alone, with the same work."""
    stages = [StageCost(forward_s=1.0, backward_s=2.0, p2p_s=0.2)] * 4
    run = dict(microbatches=8, schedule="1f1b", busy_rank_speed={"1": 1.0}, task_wait_s=0.5,
               task_gap_s=(0.3, 0.3))  # fmt: skip
    flat = schedule_time(stages, **run)
    assert schedule_time(stages, **run, task_gap_by_others_s={"0": (0.3, 0.3)}) == flat
    # Only a table for one other rank or more: a task ready alone draws from it too.
    every = schedule_time(stages, **run, task_gap_by_others_s={"1": (1.3,)})
    longer_wait = schedule_time(stages, **{**run, "task_wait_s": 1.5})
    assert every.step_s == pytest.approx(longer_wait.step_s, rel=1e-9)
    beside = schedule_time(stages, **run, task_gap_by_others_s={"0": (0.3,), "1": (1.3,)})
    alone = schedule_time(stages, **run, task_gap_by_others_s={"0": (1.3,), "1": (0.3,)})
    assert flat.step_s + 1.0 < alone.step_s < beside.step_s < every.step_s
    assert beside.compute_s == pytest.approx(flat.compute_s, rel=1e-9)
    assert beside.bubble_fraction > alone.bubble_fraction > flat.bubble_fraction


def test_gaps_by_others_round_trip_and_bad_values_are_one_line_errors():
    spec = dataclasses.replace(get_device("cpu"), task_gap_s=[0.001, 0.002],
                               task_gap_by_others_s={0: [0.001], "2": [0.002, 0.004]})  # fmt: skip
    assert spec.task_gap_by_others_s == {"0": (0.001,), "2": (0.002, 0.004)}
    loaded = load_profile({"version": 1, "device": spec.to_dict()}).device
    assert loaded == spec
    assert "task_gap_by_others_s" not in get_device("cpu").to_dict()  # presets unchanged
    with pytest.raises(ValueError, match="task_gap_by_others_s needs counts >= 0 as keys"):
        DeviceSpec.from_dict({"base": "cpu", "task_gap_by_others_s": {"-1": [0.1]}})
    with pytest.raises(ValueError, match=r"task_gap_by_others_s\['1'\] needs ascending"):
        DeviceSpec.from_dict({"base": "cpu", "task_gap_by_others_s": {"1": [0.2, 0.1]}})
    with pytest.raises(ValueError, match="task_gap_by_others_s"):
        load_profile({"version": 1, "device": {"base": "cpu",
                                               "task_gap_by_others_s": {"x": [0.1]}}})  # fmt: skip
