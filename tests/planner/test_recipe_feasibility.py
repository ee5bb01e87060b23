"""A recipe's fixed layouts either have a plan or say, in user terms, why not; a baseline with
no plan never takes the auto plan down with it."""

from __future__ import annotations

import re

import pytest

import autopar
from autopar.api import plan_captured
from autopar.errors import PlanningError
from autopar.options import PlanOptions
from autopar.placement import Shard
from autopar.planner import recipes as baselines
from autopar.presets import build_preset

# BERT's LM head: a decoder weight tied to the word embeddings plus a vocab-sized bias.
BERT = "hf:bert?num_hidden_layers=1&hidden_size=64&num_attention_heads=4&intermediate_size=128"


@pytest.fixture(scope="module")
def bert_captured():
    model, args, kwargs = build_preset(BERT, batch=4, seq=16)
    return autopar.capture(model, args, kwargs)


@pytest.mark.parametrize("mesh", ["2", "2x2", "4"])
def test_bert_plans_megatron_with_the_tied_head_bias_split_like_its_weight(
    bert_captured, mesh
) -> None:
    plan = plan_captured(
        bert_captured,
        autopar.Mesh.parse(mesh, device="h100"),
        PlanOptions(recipe="megatron"),
        model_name=BERT,
    )
    params = plan.data["params"]
    weight = params["bert.embeddings.word_embeddings.weight"]["placement"]
    bias = params["cls.predictions.decoder.bias"]["placement"]
    if mesh != "4":  # the vocab (30522) splits 2 ways: weight and bias vocab-parallel alike
        assert weight == bias and "S0" in str(weight)
    else:  # not 4 ways: the head is row-parallel (hidden split), its bias replicated
        assert "S0" not in str(weight) and "S" not in str(bias)
    assert "megatron" in plan.baselines and "fsdp+tp" in plan.baselines


def _contradictory_megatron(space, tp, notes):
    """A broken layout: layers.0's bias split while its weight is Replicate (a recipe uses
    parameters where they live, so no strategy of the matmul accepts both)."""
    bias = next(n for n, fqn in space.captured.param_nodes.items() if fqn == "layers.0.bias")
    return {
        bias: tuple(
            Shard(0) if a == tp else p
            for a, p in enumerate(space.nodes[0].strategies[0].outputs[0])
        )
    }


def test_an_infeasible_baseline_is_left_out_of_the_auto_plan_with_a_note(monkeypatch) -> None:
    monkeypatch.setattr(baselines, "megatron_layout", _contradictory_megatron)
    model, args, kwargs = build_preset("mlp", batch=8, seq=1)
    captured = autopar.capture(model, args, kwargs)
    mesh = autopar.Mesh.parse("2", device="h100")
    plan = plan_captured(captured, mesh, PlanOptions(), model_name="mlp")
    assert "megatron" not in plan.baselines and {"ddp", "fsdp"} <= set(plan.baselines)
    assert any(w.startswith("megatron: left out") for w in plan.data["warnings"])
    with pytest.raises(PlanningError) as error:
        plan_captured(captured, mesh, PlanOptions(recipe="megatron"), model_name="mlp")
    message = str(error.value)
    assert "\n" not in message
    assert "recipe 'megatron' has no plan on mesh a0=2" in message
    assert re.search(r"(parameter|module) layers\.0\S* \(?[^;]*\[\d+(, \d+)*\]", message), message
    assert "try another mesh shape" in message


def test_compare_leaves_out_a_recipe_with_no_plan(monkeypatch) -> None:
    from autopar.tools.report import plans_for_recipes

    monkeypatch.setattr(baselines, "megatron_layout", _contradictory_megatron)
    model, args, kwargs = build_preset("mlp", batch=8, seq=1)
    captured = autopar.capture(model, args, kwargs)
    mesh = autopar.Mesh.parse("2", device="h100")
    plans = plans_for_recipes(
        captured, mesh, PlanOptions(), recipes=["auto", "ddp", "megatron"], model_name="mlp"
    )
    assert set(plans) == {"auto", "ddp"}
    assert any(w.startswith("megatron: left out") for w in plans["auto"].data["warnings"])
