"""A real (minimal) calibration on 2 gloo ranks gives a profile the planner accepts."""

from __future__ import annotations

import math
from typing import Any

import pytest


def _calibrate(rank: int, world_size: int) -> dict[str, Any]:
    from autopar.calibration import CalibrationConfig, calibrate_on_rank

    return calibrate_on_rank((2,), ("tp",), CalibrationConfig.tiny(), verbose=False)


@pytest.mark.distributed
def test_tiny_calibration_gives_a_profile_the_planner_uses(tmp_path) -> None:
    from autopar.calibration import CALIBRATED_COLLECTIVES, CALIBRATED_FAMILIES
    from autopar.mesh import Mesh
    from cost_models import collective_time_s, load_profile, save_profile
    from tests.distributed.launcher import run_distributed

    results = run_distributed(_calibrate, 2, timeout_s=120)
    same = [{k: v for k, v in r.items() if k != "meta"} for r in results]
    assert same[0] == same[1], "every rank returns the same device and links"
    profile = load_profile(results[0])  # validates against PROFILE_SCHEMA
    device = profile.device
    assert device is not None
    assert device.peak_flops["float32"] > 1e8
    assert device.mem_bandwidth_Bps > 1e8
    assert set(device.op_efficiency) == set(CALIBRATED_FAMILIES)
    assert all(0 < e <= 1 for e in device.op_efficiency.values())
    link = profile.links["tp"]
    assert set(link.collectives) == set(CALIBRATED_COLLECTIVES)
    assert all(alpha >= 0 and beta > 0 for alpha, beta in link.collectives.values())
    assert profile.meta["world_size"] == 2 and profile.meta["backend"] == "gloo"

    path = tmp_path / "profile.json"
    save_profile(profile, path)
    mesh = Mesh.parse("tp=2", device="h100", profile=str(path))
    assert mesh.device == device and mesh.link("tp") == link
    kind, (alpha, beta) = next(iter(link.collectives.items()))
    seconds = collective_time_s(kind, 2**20, 2, mesh.link("tp"))
    assert math.isfinite(seconds) and seconds >= alpha
