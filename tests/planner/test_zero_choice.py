"""The auto plan's ZeRO choice: a stage per data-parallel axis under the memory budget (no
processes).

The runtime takes a stage per mesh axis, so the planner's space is every assignment of stages
0-3 to the axes of size > 1; an assignment with an axis at stage 0 or 1 is pruned by dominance
(raising those axes to 2 costs the same time under the cost model and no more memory), which
leaves stage 2 or 3 on each axis (2^k candidates) plus stage 0 everywhere. Checked here: the
enumeration, that every pruned configuration's own optimum is really no better than its
dominator's, that a shrinking budget moves the choice from stage 0 to stage 2 on the tiny MLP
(stage 3 is priced and listed but loses there: sharding weights over the same axis saves the
same bytes for less communication, which the ILP finds under the budget), that on a 2x4 mesh of
two data-parallel axes a budget between the all-stage-3 and all-stage-2 footprints gets a
mixed configuration (stage 3 on the axis whose gathers are cheap: the fast intra-node link),
that the plan JSON / summary record every configuration and why the chosen one won, and that
forced per-axis stages (Python and CLI) round-trip through the plan JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from typing import Any

import pytest

import autopar
import solver
from autopar.api import plan_captured
from autopar.capture.export import capture
from autopar.options import PlanOptions
from autopar.plan.document import Plan
from autopar.planner.chunks import CHUNK_TRANSIENTS
from autopar.planner.driver import Driver
from autopar.planner.problem import ZeroConfig, build_space
from autopar.planner.zero_choice import zero_candidates, zero_configurations
from autopar.runtime.zero import MIN_CHUNKS, choose_chunk_bytes
from tests.models import tiny_mlp

MESH_1D = ((2,), ("dp",))
MESH_2D = ((2, 2), ("dp", "tp"))


@functools.cache
def _captured() -> Any:
    model, args, kwargs = tiny_mlp()
    return capture(model, args, kwargs)


def _plan(mesh: tuple[tuple[int, ...], tuple[str, ...]], **options: Any) -> Plan:
    return plan_captured(
        _captured(),
        autopar.Mesh.spec(*mesh),
        PlanOptions(**options),
        model_name="mlp",
        price_baselines=False,
    )


@functools.cache
def _stage0_peak(mesh: tuple[tuple[int, ...], tuple[str, ...]]) -> float:
    return float(_plan(mesh).data["predicted"]["peak_memory_bytes"])


def test_configurations_are_every_stage_per_axis() -> None:
    configs = zero_configurations((2, 2))
    assert [z.stages for z, _ in configs] == [()] + [
        ZeroConfig(stages=(a, b)).stages for a in range(4) for b in range(4) if (a, b) != (0, 0)
    ]
    for zero, by in configs:
        lifted = tuple(2 if x < 2 else x for x in (zero.stage_of(0), zero.stage_of(1)))
        if not zero.stages or lifted == (zero.stage_of(0), zero.stage_of(1)):
            assert by is None, zero
        else:
            assert by == ZeroConfig(stages=lifted), zero
    assert zero_candidates(2, (2, 2)) == [
        ZeroConfig(stages=s) for s in ((2, 2), (2, 3), (3, 2), (3, 3))
    ]
    # Axes of size 1 are not data parallel; a 1-device mesh has only stage 0.
    assert [z.stages for z, _ in zero_configurations((1, 4))] == [(), (0, 1), (0, 2), (0, 3)]
    assert zero_configurations((1,)) == [(ZeroConfig(), None)]
    # The uniform spelling is the same configuration.
    assert ZeroConfig(stage=2, axes=(0, 1)) == ZeroConfig(stages=(2, 2))
    assert ZeroConfig(stages=(3, 0)) == ZeroConfig(stage=3, axes=(0,))


def test_pruned_configurations_are_no_better_than_their_dominator() -> None:
    """Solve every pruned configuration under a budget that forces ZeRO on 2x2: none beats its
    dominator, and every one that fits is at least as slow."""
    mesh = autopar.Mesh.spec(*MESH_2D)
    budget = 0.4 * _stage0_peak(MESH_2D)
    options = PlanOptions(memory_budget=int(budget))
    space = build_space(_captured(), mesh, options)
    tops: dict[ZeroConfig, Any] = {}
    checked = 0
    for zero, dominated_by in zero_configurations(mesh.shape):
        if dominated_by is None or zero.stage == 0:
            continue
        if dominated_by not in tops:
            tops[dominated_by] = Driver(
                space, options=options, tied=(), candidates=()
            ).configurations.solve(dominated_by, name="top", budget=budget)
        try:
            solved = Driver(space, options=options, tied=(), candidates=()).configurations.solve(
                zero, name="pruned", budget=budget
            )
        except solver.InfeasibleBudgetError:
            continue
        checked += 1
        top = tops[dominated_by]
        assert solved.evaluation.step_s >= top.evaluation.step_s * (1 - 1e-9), zero
        assert solved.evaluation.peak_memory_bytes >= top.evaluation.peak_memory_bytes * (
            1 - 1e-9
        ) or (solved.evaluation.step_s > top.evaluation.step_s * (1 + 1e-9)), zero
    # The pruned candidates that fit at all must have been compared.
    assert checked >= 1


@pytest.mark.parametrize(
    ("fraction", "stage"),
    [(1.2, 0), (0.7, 2), (0.52, 2)],
    ids=["ample", "stage2", "stage2-sharded"],
)
def test_budget_moves_the_choice_up_the_stages(fraction: float, stage: int) -> None:
    budget = fraction * _stage0_peak(MESH_1D)
    plan = _plan(MESH_1D, memory_budget=int(budget))
    zero = plan.zero
    assert zero["stage"] == stage, zero["reason"]
    assert zero["axes"] == (["dp"] if stage else [])
    assert plan.data["predicted"]["peak_memory_bytes"] <= budget
    if stage:
        assert isinstance(zero["chunk_bytes"], int) and zero["chunk_bytes"] > 0
        assert "does not fit" in zero["reason"]
    else:
        assert zero["chunk_bytes"] is None
        assert "stage 0 fits" in zero["reason"]
    considered = zero["considered"]
    assert len(considered) == len(zero_configurations((2,)))
    chosen = [row for row in considered if row["verdict"] == "chosen"]
    assert [(r["stage"], r["axes"]) for r in chosen] == [(stage, zero["axes"])]
    for row in considered:
        assert set(row["memory"]) >= {"params", "grads", "optimizer"}, row
        # Every configuration solved for its own layouts that fits is no faster than the choice.
        if row["layouts"] == "own" and row["peak_memory_bytes"] <= budget:
            assert row["step_s"] >= chosen[0]["step_s"] * (1 - 1e-9), row
    # Each stage keeps fewer bytes of training state than the one below it (1 shards the
    # optimizer state, 2 also gradients, 3 also parameters).
    by_stage = {r["stage"]: r["memory"] for r in considered}
    keys = ("params", "grads", "optimizer")
    states = [sum(by_stage[s][k] for k in keys) for s in range(4)]
    assert states == sorted(states, reverse=True) and states[3] < states[0] / 1.8, states
    text = plan.summary(verbose=True)
    assert "ZeRO configurations considered" in text
    assert f"ZeRO choice: {zero['reason']}" in text
    # The JSON round-trips with the choice.
    again = Plan.from_json(plan.to_json())
    assert again.zero["considered"] == considered


def test_budget_on_2x2_prunes_and_explains() -> None:
    plan = _plan(MESH_2D, memory_budget=int(0.4 * _stage0_peak(MESH_2D)))
    zero = plan.zero
    assert zero["stage"] >= 2 and zero["axes"], zero["reason"]
    verdicts = {(r["stages"]["dp"], r["stages"]["tp"]): r["verdict"] for r in zero["considered"]}
    assert len(verdicts) == 16
    for stages in ((1, 0), (0, 1), (1, 1), (2, 1), (1, 2), (0, 2)):
        assert verdicts[stages].startswith("pruned: stage 2 on dp,tp"), stages
    assert verdicts[(3, 1)].startswith("pruned: stages dp=3,tp=2")
    assert verdicts[(zero["stages"]["dp"], zero["stages"]["tp"])] == "chosen"
    assert "stage 2 on dp,tp is as fast" in verdicts[(0, 0)]


MESH_2X4 = ((2, 4), ("node", "gpu"))


@functools.cache
def _odd_mlp() -> Any:
    """An MLP whose weights no mesh axis divides (63 x 189): the planner cannot shard them by
    layout, so ZeRO is the only way to split parameter memory and both axes stay data parallel."""
    import torch

    from autopar.models import MLP, MLPConfig

    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=63, hidden=189, out_features=63))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(8, 63, generator=generator)
    y = torch.randn(8, 63, generator=generator)
    return capture(model, (x, y), {})


def _plan_2x4(**options: Any) -> Plan:
    return plan_captured(
        _odd_mlp(),
        autopar.Mesh.spec(*MESH_2X4),
        PlanOptions(**options),
        model_name="odd-mlp",
        price_baselines=False,
    )


def test_budget_between_stage_3_and_stage_2_picks_mixed_stages() -> None:
    """2x4, both axes data parallel: under a budget between the all-stage-3 and the
    all-stage-2 footprints (of the data-parallel layouts) the plan shards parameters over one
    axis only (stage 3 there, 2 on the other): the fastest configuration that fits."""
    free = _plan_2x4()
    rows = {(r["stages"]["node"], r["stages"]["gpu"]): r for r in free.zero["considered"]}
    all2, all3 = rows[(2, 2)]["peak_memory_bytes"], rows[(3, 3)]["peak_memory_bytes"]
    assert all3 < all2
    budget = int((all2 + all3) / 2)
    plan = _plan_2x4(memory_budget=budget)
    zero = plan.zero
    stages = (zero["stages"]["node"], zero["stages"]["gpu"])
    assert stages in ((2, 3), (3, 2)), zero["reason"]
    assert zero["stage"] == 3 and zero["axes"] == ["node", "gpu"]
    assert all(p["placement"] == "R,R" for p in plan.data["params"].values())
    assert all(p["zero"]["stages"] == zero["stages"] for p in plan.data["params"].values())
    assert plan.data["predicted"]["peak_memory_bytes"] <= budget
    label = f"stages node={stages[0]},gpu={stages[1]}"
    assert f"{label} has the fastest step" in zero["reason"]
    verdicts = {(r["stages"]["node"], r["stages"]["gpu"]): r for r in zero["considered"]}
    for other in ((2, 3), (3, 2), (3, 3)):
        row = verdicts[other]
        if other != stages and row["layouts"] == "own" and row["peak_memory_bytes"] <= budget:
            assert row["step_s"] >= plan.data["predicted"]["step_s"], row
    text = plan.summary(verbose=True)
    assert f"ZeRO {label}" in text
    assert f"node={stages[0]},gpu={stages[1]} (chosen)" in text
    # The new JSON round-trips; a plan written before per-axis stages (no "stages") still loads
    # and reads as its uniform configuration.
    again = Plan.from_json(plan.to_json())
    assert again.zero["stages"] == zero["stages"]
    old = json.loads(plan.to_json())
    old["zero"] = {
        k: v for k, v in old["zero"].items() if k not in ("stages", "considered", "per_stage")
    }
    old["zero"]["stage"], old["zero"]["axes"] = 3, ["gpu"]
    for entry in old["params"].values():
        entry["zero"].pop("stages")
    legacy = Plan.from_json(json.dumps(old))
    assert ZeroConfig.from_json(legacy.zero, ["node", "gpu"]) == ZeroConfig(stages=(0, 3))
    assert "ZeRO stage 3 on gpu" in legacy.summary(verbose=True)


def test_forced_per_axis_stages_round_trip(tmp_path: Any) -> None:
    by_name = _plan_2x4(zero_stage={"node": 2, "gpu": 3})
    by_position = _plan_2x4(zero_stage=(2, 3))
    for plan in (by_name, by_position):
        assert plan.zero["stages"] == {"node": 2, "gpu": 3}
        assert plan.zero["reason"] == "zero_stage was asked for: stages node=2,gpu=3"
        again = Plan.from_json(plan.to_json())
        assert again.zero["stages"] == {"node": 2, "gpu": 3}
    assert PlanOptions.from_kwargs(by_name.data["options"]) == PlanOptions(
        zero_stage={"node": 2, "gpu": 3}
    )
    assert PlanOptions.from_kwargs(by_position.data["options"]) == PlanOptions(zero_stage=(2, 3))
    # Named axes left out are stage 0.
    assert _plan_2x4(zero_stage={"gpu": 3}).zero["stages"] == {"node": 0, "gpu": 3}


def test_cli_zero_per_axis(tmp_path: Any, capsys: Any) -> None:
    from autopar.tools.cli import main, parse_zero

    out = tmp_path / "plan.json"
    args = ["plan", "mlp", "--mesh", "dp=2,tp=2", "--batch", "16", "--out", str(out)]
    assert main([*args, "--zero", "dp=3,tp=2"]) == 0
    assert Plan.load(out).zero["stages"] == {"dp": 3, "tp": 2}
    assert main([*args, "--zero", "2,3"]) == 0
    assert Plan.load(out).zero["stages"] == {"dp": 2, "tp": 3}
    assert main(["show", str(out)]) == 0
    assert "stages dp=2,tp=3" in capsys.readouterr().out

    assert parse_zero("3") == 3
    assert parse_zero("2,3") == (2, 3)
    assert parse_zero("node=2, gpu=3") == {"node": 2, "gpu": 3}
    for bad in ("4", "2,x", "node=5", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="stage"):
            parse_zero(bad)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ((2, 3, 1), "has 3 stages but the mesh has 2 axes"),
        ({"rack": 3}, r"unknown mesh axes \['rack'\]; the mesh's axes are \['node', 'gpu'\]"),
    ],
    ids=["length", "axis-name"],
)
def test_bad_per_axis_stages_say_what_is_valid(spec: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _plan_2x4(zero_stage=spec)


@pytest.mark.parametrize("spec", [4, (2, 7), {"gpu": -1}, "3", True])
def test_bad_zero_stage_values_are_refused_early(spec: Any) -> None:
    with pytest.raises(ValueError, match="0-3"):
        PlanOptions(zero_stage=spec)


def test_forced_stage_and_recipe_say_so() -> None:
    forced = _plan(MESH_1D, zero_stage=3)
    assert forced.zero["stage"] == 3 and forced.zero["axes"] == ["dp"]
    assert forced.zero["reason"] == "zero_stage=3 was asked for"
    # The chunk size is priced (planner.chunks): the fewest exposed collective seconds, its
    # chunk transients within the budget's headroom over the plan's peak.
    for plan, stage in ((forced, 3), (_plan(MESH_1D, zero_stage=2), 2)):
        # On a 1-D mesh a ZeRO-managed parameter is whole on its rank.
        params = plan.data["params"].values()
        sizes = [4 * math.prod(p["shape"]) for p in params if p["zero"]["axes"]]
        chunk_bytes = plan.zero["chunk_bytes"]
        headroom = plan.data["memory_budget_bytes"] - plan.predicted_peak_memory_bytes
        assert max(sizes) <= chunk_bytes <= max(max(sizes), headroom / CHUNK_TRANSIENTS[stage])
    assert choose_chunk_bytes([n // 4 for n in sizes], 2, min_chunks=MIN_CHUNKS)[0] > 0
    recipe = _plan(MESH_1D, recipe="fsdp")
    assert recipe.zero["reason"] == "recipe 'fsdp' fixes stage 3 on dp"
    assert sum(r["verdict"] == "chosen" for r in recipe.zero["considered"]) == 1


def test_zero_config_refuses_bad_stages() -> None:
    with pytest.raises(ValueError, match="0, 1, 2 or 3"):
        ZeroConfig(stages=(2, 4))
    with pytest.raises(ValueError, match="0, 1, 2 or 3"):
        ZeroConfig(stage=5, axes=(0,))
    with pytest.raises(ValueError, match="not both"):
        ZeroConfig(stage=2, stages=(2, 3))
    mixed = ZeroConfig(stages=(2, 3))
    assert (mixed.stage, mixed.axes, mixed.is_uniform) == (3, (0, 1), False)
    assert mixed.split((0, 1)) == ((1,), (0, 1), (0, 1))
    assert ZeroConfig(stages=(1, 2)).split((1,)) == ((), (1,), (1,))
