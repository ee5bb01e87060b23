"""Explain (issue 14 item 2): the alternatives the solver weighed are stored in the plan file,
priced exactly as the planner prices them, and ``explain`` answers from the file by parameter
FQN or module path, with suggestions in that vocabulary."""

from __future__ import annotations

import json
import math

import pytest
import torch

import autopar
from autopar.models import MLP, MLPConfig
from autopar.placement import format_placements
from autopar.plan.document import Plan
from autopar.plan.explain import vocabulary
from autopar.planner.problem import ZeroConfig, evaluate
from tests.models import tiny_gpt

MESH = autopar.Mesh.spec((2, 2), ("dp", "tp"), device="h100")


@pytest.fixture(scope="module")
def gpt_plan() -> Plan:
    model, args, _ = tiny_gpt()
    return autopar.plan(model, MESH, args)


def _resident(memory: dict[str, float]) -> float:
    return sum(v for k, v in memory.items() if k != "transient")


def test_every_parameter_and_the_top_ops_have_stored_alternatives(gpt_plan: Plan) -> None:
    stored = gpt_plan.data["alternatives"]
    fqns = {e["fqn"] for e in stored["entries"].values() if e["kind"] == "param"}
    owners = {n.fqn for n in gpt_plan.space.nodes if n.kind == "param" and n.alias_of is None}
    assert fqns == owners
    ops = [e for e in stored["entries"].values() if e["kind"] == "op"]
    by_cost = sorted(
        (e for e in gpt_plan.data["nodes"] if e["kind"] == "op"), key=lambda e: -e["seconds"]
    )
    assert {e["node"] for e in ops} == {e["name"] for e in by_cost[: stored["top_nodes"]]}
    for entry in stored["entries"].values():
        first = entry["options"][0]
        assert (
            first["reason"] == "chosen"
            and first["step_delta_s"] == 0
            and first["memory_delta_bytes"] == 0
        )
        assert entry["chosen"] == first["layout"]
        assert 1 <= len(entry["options"]) <= min(8, entry["num_strategies"])
        deltas = [o["step_delta_s"] for o in entry["options"][1:] if o["step_delta_s"] is not None]
        assert deltas == sorted(deltas)


def test_stored_deltas_equal_the_plan_priced_with_one_layout_changed(gpt_plan: Plan) -> None:
    """Swapping one parameter's strategy and re-evaluating the whole plan moves the step time
    and resident memory by exactly the stored deltas (the planner's own pricing)."""
    space, choice = gpt_plan.space, gpt_plan.choice
    zero = ZeroConfig.from_json(gpt_plan.zero, space.mesh.axis_names)
    base = evaluate(space, choice, zero)
    checked = tied = 0
    for entry in gpt_plan.data["alternatives"]["entries"].values():
        if entry["kind"] != "param":
            continue
        i = space.index[entry["node"]]
        group = [i] + [j for j, n in enumerate(space.nodes) if n.alias_of == entry["node"]]
        tied += len(group) > 1
        layouts = [format_placements(s.outputs[0]) for s in space.nodes[i].strategies]
        for option in entry["options"][1:]:
            swapped = list(choice)
            for j in group:  # a tied parameter's aliases move with it
                swapped[j] = layouts.index(option["layout"])
            other = evaluate(space, swapped, zero)
            if option["step_delta_s"] is None:
                assert not math.isfinite(other.step_s)
                continue
            assert other.step_s - base.step_s == pytest.approx(
                option["step_delta_s"], rel=1e-9, abs=1e-15
            )
            assert _resident(other.memory) - _resident(base.memory) == pytest.approx(
                option["memory_delta_bytes"], rel=1e-9, abs=1e-6
            )
            checked += 1
    assert checked > 20 and tied == 1  # tiny_gpt ties wte.weight and lm_head.weight


def test_a_tied_parameter_is_explained_with_its_twin(gpt_plan: Plan) -> None:
    loaded = Plan.from_json(gpt_plan.to_json())
    owner = loaded.explain("wte.weight")
    assert "slower by" in owner or "over budget" in owner
    assert "impossible" not in owner.split("* ")[1].splitlines()[1]  # moving both is possible
    assert "tied to wte.weight" in loaded.explain("lm_head.weight")


