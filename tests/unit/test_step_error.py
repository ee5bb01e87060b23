"""The calibrated profile's own error (``DeviceSpec.step_error``): the standard error of its
figures, from the spread of the calibration's repeated measurements; stored in the profile only
where measured, so that datasheet devices (error 0) and the plans made with them do not
change."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models import get_device, load_profile
from cost_models.calibrate import (
    STEP_ERROR_MAX,
    fit_step_error,
    paired_error_of,
    paired_spreads,
    relative_spread,
    step_error_of,
)
from cost_models.hardware import DeviceSpec


def test_relative_spread_is_the_median_deviation_over_the_median() -> None:
    assert relative_spread([1.0, 1.1, 0.9]) == pytest.approx(0.1)
    assert relative_spread([2.0, 2.0, 2.0, 2.0]) == 0.0
    # One descheduled trial out of five does not move it.
    assert relative_spread([1.0, 1.1, 0.9, 1.0, 9.0]) == pytest.approx(0.1)
    assert relative_spread([3.0]) == 0.0 and relative_spread([]) == 0.0


def test_step_error_is_the_standard_error_of_the_median_figure() -> None:
    # median spread 0.05 over 4 trials: 1.4826 * 1.2533 * 0.05 / 2
    assert fit_step_error([0.01, 0.3, 0.05], 4) == pytest.approx(0.04645, rel=1e-3)
    assert fit_step_error([0.9, 0.8], 1) == STEP_ERROR_MAX
    with pytest.raises(ValueError, match="at least one spread"):
        fit_step_error([], 5)
    with pytest.raises(ValueError, match=">= 0"):
        fit_step_error([0.1, -0.2], 5)


def test_step_error_round_trips_and_is_written_only_when_measured() -> None:
    h100 = get_device("h100")
    assert h100.step_error == 0.0 and "step_error" not in h100.to_dict()
    noisy = dataclasses.replace(h100, step_error=0.08)
    assert noisy.to_dict()["step_error"] == 0.08
    assert DeviceSpec.from_dict(noisy.to_dict()) == noisy
    profile = load_profile({"version": 1, "device": {"base": "h100", "step_error": 0.08}})
    assert profile.device.step_error == 0.08
    with pytest.raises(ValueError, match="step_error"):
        load_profile({"version": 1, "device": {"base": "h100", "step_error": 1.5}})


def test_paired_spread_cancels_load_that_falls_on_both_sides_of_a_trial() -> None:
    # Five trials whose load scales both kinds alike (1x-3x): each figure moves by 50% or more,
    # their per-trial ratio not at all.
    load = [1.0, 1.5, 3.0, 1.2, 2.0]
    times = {"all_reduce": [2.0 * f for f in load], "all_gather": [1.0 * f for f in load]}
    assert relative_spread(times["all_reduce"]) == pytest.approx(0.5 / 1.5)
    assert paired_spreads(times) == {"all_reduce/all_gather": 0.0}
    # Noise of its own on one side: ratios 2.0, 2.2, 1.8, 2.0, 2.0 -> deviations 0, .2, .2, 0, 0
    times["all_reduce"] = [2.0 * f * e for f, e in zip(load, [1.0, 1.1, 0.9, 1.0, 1.0])]
    times["compute"] = [4.0 * f for f in load]
    spreads = paired_spreads(times)
    assert list(spreads) == ["all_reduce/all_gather", "all_reduce/compute", "all_gather/compute"]
    assert spreads["all_reduce/all_gather"] == pytest.approx(0.0)  # median deviation: 0 of 5
    times["all_reduce"][0] = 2.0 * 1.1  # now deviations 0.2, 0.2, 0.2, 0, 0 -> median 0.2 / 2
    assert paired_spreads(times)["all_reduce/all_gather"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="differ in number"):
        paired_spreads({"a": [1.0, 2.0], "b": [1.0]})


def test_paired_error_uses_the_step_error_formula_over_the_kept_paired_spreads() -> None:
    links = {
        "a0/all_reduce": {"spread": [0.3, 0.3]},  # one figure's noise: not a paired spread
        "a0/paired": {"paired_spread": {"all_reduce/all_gather": [0.02, 0.04], "x/y": [0.06]}},
        "a0/sync": {"paired_spread": {"compute/collective": 0.08}},
    }
    # spreads 0.02, 0.04, 0.06, 0.08 -> median 0.05; 4 trials: 1.4826 * 1.2533 * 0.05 / 2
    assert paired_error_of(links, 4) == pytest.approx(0.04645, rel=1e-3)
    assert step_error_of({}, links, 4) == pytest.approx(fit_step_error([0.3, 0.3], 4))
    assert paired_error_of({"a0/all_reduce": {"spread": [0.3]}}, 4) == 0.0
    h100 = get_device("h100")
    assert "paired_error" not in h100.to_dict()
    measured = dataclasses.replace(h100, step_error=0.2, paired_error=0.03)
    assert DeviceSpec.from_dict(measured.to_dict()) == measured
    profile = load_profile({"version": 1, "device": {"base": "h100", "paired_error": 0.03}})
    assert profile.device.paired_error == 0.03
    with pytest.raises(ValueError, match="paired_error must be in"):
        dataclasses.replace(h100, paired_error=1.0)


def test_the_sync_wait_is_measured_after_a_step_like_computation() -> None:
    from autopar.tools.calibration import CalibrationConfig
    from autopar.tools.calibration_links import sync_segment_matmuls

    # 10 ms of computation between collectives from 0.8 ms matmuls: 12.5 -> 12 (round half
    # to even), 4 ms -> 5; never fewer than one.
    assert sync_segment_matmuls(0.0008, 0.01) == 12
    assert sync_segment_matmuls(0.0008, 0.004) == 5
    assert sync_segment_matmuls(0.05, 0.01) == 1
    assert CalibrationConfig().sync_segment_s == 0.01
    with pytest.raises(ValueError, match="must be > 0"):
        sync_segment_matmuls(0.0, 0.01)
