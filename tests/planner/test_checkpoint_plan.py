"""Checkpoint segments chosen jointly with sharding: candidates, modes, budgets, the plan JSON."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import solver
from autopar.api import plan_captured
from autopar.capture.export import Captured, capture
from autopar.errors import BudgetError, PlanningError
from autopar.mesh import Mesh
from autopar.models import GPT, GPTConfig
from autopar.options import PlanOptions
from autopar.plan.document import Plan
from autopar.planner.checkpointing import candidate_segments, solver_segments
from autopar.planner.configurations import tie_levels
from autopar.planner.problem import ZeroConfig, build_problem, build_space
from tests.models import tiny_gpt

MESH = Mesh.spec((2,), ("dp",))


@pytest.fixture(scope="module")
def gpt() -> Captured:
    model, args, kwargs = tiny_gpt()
    return capture(model, args, kwargs)


def make_plan(captured: Captured, **options) -> Plan:
    opts = PlanOptions(zero_stage=0, **options)
    return plan_captured(captured, MESH, opts, model_name="tiny-gpt", price_baselines=False)


def smallest_budget(captured: Captured, checkpoint: str) -> float:
    with pytest.raises(BudgetError) as err:
        make_plan(captured, memory_budget=1, checkpoint=checkpoint)
    return err.value.min_budget_bytes


def test_candidates_are_blocks_selective_blocks_attention_and_mlp(gpt: Captured) -> None:
    space = build_space(gpt, MESH, PlanOptions())
    candidates = candidate_segments(space, "auto")
    names = [(c.segment.module_path, c.segment.policy) for c in candidates]
    for i in range(2):
        for entry in (
            (f"blocks.{i}", "full"),
            (f"blocks.{i}", "selective"),
            (f"blocks.{i}.attn", "full"),
            (f"blocks.{i}.mlp", "full"),
        ):
            assert entry in names
    block = next(c for c in candidates if c.segment.module_path == "blocks.0")
    by_name = {n.name: n for n in gpt.gm.graph.nodes}
    for name, freed in zip(block.segment.nodes, block.freed_bytes):
        users_outside = any(u.name not in block.segment.nodes for u in by_name[name].users)
        if users_outside:  # the block's output stays saved by the next block
            assert not freed.any(), name
    selective = next(c for c in candidates if c.segment.policy == "selective")
    kept = {str(by_name[n].target) for n in selective.segment.keep}
    assert kept <= {"aten.linear.default", "aten.scaled_dot_product_attention.default"}
    assert kept
    assert [c.segment.module_path for c in candidate_segments(space, "all")] == [
        "blocks.0",
        "blocks.1",
    ]
    assert candidate_segments(space, "none") == ()


def test_tight_budget_recomputes_and_fits_where_no_checkpointing_cannot(gpt: Captured) -> None:
    without = smallest_budget(gpt, "none")
    tight = smallest_budget(gpt, "auto") * 0.4 + without * 0.6
    assert tight < without
    with pytest.raises(PlanningError, match="too small"):
        make_plan(gpt, memory_budget=int(tight), checkpoint="none")
    plan = make_plan(gpt, memory_budget=int(tight), checkpoint="auto")
    segments = plan.checkpoint_segments()
    assert segments
    assert plan.predicted_peak_memory_bytes <= tight
    pred = plan.data["predicted"]
    assert pred["breakdown"]["recompute_s"] > 0
    saved = sum(s["saved_bytes"] for s in plan.data["checkpoint"]["segments"])
    assert pred["memory"]["recompute_peak"] == max(
        s["saved_bytes"] for s in plan.data["checkpoint"]["segments"]
    )
    assert saved > pred["memory"]["recompute_peak"]
    nodes = [n for s in segments for n in s.nodes]
    assert len(nodes) == len(set(nodes)), "segments overlap"
    looser = make_plan(gpt, memory_budget=int(without * 1.01), checkpoint="auto")
    assert sum(s["saved_bytes"] for s in looser.data["checkpoint"]["segments"]) < saved
    assert looser.predicted_step_s < plan.predicted_step_s
    # JSON round trip, schema and summary.
    again = Plan.from_json(plan.to_json(), expected_hash=gpt.graph_hash)
    assert again.checkpoint_segments() == segments
    assert "segment(s) recomputed" in plan.summary(verbose=True)


def test_checkpoint_all_recomputes_every_block(gpt: Captured) -> None:
    none = make_plan(gpt, checkpoint="none")
    every = make_plan(gpt, checkpoint="all")
    assert [s.module_path for s in every.checkpoint_segments()] == ["blocks.0", "blocks.1"]
    assert all(s.policy == "full" for s in every.checkpoint_segments())
    assert none.checkpoint_segments() == ()
    acts = every.data["predicted"]["memory"]["activations"]
    assert acts < none.data["predicted"]["memory"]["activations"]
    assert every.predicted_step_s > none.predicted_step_s
    # Without a binding budget 'auto' recomputes nothing: it only costs time.
    assert make_plan(gpt, checkpoint="auto").checkpoint_segments() == ()


def test_tied_layers_keep_the_checkpoint_ilp_size_independent_of_depth() -> None:
    sizes = {}
    for layers in (4, 16):
        config = GPTConfig(vocab_size=128, block_size=16, n_layer=layers, n_head=2, n_embd=32)
        tokens = torch.zeros(4, 16, dtype=torch.long)
        captured = capture(GPT(config), (tokens, tokens), None)
        space = build_space(captured, MESH, PlanOptions())
        tied = tie_levels(space)[0]
        candidates = candidate_segments(space, "auto")
        built = build_problem(space, ZeroConfig(), memory_budget_bytes=1.0, tied=tied)
        problem = dataclasses.replace(
            built.problem, segments=solver_segments(candidates, built.allowed, forced=False)
        )
        smallest = []
        for candidate_problem in (problem, built.problem):  # with and without segments
            with pytest.raises(solver.InfeasibleBudgetError) as err:
                solver.solve(candidate_problem)
            smallest.append(err.value.min_budget_bytes)
        budget = 0.5 * (smallest[0] + smallest[1])
        sol = solver.solve(dataclasses.replace(problem, memory_budget_bytes=budget))
        assert sol.peak_memory_bytes <= budget
        assert sum(sol.recomputed) > 0
        sizes[layers] = sol.num_variables
    # 4 segment classes; 3 more bits each from 4 to 16 layers, 3 variables per bit.
    assert sizes[16] - sizes[4] <= 4 * 3 * ((16).bit_length() - (4).bit_length())


def test_a_recipe_that_does_not_fit_recomputes_within_its_layouts(gpt: Captured) -> None:
    def ddp(**options) -> Plan:
        return plan_captured(
            gpt,
            MESH,
            PlanOptions(recipe="ddp", **options),
            model_name="tiny-gpt",
            price_baselines=False,
        )

    free = ddp(checkpoint="none")
    budget = int(free.predicted_peak_memory_bytes * 0.95)
    with pytest.raises(PlanningError, match="recipe 'ddp' needs"):
        ddp(checkpoint="none", memory_budget=budget)
    plan = ddp(checkpoint="auto", memory_budget=budget)
    assert plan.checkpoint_segments()
    assert plan.predicted_peak_memory_bytes <= budget
    assert plan.param_placements() == free.param_placements()


def test_budget_sweep_runs_from_the_smallest_budget_that_fits_to_the_free_peak(
    gpt: Captured, tmp_path
) -> None:
    from autopar.planner.driver import Driver
    from autopar.planner.sweep import budget_sweep
    from autopar.tools.report import plot_budget_sweep, sweep_table

    points = budget_sweep(Driver(build_space(gpt, MESH, PlanOptions(zero_stage=0))), num_points=2)
    assert len(points) == 2
    low, high = points
    assert low.budget_bytes < high.budget_bytes
    assert low.step_s is not None and low.peak_memory_bytes <= low.budget_bytes + 1
    assert low.num_segments > 0 and low.recompute_s > 0  # the smallest fit needs recompute
    assert high.num_segments == 0 and high.step_s < low.step_s
    text = sweep_table(points)
    assert "segments" in text and "ZeRO stage" in text
    plot_budget_sweep(points, str(tmp_path / "sweep.png"))
    assert (tmp_path / "sweep.png").stat().st_size > 1000


def test_cli_sweep_budget_prints_the_table_and_writes_the_plot(
    monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    import autopar.planner.sweep
    import autopar.presets
    from autopar.planner.sweep import SweepPoint
    from autopar.tools.cli import main

    calls = {}

    def fake_sweep(driver, *, num_points):
        calls.update(
            checkpoint=driver.options.checkpoint,
            num_points=num_points,
            mesh=driver.space.mesh.shape,
        )
        return [
            SweepPoint(
                budget_bytes=2**20,
                step_s=None,
                peak_memory_bytes=None,
                recompute_s=0.0,
                num_segments=0,
                zero_stage=None,
            ),
            SweepPoint(
                budget_bytes=2**21,
                step_s=2e-3,
                peak_memory_bytes=1.9 * 2**20,
                recompute_s=3e-4,
                num_segments=2,
                zero_stage=0,
            ),
        ]

    monkeypatch.setattr(autopar.presets, "build_preset", lambda name, batch, seq: tiny_gpt())
    monkeypatch.setattr(autopar.planner.sweep, "budget_sweep", fake_sweep)
    plot = tmp_path / "curve.png"
    args = [
        "plan",
        "tiny",
        "--mesh",
        "2",
        "--checkpoint",
        "auto",
        "--sweep-budget",
        "5",
        "--sweep-plot",
        str(plot),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "2.000 ms" in out and "300.0 us" in out
    assert calls == {"checkpoint": "auto", "num_points": 5, "mesh": (2,)}
    assert plot.stat().st_size > 1000