def test_reasons_say_slower_over_budget_or_forbidden_by_the_recipe() -> None:
    model, args, _ = tiny_gpt()
    megatron = autopar.plan(model, MESH, args, recipe="megatron")
    reasons = [
        o["reason"] for e in megatron.data["alternatives"]["entries"].values() for o in e["options"]
    ]
    assert any(r == "forbidden by recipe megatron" for r in reasons)
    assert any(r.startswith("slower by ") for r in reasons)
    # Under a budget the replicated layouts exceed, keeping a parameter whole is over budget.
    free = autopar.plan(model, MESH, args).predicted_peak_memory_bytes
    tight = autopar.plan(
        model, MESH, args, memory_budget=int(0.6 * free), zero_stage=0, checkpoint="none"
    )
    reasons = [
        o["reason"] for e in tight.data["alternatives"]["entries"].values() for o in e["options"]
    ]
    assert any(r.startswith("over budget by ") for r in reasons)


def test_explain_by_fqn_module_path_or_node_from_a_loaded_plan(gpt_plan: Plan) -> None:
    loaded = Plan.from_json(gpt_plan.to_json())
    assert loaded.space is None
    fqn = "blocks.0.attn.qkv.weight"
    text = loaded.explain(fqn)
    assert text == gpt_plan.explain(fqn)
    assert text.startswith(f"parameter {fqn} ") and "layouts weighed" in text and "* " in text
    assert "chosen" in text and ("slower by" in text or "as fast" in text)
    module = loaded.explain("blocks.0.attn")
    assert (
        module.startswith("module blocks.0.attn:")
        and "parameter blocks.0.attn.proj.weight" in module
    )
    op = max((e for e in loaded.data["nodes"] if e["kind"] == "op"), key=lambda e: e["seconds"])
    assert "layouts weighed" in loaded.explain(op["name"])


def test_wrong_names_suggest_fqns_and_module_paths_never_node_names(gpt_plan: Plan) -> None:
    with pytest.raises(KeyError, match=r"did you mean blocks\.0\.attn\.qkv\.weight") as info:
        gpt_plan.explain("blocks.0.atn.qkv.weight")
    assert "p_blocks" not in str(info.value)
    with pytest.raises(KeyError) as info:
        gpt_plan.explain("qkv")
    assert "blocks.0.attn.qkv" in str(info.value) and "p_" not in str(info.value)
    words = vocabulary(gpt_plan.data)
    assert "blocks.0.attn.qkv.weight" in words and "blocks.0.attn" in words
    assert not any(w.startswith("p_") for w in words)


def test_older_plan_files_without_alternatives_load_and_say_so(gpt_plan: Plan) -> None:
    old = json.loads(gpt_plan.to_json())
    del old["alternatives"]
    del old["model"]["train_flops"]
    plan = Plan.from_dict(old)
    text = plan.explain("blocks.0.attn.qkv.weight")
    assert "stores no alternatives" in text and "re-plan" in text
    assert "Layouts per layer block" in plan.summary(width=80)


def test_an_op_outside_the_stored_ones_is_explained_live_or_said_so(gpt_plan: Plan) -> None:
    stored = gpt_plan.data["alternatives"]["entries"]
    cheap = next(e for e in gpt_plan.data["nodes"] if e["kind"] == "op" and e["name"] not in stored)
    assert "layouts weighed" in gpt_plan.explain(cheap["name"])  # live: computed on demand
    loaded = Plan.from_json(gpt_plan.to_json())
    assert "not among them" in loaded.explain(cheap["name"])


def test_wide_mlp_explain_names_the_megatron_split() -> None:
    with torch.device("meta"):
        model = MLP(MLPConfig(in_features=4096, hidden=32768, out_features=4096))
        x, y = torch.randn(8, 4096), torch.randn(8, 4096)
    plan = autopar.plan(model, autopar.Mesh.spec((4,), device="h100"), (x, y))
    text = Plan.from_json(plan.to_json()).explain("layers.0.weight")
    assert "layers.0.weight [32768, 4096] in module layers.0: S0" in text
    rows = [line for line in text.splitlines() if line.strip().startswith(("R ", "S1 "))]
    assert rows and all("slower by" in r or "over budget" in r for r in rows)
