"""The planner's driver is the one planning policy: every entry point that plans gets the same
answer, errors carry their figures, and the plan cache forgets plans made by other code."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

import autopar.version
from autopar.api import document_plan, plan_captured
from autopar.capture.export import Captured, capture
from autopar.errors import BudgetError, NoLayoutError
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.plan import cache as plan_cache
from autopar.planner.checkpointing import solver_segments
from autopar.planner.driver import Driver
from autopar.planner.problem import ZeroConfig
from autopar.planner.space import build_space
from autopar.tools.report import plans_for_recipes
from tests.models import tiny_gpt
from tests.planner.stored_plans.cases import normalize

MESH = Mesh.spec((2,), ("dp",))
TIGHT = PlanOptions(memory_budget=1_500_000, zero_stage=0)
"""Below the tiny GPT's peak without recomputation on 2 ranks: the plans must recompute."""


@pytest.fixture(scope="module")
def gpt() -> Captured:
    model, args, kwargs = tiny_gpt()
    return capture(model, args, kwargs)


def _document(plan) -> dict:
    return normalize(json.loads(plan.to_json()))


@pytest.mark.slow
def test_compare_plans_what_plan_plans_on_a_budget_bound_model_that_recomputes(gpt) -> None:
    planned = plan_captured(gpt, MESH, TIGHT, model_name="tiny-gpt")
    compared = plans_for_recipes(gpt, MESH, TIGHT, recipes=["auto", "ddp"], model_name="tiny-gpt")
    assert planned.checkpoint_segments(), "the budget must force recomputation"
    assert _document(compared["auto"]) == _document(planned)
    # ddp cannot fit this budget even recomputing: plan refuses it, compare shows it as not fitting.
    with pytest.raises(BudgetError):
        plan_captured(gpt, MESH, dataclasses.replace(TIGHT, recipe="ddp"), model_name="tiny-gpt")
    assert not compared["ddp"].data["baselines"]["ddp"]["fits"]


def test_recipes_recompute_to_fit_the_budget_like_the_auto_plan(gpt) -> None:
    driver = Driver(build_space(gpt, MESH, TIGHT))
    planned = driver.plan()
    assert planned.chosen.segments, "the budget must make the auto plan recompute"
    free = driver.recipes(["fsdp", "ddp"])
    fsdp = planned.baselines["fsdp"]
    # fsdp does not fit budget-free; with its own checkpointing under the same budget it does,
    # with the recipe's layouts as solved budget-free and a step no faster.
    assert free["fsdp"].evaluation.peak_memory_bytes > driver.budget
    assert fsdp.segments and fsdp.evaluation.peak_memory_bytes <= driver.budget
    assert fsdp.evaluation.recompute_s > 0
    assert fsdp.evaluation.step_s >= free["fsdp"].evaluation.step_s
    assert fsdp.choice == free["fsdp"].choice
    # ddp's replicated parameter, gradient and optimizer bytes alone exceed the budget: it is
    # shown budget-free and not fitting, without an ILP that could not succeed.
    memory = free["ddp"].evaluation.memory
    assert sum(memory[k] for k in ("params", "grads", "optimizer", "master")) > driver.budget
    assert planned.baselines["ddp"] is free["ddp"]
    assert free["ddp"].evaluation.peak_memory_bytes > driver.budget
    # The plan document and summary say so; planning fsdp itself gives the same figures.
    plan = document_plan(driver, planned, model_name="tiny-gpt", timings={})
    row = plan.data["baselines"]["fsdp"]
    assert row["fits"] and row["recomputed_segments"] == len(fsdp.segments)
    assert not plan.data["baselines"]["ddp"]["fits"]
    assert "Recomputing to fit the budget" in plan.summary()
    assert driver.plan("fsdp", price_baselines=False).chosen is fsdp


def test_segments_convert_each_shared_edge_matrix_once(gpt) -> None:
    # Layers share their edge matrices in the space; the solver segments must share the
    # converted tables too (one copy per layer took 20+ GiB on llama3-70b at batch 256).
    driver = Driver(build_space(gpt, MESH, TIGHT))
    built, _ = driver.configurations._prepare(
        ZeroConfig(), budget=driver.budget, spec=None, tied=driver.tied
    )
    segments = solver_segments(driver.candidates, built.allowed, forced=False)
    seen: dict[tuple, tuple] = {}
    uses = 0
    for candidate, segment in zip(driver.candidates, segments, strict=True):
        for (src, dst, matrix), edge in zip(candidate.edges, segment.edges, strict=True):
            rows, cols = built.allowed[src], built.allowed[dst]
            assert edge.cost_s == tuple(tuple(float(matrix[a, b]) for b in cols) for a in rows)
            assert seen.setdefault((id(matrix), rows, cols), edge.cost_s) is edge.cost_s
            uses += 1
    assert len(seen) < uses, "the tiny GPT's two layers must share edge matrices"


def test_a_budget_error_keeps_its_figures_and_survives_pickling(gpt) -> None:
    driver = Driver(build_space(gpt, MESH, TIGHT))
    smallest = driver.smallest_budget()
    with pytest.raises(BudgetError) as error:
        driver.with_budget(smallest * 0.99).plan(price_baselines=False)
    assert error.value.min_budget_bytes == pytest.approx(smallest)
    assert error.value.budget_bytes == pytest.approx(smallest * 0.99)
    again = pickle.loads(pickle.dumps(error.value))
    assert (again.min_budget_bytes, again.budget_bytes, str(again)) == (
        error.value.min_budget_bytes,
        error.value.budget_bytes,
        str(error.value),
    )
    fits = driver.with_budget(smallest * 1.001).plan(price_baselines=False).chosen
    assert fits.evaluation.peak_memory_bytes <= smallest * 1.001


def test_a_no_layout_error_keeps_its_recipe_and_nodes() -> None:
    error = NoLayoutError("recipe 'megatron' has no plan", recipe="megatron", nodes=("linear",))
    again = pickle.loads(pickle.dumps(error))
    assert (again.recipe, again.nodes, str(again)) == ("megatron", ("linear",), str(error))


def test_the_plan_cache_key_changes_with_the_planners_source(gpt, monkeypatch) -> None:
    key = plan_cache.cache_key(gpt.graph_hash, MESH, TIGHT, "tiny-gpt")
    assert key == plan_cache.cache_key(gpt.graph_hash, MESH, TIGHT, "tiny-gpt")
    monkeypatch.setattr(plan_cache, "code_fingerprint", lambda: "another build of the planner")
    assert plan_cache.cache_key(gpt.graph_hash, MESH, TIGHT, "tiny-gpt") != key


def test_the_code_fingerprint_covers_the_solver_and_the_cost_models(tmp_path, monkeypatch) -> None:
    first = autopar.version.code_fingerprint()
    assert len(first) == 64
    autopar.version.code_fingerprint.cache_clear()
    import solver

    fake = tmp_path / "solver"
    fake.mkdir()
    (fake / "__init__.py").write_text("# another solver\n")
    monkeypatch.setattr(solver, "__file__", str(fake / "__init__.py"))
    try:
        assert autopar.version.code_fingerprint() != first
    finally:
        autopar.version.code_fingerprint.cache_clear()
