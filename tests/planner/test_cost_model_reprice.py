"""``benchmarks/cost_model.py --tables-from RUN.json --reprice``: an earlier run's plans priced
again with this code and the run's own profiles (what a cost-model change does to the same
measured steps), the measured steps kept, a plan whose layout moved named."""

from __future__ import annotations

import pathlib

import pytest

from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.presets import build_preset
from autopar.tools.report import plans_for_recipes
from benchmarks.cost_model import MODELS, reprice
from cost_models import load_profile

PROFILE = pathlib.Path(__file__).parent / "data" / "gloo_2x2_profile.json"


def test_a_run_repriced_takes_this_codes_figures_and_names_moved_layouts() -> None:
    profile = load_profile(str(PROFILE))
    mesh = Mesh(shape=(2, 2), axis_names=("a0", "a1"), device=profile.device,
                links=(profile.links["a0"], profile.links["a1"]))  # fmt: skip
    model, args, kwargs = build_preset(MODELS["mlp"], batch=8, seq=128)
    captured = capture(model, args, kwargs)
    fsdp = plans_for_recipes(captured, mesh, PlanOptions(), recipes=("fsdp",), model_name="mlp")
    ilp = plans_for_recipes(captured, mesh, PlanOptions(auto_margin=0.0), recipes=("auto",),
                            model_name="mlp")  # fmt: skip
    same = fsdp["fsdp"].data["predicted"]
    plans = {
        "fsdp@2x2": {
            "step_s": 0.1,
            "predicted_step_s": 1.0,
            "predicted_breakdown": {"compute_s": same["breakdown"]["compute_s"]},
        },  # fmt: skip
        "ilp@2x2": {
            "step_s": 0.2,
            "predicted_step_s": 1.0,
            "predicted_breakdown": {"compute_s": -1.0},
        },  # fmt: skip
    }
    report = {"world": 4, "profiles": {"2x2": str(PROFILE)},
              "models": {"mlp": {"result": {"plans": plans}}}}  # fmt: skip
    moved = reprice([report], batch=8, seq=128)
    assert moved == ["4 mlp ilp@2x2: another layout now"]
    assert plans["fsdp@2x2"]["predicted_step_s"] == same["step_s"]
    assert plans["ilp@2x2"]["predicted_step_s"] == ilp["auto"].data["predicted"]["step_s"]
    assert plans["fsdp@2x2"]["predicted_breakdown"] == same["breakdown"]
    assert [p["step_s"] for p in plans.values()] == [0.1, 0.2]


def test_a_refit_fits_each_links_stored_timings_as_this_code_does() -> None:
    """``--refit``: every collective of every link, and the wait between computations where
    its timings are stored, fitted again from the calibration's timings (here one timing made
    a straggler's, which the fit leaves out; two of five sync trials slowed, left out)."""
    import copy
    import dataclasses

    from benchmarks.cost_model import refit_links
    from cost_models import Profile, collective_time_s, fit_alpha_beta
    from cost_models.calibrate import fit_sync_s

    profile = load_profile(str(PROFILE))
    meta = copy.deepcopy(dict(profile.meta))
    timed = meta["measurements"]["a1/reduce_scatter"]
    assert len(timed["bytes"]) >= 4
    timed["seconds"] = [*timed["seconds"][:-1], timed["seconds"][-1] * 3]
    compute = [30e-3, 29e-3, 19.4e-3, 19.3e-3, 19.6e-3]
    mixed = [c + e for c, e in zip(compute, (12e-3, 13e-3, 2.3e-3, 3.4e-3, 4.1e-3))]
    meta["measurements"]["a0/sync"] = {
        "seconds_per_call": {"mixed": mixed, "compute": compute, "collective": [2e-3] * 5},
        "bytes": 524288.0,
        "group_size": 2,
    }
    refit = refit_links(Profile(device=profile.device, links=profile.links, meta=meta))
    a0 = dataclasses.replace(refit.links["a0"], sync_s=0.0)
    priced = collective_time_s("all_reduce", 524288.0, 2, a0)
    assert refit.links["a0"].sync_s == fit_sync_s(mixed, compute, [priced] * 5)
    assert 2e-3 < refit.links["a0"].sync_s + priced < 4.2e-3  # the steady trials' wait
    assert refit.links["a1"].sync_s == profile.links["a1"].sync_s  # no timings stored: kept
    for name, link in refit.links.items():
        for kind, fit in link.collectives.items():
            stored = meta["measurements"][f"{name}/{kind}"]
            assert fit == fit_alpha_beta(stored["bytes"], stored["seconds"], kind, 2)
        assert link.latency_s == link.collectives["all_reduce"][0]
    slow = refit.links["a1"].collectives["reduce_scatter"][1]
    assert slow == pytest.approx(profile.links["a1"].collectives["reduce_scatter"][1], rel=0.3)


def test_a_refit_of_flat_timings_keeps_the_latency_as_the_calibration_does() -> None:
    """Timings that do not grow with size (a loaded machine): the refit takes the latency
    alone, bandwidth free, as ``autopar calibrate`` does (``fit_link_kind``), not an error."""
    import copy
    import statistics

    from benchmarks.cost_model import refit_links
    from cost_models import Profile, collective_steps_and_wire_bytes

    profile = load_profile(str(PROFILE))
    meta = copy.deepcopy(dict(profile.meta))
    timed = meta["measurements"]["a0/all_gather"]
    count = len(timed["bytes"])
    timed["seconds"] = [4e-3 - 1e-4 * i for i in range(count)]  # falling with size: no line
    refit = refit_links(Profile(device=profile.device, links=profile.links, meta=meta))
    steps = collective_steps_and_wire_bytes("all_gather", 0.0, 2)[0]
    median = statistics.median(timed["seconds"])
    assert refit.links["a0"].collectives["all_gather"] == pytest.approx((median / steps, 1e-12))
