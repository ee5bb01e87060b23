"""Planning end to end in one process: known answers, recipes, the Plan file, bad input."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.errors import PlanMismatchError, PlanningError
from autopar.models import MLP, MLPConfig
from autopar.plan.document import Plan, plan_schema


def meta_mlp(in_features: int, hidden: int, batch: int):
    with torch.device("meta"):
        model = MLP(MLPConfig(in_features=in_features, hidden=hidden, out_features=in_features))
        x = torch.randn(batch, in_features)
        y = torch.randn(batch, in_features)
    return model, (x, y)


def linear_nodes(plan: Plan) -> list[dict]:
    return [n for n in plan.data["nodes"] if n["op"] == "aten.linear.default"]


@pytest.fixture(scope="module")
def wide_mlp_plan() -> Plan:
    model, args = meta_mlp(4096, 32768, batch=8)
    return autopar.plan(model, autopar.Mesh.spec((4,), device="h100"), args)


def test_wide_mlp_small_batch_on_1d_mesh_of_4_is_megatron_col_then_row(wide_mlp_plan: Plan):
    params = wide_mlp_plan.param_placements()
    assert params["layers.0.weight"] == "S0"  # column parallel: output features split
    assert params["layers.0.bias"] == "S0"
    assert params["layers.1.weight"] == "S1"  # row parallel: input features split
    first, second = linear_nodes(wide_mlp_plan)
    assert first["inputs"][0] == "R" and first["outputs"] == ["S1"]
    assert second["inputs"][0] == "S1" and second["outputs"] == ["P"]
    forward_collectives = [
        kind for c in wide_mlp_plan.conversions() for kind in c["forward"] if kind != "zero_out"
    ]
    assert forward_collectives == ["all_reduce"]


def test_narrow_mlp_huge_batch_is_pure_data_parallel():
    model, args = meta_mlp(256, 256, batch=65536)
    plan = autopar.plan(model, autopar.Mesh.spec((4,), device="h100"), args)
    assert set(plan.param_placements().values()) == {"R"}
    for node in linear_nodes(plan):
        assert node["inputs"][0] == "S0" and node["outputs"] == ["S0"]
    assert plan.zero["stage"] == 0


def test_budget_too_small_for_replicated_weights_forces_sharded_weights():
    model, args = meta_mlp(1024, 4096, batch=65536)
    mesh = autopar.Mesh.spec((4,), device="h100")
    free = autopar.plan(model, mesh, args, zero_stage=0)
    assert set(free.param_placements().values()) == {"R"}, "unconstrained optimum should be DP"
    replicated_state = sum(n["memory_bytes"] for n in free.data["nodes"] if n["kind"] == "param")
    budget = int(free.predicted_peak_memory_bytes - replicated_state / 2)
    tight = autopar.plan(model, mesh, args, zero_stage=0, memory_budget=budget)
    assert tight.predicted_peak_memory_bytes <= budget
    assert any(p != "R" for p in tight.param_placements().values())
    assert tight.predicted_step_s >= free.predicted_step_s


def test_infeasible_budget_states_the_smallest_budget_that_fits():
    model, args = meta_mlp(1024, 8192, batch=64)
    mesh = autopar.Mesh.spec((4,), device="h100")
    with pytest.raises(PlanningError, match="smallest budget that fits") as err:
        autopar.plan(model, mesh, args, memory_budget=1024)
    needed = float(str(err.value).split("(")[1].split(" bytes")[0])
    plan = autopar.plan(model, mesh, args, memory_budget=int(needed * 1.0001) + 1)
    assert plan.predicted_peak_memory_bytes <= needed * 1.0001 + 1


def test_recipes_are_plans_in_their_own_right():
    model, args = meta_mlp(1024, 4096, batch=64)
    mesh = autopar.Mesh.spec((2, 2), ("dp", "tp"), device="h100")
    ddp = autopar.plan(model, mesh, args, recipe="ddp")
    assert set(ddp.param_placements().values()) == {"R,R"}
    assert ddp.data["inputs"][0]["placements"] == "S0,S0"
    megatron = autopar.plan(model, mesh, args, recipe="megatron")
    assert megatron.param_placements()["layers.0.weight"] == "R,S0"
    assert megatron.param_placements()["layers.1.weight"] == "R,S1"
    fsdp_tp = autopar.plan(model, mesh, args, recipe="fsdp+tp")
    assert fsdp_tp.zero["stage"] == 3 and fsdp_tp.zero["axes"] == ["dp"]
    assert fsdp_tp.zero["chunk_bytes"] > 0 and 0 <= fsdp_tp.zero["padding_waste"] < 0.5
    fsdp = autopar.plan(model, mesh, args, recipe="fsdp")
    assert fsdp.zero["stage"] == 3 and fsdp.zero["axes"] == ["dp", "tp"]
    # The recipe plan's figures equal the baseline entry of the auto plan.
    auto = autopar.plan(model, mesh, args)
    for recipe, plan in (
        ("ddp", ddp),
        ("megatron", megatron),
        ("fsdp", fsdp),
        ("fsdp+tp", fsdp_tp),
    ):
        assert auto.baselines[recipe]["step_s"] == pytest.approx(plan.predicted_step_s, rel=1e-9)


def test_plan_json_round_trip_is_lossless(wide_mlp_plan: Plan, tmp_path):
    path = tmp_path / "plan.json"
    wide_mlp_plan.save(path)
    loaded = Plan.load(path, expected_hash=wide_mlp_plan.graph_hash)
    assert loaded.data == json.loads(wide_mlp_plan.to_json())
    assert loaded.to_json() == wide_mlp_plan.to_json()
    assert loaded.choices() == wide_mlp_plan.choices()
    assert "per layer block" in loaded.summary()
    assert "chosen" in loaded.explain("linear")


def test_plan_file_for_another_model_is_refused(wide_mlp_plan: Plan, tmp_path):
    path = tmp_path / "plan.json"
    wide_mlp_plan.save(path)
    model, args = meta_mlp(1024, 4096, batch=8)
    other = autopar.capture(model, args)
    with pytest.raises(PlanMismatchError, match="another model"):
        Plan.load(path, expected_hash=other.graph_hash)


def test_plan_file_must_match_schema(wide_mlp_plan: Plan, tmp_path):
    data = json.loads(wide_mlp_plan.to_json())
    del data["nodes"][0]["outputs"]
    with pytest.raises(ValueError, match="invalid plan file"):
        Plan.from_dict(data)
    with pytest.raises(ValueError, match="not a plan file"):
        Plan.from_json("{not json")
    assert plan_schema()["title"] == "autopar plan"


def test_summary_and_explain_name_layouts_and_alternatives(wide_mlp_plan: Plan):
    text = wide_mlp_plan.summary()
    for needle in ("ddp", "fsdp", "megatron", "fsdp+tp", "layers.0", "peak memory"):
        assert needle in text
    why = wide_mlp_plan.explain("layers.0.weight")
    assert "S0" in why and "layouts weighed" in why
    with pytest.raises(KeyError, match="did you mean layers.0.weight"):
        wide_mlp_plan.explain("layers.0.wieght")


def test_mesh_with_zero_or_negative_axis_is_an_error():
    with pytest.raises(ValueError, match="axis"):
        autopar.Mesh.spec((0, 4))
    with pytest.raises(ValueError, match="axis"):
        autopar.Mesh.spec((2, -2))


def test_unknown_plan_option_is_an_error():
    model, args = meta_mlp(64, 64, batch=8)
    with pytest.raises(TypeError, match="unknown plan option"):
        autopar.plan(model, autopar.Mesh.spec((2,)), args, budget="1GiB")
    with pytest.raises(ValueError, match="recipe"):
        autopar.plan(model, autopar.Mesh.spec((2,)), args, recipe="zero")


class UsesAnOpWithoutRule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.erfinv(torch.tanh(self.proj(x)) * 0.5).sum()


def test_op_without_rule_runs_replicated_and_the_plan_says_so():
    model = UsesAnOpWithoutRule()
    x = torch.randn(8, 16)
    plan = autopar.plan(model, autopar.Mesh.spec((2,), device="cpu"), (x,))
    assert any("erfinv" in w and "replicated" in w for w in plan.warnings), plan.warnings
    node = next(n for n in plan.data["nodes"] if "erfinv" in n["op"])
    assert node["outputs"] == ["R"] and node["inputs"] == ["R"]
    assert "erfinv" in plan.summary()


def test_cli_plans_a_preset_and_shows_the_saved_plan(tmp_path, capsys):
    from autopar.tools.cli import main

    out = tmp_path / "plan.json"
    assert (
        main(
            ["plan", "mlp", "--mesh", "2x2", "--device", "a100", "--batch", "16", "--out", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "per layer block" in printed and "planned in" in printed
    plan = Plan.load(out)
    assert plan.data["mesh"]["shape"] == [2, 2] and plan.data["mesh"]["device"]["name"].startswith(
        "a100"
    )
    assert main(["show", str(out)]) == 0
    assert "megatron" in capsys.readouterr().out
    assert main(["show", str(out), "--explain", "layers.0.weight"]) == 0
    assert "chosen" in capsys.readouterr().out
    assert main(["plan", "mlp", "--mesh", "0x2"]) == 2
    assert "axis" in capsys.readouterr().err
    assert main(["plan", "no-such-model", "--mesh", "2"]) == 2
    assert "unknown model" in capsys.readouterr().err
