"""The auto plan optimizes over a superset of every recipe: never predicted slower than one that fits."""

from __future__ import annotations

import pytest

import autopar
from autopar.api import plan_captured
from autopar.options import PlanOptions
from autopar.presets import build_preset

CASES = [
    ("mlp", "4", 64, 16),
    ("mlp", "2x2", 64, 16),
    ("gpt2-small-2l", "2x2", 8, 128),
    ("llama3-8b-2l", "4", 8, 128),
    ("mlp", "2x2x2", 64, 16),
    ("hf:gpt2?n_layer=2&n_embd=256&n_head=8&vocab_size=4096&n_positions=256", "2x2", 8, 128),
    (
        "hf:llama?num_hidden_layers=2&hidden_size=256&num_attention_heads=8&num_key_value_heads=4"
        "&intermediate_size=512&vocab_size=4096",
        "2x2",
        8,
        128,
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mesh", "batch", "seq"), CASES, ids=[f"{c[0][:20]}-{c[1]}" for c in CASES])
def test_auto_plan_is_never_slower_than_a_recipe_that_fits(name, mesh, batch, seq):
    model, args, kwargs = build_preset(name, batch=batch, seq=seq)
    captured = autopar.capture(model, args, kwargs)
    plan = plan_captured(captured, autopar.Mesh.parse(mesh, device="h100"), PlanOptions(), model_name=name)
    assert plan.data["solver"]["status"] == "optimal"
    fitting = {k: v for k, v in plan.baselines.items() if v["fits"]}
    assert fitting, "with the default budget at least one recipe should fit these small models"
    for recipe, figures in fitting.items():
        assert plan.predicted_step_s <= figures["step_s"] * (1 + 1e-6), (
            f"auto {plan.predicted_step_s} slower than {recipe} {figures['step_s']}"
        )
    assert plan.predicted_peak_memory_bytes <= plan.data["memory_budget_bytes"]


@pytest.mark.parametrize("recipe", ["ddp", "fsdp", "megatron"])
def test_data_parallel_recipes_never_gather_the_batch(recipe):
    """Under ddp/fsdp (every axis) and megatron (the non-tp axes) every non-scalar activation
    computed from the inputs stays split on the data-parallel axes: no rank recomputes the
    samples of another (on this tiny GPT, replicating the whole batch on every rank is cheaper
    under the cost model, which is not what the recipe means)."""
    from tests.models import tiny_gpt

    model, args, kwargs = tiny_gpt()
    captured = autopar.capture(model, args, kwargs)
    mesh = autopar.Mesh.parse("2x2", device="cpu")
    plan = plan_captured(captured, mesh, PlanOptions(recipe=recipe), model_name="tiny_gpt")
    data_axes = [0, 1] if recipe != "megatron" else [0]
    from_inputs = {n.name for n in captured.gm.graph.nodes if n.name in captured.input_nodes}
    checked = 0
    for node in captured.gm.graph.nodes:
        if node.op != "call_function" or not any(i.name in from_inputs for i in node.all_input_nodes):
            continue
        from_inputs.add(node.name)
        val = node.meta.get("val")
        strategy = plan.choices().get(node.name)
        if strategy is None or not hasattr(val, "dim") or val.dim() == 0:
            continue
        checked += 1
        assert all(not strategy.outputs[0][a].is_replicate() for a in data_axes), (
            f"{recipe}: {node.name} is replicated on a data-parallel axis"
        )
    assert checked > 20


@pytest.mark.parametrize(("pair", "mesh"), [(("ddp", "fsdp"), "2x2"), (("megatron", "fsdp+tp"), "2x2")])
def test_recipes_that_differ_only_in_zero_share_one_solve_and_it_is_their_optimum(pair, mesh):
    """fsdp's ZeRO-3 terms are constants when every parameter's layout is fixed: its layouts
    are ddp's, and solving its own ILP finds no faster plan (the shared solve is exact)."""
    from autopar.planner.driver import Driver
    from autopar.planner.problem import build_space
    from autopar.planner.recipes import recipe_spec

    model, args, kwargs = build_preset("gpt2-small-2l", batch=8, seq=128)
    captured = autopar.capture(model, args, kwargs)
    space = build_space(captured, autopar.Mesh.parse(mesh, device="h100"), PlanOptions())
    specs = [recipe_spec(space, recipe) for recipe in pair]
    driver = Driver(space, tied=(), candidates=())
    first, second = driver.configurations.solve_many([(r, s.zero, s, None) for r, s in zip(pair, specs)])
    assert first.choice == second.choice
    assert first.zero != second.zero and second.evaluation.step_s != first.evaluation.step_s
    alone = driver.configurations.solve(specs[1].zero, name=pair[1], budget=None, spec=specs[1])
    assert second.evaluation.step_s == pytest.approx(alone.evaluation.step_s, rel=1e-9)
    assert second.solution.objective_s == pytest.approx(alone.solution.objective_s, rel=1e-9)
