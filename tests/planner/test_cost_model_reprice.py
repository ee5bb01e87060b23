"""``benchmarks/cost_model.py --tables-from RUN.json --reprice``: an earlier run's plans priced
again with this code and the run's own profiles (what a cost-model change does to the same
measured steps), the measured steps kept, a plan whose layout moved named."""

from __future__ import annotations

import pathlib

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
