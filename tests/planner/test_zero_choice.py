"""The auto plan's ZeRO choice: stage x axis subset under the memory budget (no processes).

The runtime applies one stage to a chosen subset of the data-parallel axes, so the planner's
space is stage 0 plus stages 1-3 on every non-empty subset; stages 1-2 other than stage 2 on
every axis are pruned by dominance (same time under the cost model, no less memory). Checked
here: the enumeration, that every pruned configuration's own optimum is really no better than
its dominator's, that a shrinking budget moves the choice from stage 0 to stage 2 on the tiny
MLP (stage 3 is priced and listed but loses there: sharding weights over the same axis saves the
same bytes for less communication, which the ILP finds under the budget), and that the plan
JSON / summary record every configuration and why the chosen one won.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest

import autopar
import solver
from autopar.api import _solve, plan_captured, zero_candidates, zero_configurations
from autopar.capture import capture
from autopar.options import PlanOptions
from autopar.plan import Plan
from autopar.problem import ZeroConfig, build_space
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


def test_configurations_are_every_stage_on_every_axis_subset() -> None:
    configs = zero_configurations((2, 2))
    assert [(z.stage, z.axes) for z, _ in configs] == [(0, ())] + [
        (stage, axes) for stage in (1, 2, 3) for axes in ((0,), (1,), (0, 1))
    ]
    top = ZeroConfig(stage=2, axes=(0, 1))
    pruned = {(z.stage, z.axes) for z, by in configs if by is not None}
    assert pruned == {(1, (0,)), (1, (1,)), (1, (0, 1)), (2, (0,)), (2, (1,))}
    assert all(by == top for _, by in configs if by is not None)
    assert zero_candidates(2, (2, 2)) == [top] + [
        ZeroConfig(stage=3, axes=a) for a in ((0,), (1,), (0, 1))
    ]
    # Axes of size 1 are not data parallel; a 1-device mesh has only stage 0.
    assert [(z.stage, z.axes) for z, _ in zero_configurations((1, 4))] == [
        (0, ()),
        (1, (1,)),
        (2, (1,)),
        (3, (1,)),
    ]
    assert zero_configurations((1,)) == [(ZeroConfig(), None)]


def test_pruned_configurations_are_no_better_than_their_dominator() -> None:
    """Solve every pruned configuration under a budget that forces ZeRO on 2x2: none beats
    stage 2 on both axes, and every one that fits is at least as slow."""
    mesh = autopar.Mesh.spec(*MESH_2D)
    budget = 0.4 * _stage0_peak(MESH_2D)
    options = PlanOptions(memory_budget=int(budget))
    space = build_space(_captured(), mesh, options)
    top = _solve(space, ZeroConfig(stage=2, axes=(0, 1)), options, name="top", budget=budget)
    checked = 0
    for zero, dominated_by in zero_configurations(mesh.shape):
        if dominated_by is None or zero.stage == 0:
            continue
        assert dominated_by == top.zero
        try:
            solved = _solve(space, zero, options, name="pruned", budget=budget)
        except solver.InfeasibleBudgetError:
            continue
        checked += 1
        assert solved.evaluation.step_s >= top.evaluation.step_s * (1 - 1e-9), zero
    # The pruned stage-1 / stage-2 candidates that fit at all must have been compared.
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
    text = plan.summary(width=220)
    assert "ZeRO configurations considered" in text
    assert f"ZeRO choice: {zero['reason']}" in text
    # The JSON round-trips with the choice.
    again = Plan.from_json(plan.to_json())
    assert again.zero["considered"] == considered


def test_budget_on_2x2_prunes_and_explains() -> None:
    plan = _plan(MESH_2D, memory_budget=int(0.4 * _stage0_peak(MESH_2D)))
    zero = plan.zero
    assert zero["stage"] >= 2 and zero["axes"], zero["reason"]
    verdicts = {(r["stage"], tuple(r["axes"])): r["verdict"] for r in zero["considered"]}
    assert len(verdicts) == 10
    for axes in (("dp",), ("tp",), ("dp", "tp")):
        assert verdicts[(1, axes)].startswith("pruned: stage 2 on dp,tp")
    assert verdicts[(zero["stage"], tuple(zero["axes"]))] == "chosen"
    assert "stage 2 on dp,tp is as fast" in verdicts[(0, ())]


def test_forced_stage_and_recipe_say_so() -> None:
    forced = _plan(MESH_1D, zero_stage=3)
    assert forced.zero["stage"] == 3 and forced.zero["axes"] == ["dp"]
    assert forced.zero["reason"] == "zero_stage=3 was asked for"
    # Chunks are capped at 1/8 of the parameters (or the largest one): stage 3 gathers about two
    # at a time, not the whole model (the search alone would take one chunk for a model this
    # small: it minimises padding).
    sizes = [4 * math.prod(p["shape"]) for p in forced.data["params"].values()]
    cap = max(max(sizes), -(-sum(sizes) // MIN_CHUNKS))
    for plan in (forced, _plan(MESH_1D, zero_stage=2)):
        assert 0 < plan.zero["chunk_bytes"] <= cap + 4 * 2, (plan.zero["chunk_bytes"], cap)
    assert choose_chunk_bytes([n // 4 for n in sizes], 2)[0] > cap
    recipe = _plan(MESH_1D, recipe="fsdp")
    assert recipe.zero["reason"] == "recipe 'fsdp' fixes stage 3 on dp"
    assert sum(r["verdict"] == "chosen" for r in recipe.zero["considered"]) == 1
