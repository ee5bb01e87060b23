"""The calibrated profile's own error (``DeviceSpec.step_error``): the standard error of its
figures, from the spread of the calibration's repeated measurements; stored in the profile only
where measured, so that datasheet devices (error 0) and the plans made with them do not
change."""

from __future__ import annotations

import dataclasses

import pytest

from cost_models import get_device, load_profile
from cost_models.calibrate import STEP_ERROR_MAX, fit_step_error, relative_spread
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
