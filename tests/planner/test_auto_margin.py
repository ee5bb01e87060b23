"""The auto plan vs the best recipe under the model's error (autopar/planner/auto_margin.py):
a plan predicted within the margin of the fastest recipe yields the recipe's layout, beyond it
the auto plan; a margin of 0 (the default, and any margin on datasheet devices) never changes a plan; the
plan JSON records both predictions and the summary says which was chosen and why."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autopar.api import document_plan
from autopar.capture.export import Captured, capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.plan.document import Plan
from autopar.planner.auto_margin import TIE_MARGIN, auto_margin, prefer_recipe_within_margin
from autopar.planner.driver import Driver
from autopar.planner.space import build_space
from cost_models import get_device
from tests.models import tiny_gpt

MESH = Mesh.spec((4,), ("dp",), device="h100")
"""On 4 H100s the tiny GPT's auto plan is predicted about 14% faster than ddp, the fastest
recipe: wide enough to put a margin on either side of it."""


@pytest.fixture(scope="module")
def gpt() -> Captured:
    model, args, kwargs = tiny_gpt()
    return capture(model, args, kwargs)


@pytest.fixture(scope="module")
def space(gpt):
    return build_space(gpt, MESH, PlanOptions())


def _plan(space, **options) -> tuple[Plan, dict]:
    driver = Driver(space, options=PlanOptions(**options))
    plan = document_plan(driver, driver.plan(), model_name="tiny-gpt", timings={})
    return plan, json.loads(plan.to_json())


def test_the_margin_decides_between_the_auto_plan_and_the_fastest_recipe(space) -> None:
    plan0, doc0 = _plan(space)  # h100 preset: step_error 0, nothing weighed
    assert "auto_choice" not in doc0 and "auto_margin" not in doc0["options"]
    auto_s = doc0["predicted"]["step_s"]
    recipe_s, best = min((b["step_s"], n) for n, b in doc0["baselines"].items() if b["fits"])
    gain = (recipe_s - auto_s) / recipe_s
    assert best == "ddp" and 0.05 < gain < 0.5
    ddp_choice = Driver(space).plan("ddp").chosen.choice
    assert plan0.choice != ddp_choice

    within, doc = _plan(space, auto_margin=gain * 1.5)
    assert within.choice == ddp_choice
    assert doc["predicted"]["step_s"] == pytest.approx(recipe_s)
    choice = doc["auto_choice"]
    assert choice["chosen"] == "ddp" and choice["margin_source"] == "option"
    assert choice["auto_step_s"] == pytest.approx(auto_s)
    assert choice["recipe_step_s"] == pytest.approx(recipe_s)
    assert choice["predicted_gain"] == pytest.approx(gain)
    assert f"auto predicted {gain:.1%} faster than ddp" in within.summary()
    assert "ddp's layout chosen" in within.summary()
    assert Plan.from_json(within.to_json()).data["auto_choice"] == choice  # schema-valid

    beyond, doc = _plan(space, auto_margin=gain * 0.5)
    assert beyond.choice == plan0.choice and doc["auto_choice"]["chosen"] == "auto"
    assert "the auto layout kept" in beyond.summary()

    zero, doc = _plan(space, auto_margin=0.0)
    assert zero.choice == plan0.choice and "auto_choice" not in doc


def test_the_profiles_measured_error_is_the_margin_only_when_asked(gpt, space) -> None:
    gain_plan = Driver(space).plan()
    auto_s = gain_plan.chosen.evaluation.step_s
    recipe_s = gain_plan.baselines["ddp"].evaluation.step_s
    gain = (recipe_s - auto_s) / recipe_s
    noisy = dataclasses.replace(get_device("h100"), step_error=gain * 1.5)
    mesh = Mesh.spec((4,), ("dp",), device=noisy)
    noisy_space = build_space(gpt, mesh, PlanOptions())
    # The default on a measured device: near-ties only (TIE_MARGIN), so the auto plan, 13.6%
    # faster, is kept and the decision says why; an explicit 0 weighs nothing.
    default = Driver(noisy_space).plan()
    assert default.decision["margin_source"] == "tie" and default.decision["chosen"] == "auto"
    assert (
        default.decision["margin"] == TIE_MARGIN
        and default.chosen.choice == gain_plan.chosen.choice
    )
    assert "beyond the 2.0% near-tie margin of a measured profile" in default.decision["reason"]
    zero = Driver(noisy_space, options=PlanOptions(auto_margin=0)).plan()
    assert zero.decision is None and zero.chosen.choice == gain_plan.chosen.choice
    planned = Driver(noisy_space, options=PlanOptions(auto_margin="profile")).plan()
    assert planned.decision["margin_source"] == "profile"
    assert planned.decision["chosen"] == "ddp"
    assert planned.chosen.choice == Driver(space).plan("ddp").chosen.choice
    assert "within the profile's" in planned.decision["reason"]
    # Where the profile measured the error of a difference (paired ratios), that is the margin:
    # here half the gain, so the auto plan is kept although step_error is 1.5x the gain.
    paired = dataclasses.replace(noisy, paired_error=gain * 0.5)
    paired_mesh = Mesh.spec((4,), ("dp",), device=paired)
    kept = Driver(
        build_space(gpt, paired_mesh, PlanOptions()), options=PlanOptions(auto_margin="profile")
    ).plan()
    assert (
        kept.decision["margin"] == pytest.approx(gain * 0.5) and kept.decision["chosen"] == "auto"
    )
    assert kept.chosen.choice == gain_plan.chosen.choice
    with pytest.raises(ValueError, match="or 'profile'"):
        PlanOptions(auto_margin="noise")


def test_a_recipe_that_does_not_fit_is_never_chosen(space) -> None:
    planned = Driver(space).plan()
    auto = planned.chosen
    too_big = {
        name: dataclasses.replace(
            s, evaluation=dataclasses.replace(s.evaluation, peak_memory_bytes=2e9)
        )
        for name, s in planned.baselines.items()
    }
    chosen, decision = prefer_recipe_within_margin(auto, too_big, margin=0.9, budget=1e9)
    assert chosen is auto and decision is None
    chosen, decision = prefer_recipe_within_margin(auto, planned.baselines, margin=0.9, budget=1e12)
    assert chosen is planned.baselines["ddp"] and decision["chosen"] == "ddp"


def test_a_bad_margin_is_a_one_line_error() -> None:
    with pytest.raises(ValueError, match=r"auto_margin must be in \[0, 1\)"):
        PlanOptions(auto_margin=5)
    with pytest.raises(ValueError, match="step_error must be in"):
        dataclasses.replace(get_device("h100"), step_error=1.0)


def test_the_default_margin_decides_near_ties_on_measured_devices_only(gpt, space) -> None:
    """A measured device (step_error or paired_error above 0) gets TIE_MARGIN, or its own error
    where that is smaller; a datasheet device 0; an explicit option wins over both. At a
    near-tie (the auto plan predicted less than the margin faster) the recipe is chosen."""
    h100 = get_device("h100")
    options = PlanOptions()
    assert auto_margin(MESH, options) == (0.0, "option")
    noisy = Mesh.spec((4,), ("dp",), device=dataclasses.replace(h100, step_error=0.3))
    assert auto_margin(noisy, options) == (TIE_MARGIN, "tie")
    precise = Mesh.spec((4,), ("dp",), device=dataclasses.replace(h100, paired_error=0.005))
    assert auto_margin(precise, options) == (0.005, "tie")
    assert auto_margin(noisy, PlanOptions(auto_margin=0.1)) == (0.1, "option")
    assert auto_margin(noisy, PlanOptions(auto_margin=0)) == (0.0, "option")
    planned = Driver(space).plan()
    auto = planned.chosen
    # A recipe priced 1% slower than the auto plan is a near-tie: the recipe is chosen.
    near = {
        "ddp": dataclasses.replace(
            planned.baselines["ddp"],
            evaluation=dataclasses.replace(
                planned.baselines["ddp"].evaluation, step_s=auto.evaluation.step_s * 1.01
            ),
        )
    }
    chosen, decision = prefer_recipe_within_margin(
        auto, near, margin=TIE_MARGIN, source="tie", budget=1e12
    )
    assert chosen is near["ddp"] and decision["chosen"] == "ddp"
    assert "within the 2.0% near-tie margin of a measured profile" in decision["reason"]
