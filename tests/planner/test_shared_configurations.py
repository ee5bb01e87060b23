"""Work shared between the configurations of one plan gives what each configuration alone gives.

The ZeRO configurations, the recipes and the auto plan's stage 0 are built on one strategy
space: the nodes and edge matrices converted for one are reused by the next
(``planner.problem.ProblemMemo``), recipes that differ only in ZeRO share their layouts
(``planner.recipes.recipe_specs``) and the checkpoint candidates are priced on first use.
"""

from __future__ import annotations

import pytest

import autopar
import solver
from autopar.options import PlanOptions
from autopar.planner.checkpointing import candidate_segments
from autopar.planner.driver import Driver
from autopar.planner.problem import ZeroConfig, build_problem, build_space
from autopar.planner.recipes import BASELINE_RECIPES, recipe_spec, recipe_specs
from autopar.planner.zero_choice import zero_candidates
from tests.models import tiny_gpt


@pytest.fixture(scope="module")
def space():
    # Batch 8 on 3x2: ddp and fsdp cannot split it 3 ways, so the recipes carry notes.
    model, args, kwargs = tiny_gpt()
    captured = autopar.capture(model, args, kwargs)
    mesh = autopar.Mesh.parse("3x2", device="h100")
    return build_space(captured, mesh, PlanOptions(memory_budget="1.5GiB"))


def test_each_configuration_built_on_the_shared_memo_is_the_one_built_alone(space) -> None:
    driver = Driver(space)
    configurations = driver.configurations
    specs = recipe_specs(space, BASELINE_RECIPES)
    jobs = [(zero, None, None) for zero in (ZeroConfig(), *zero_candidates(2, (3, 2)))]
    jobs += [(spec.zero, spec, None) for spec in specs.values()]
    jobs += [(zero, None, driver.budget) for zero in zero_candidates(2, (3, 2))[:2]]
    for round_ in range(2):  # the second round finds everything in the memo
        for zero, spec, budget in jobs:
            built, problem = configurations._prepare(
                zero, budget=budget, spec=spec, tied=configurations.tied
            )
            alone = build_problem(
                space,
                zero,
                allowed=spec.allowed if spec else None,
                forbid=spec.forbid if spec else None,
                memory_budget_bytes=budget,
                tied=configurations.tied[0],
            )
            assert built.allowed == alone.allowed
            assert built.problem == alone.problem, (round_, zero, spec and spec.name, budget)
    assert len(configurations.memo.edges) > 0
    # Solved: the same plans as the problems built alone.
    for zero, spec, _ in jobs[:3]:
        shared = configurations.solve(zero, name="x", budget=None, spec=spec)
        alone = solver.solve(build_problem(space, zero, memory_budget_bytes=None).problem)
        assert shared.solution.choices == alone.choices
        assert shared.solution.objective_s == alone.objective_s


def test_recipes_that_differ_only_in_zero_share_layouts_equal_to_each_recipe_alone(space) -> None:
    together = recipe_specs(space, BASELINE_RECIPES)
    for name in BASELINE_RECIPES:
        alone = recipe_spec(space, name)
        shared = together[name]
        assert (shared.name, shared.zero, shared.notes) == (alone.name, alone.zero, alone.notes)
        assert shared.allowed == alone.allowed and shared.forbid == alone.forbid
    assert together["fsdp"].allowed is together["ddp"].allowed
    assert together["fsdp+tp"].forbid is together["megatron"].forbid
    assert together["fsdp"].zero == ZeroConfig(stage=3, axes=(0, 1))
    assert together["fsdp+tp"].zero == ZeroConfig(stage=3, axes=(0,))
    assert together["ddp"].zero == together["megatron"].zero == ZeroConfig()
    assert any(
        n.startswith("fsdp: the batch (8) does not split 3 ways") for n in together["fsdp"].notes
    )
    assert not any(n.startswith("ddp") for n in together["fsdp"].notes)
    with pytest.raises(ValueError, match="unknown recipe 'zero3'; choose one of ddp"):
        recipe_specs(space, ["ddp", "zero3"])


def test_checkpoint_candidates_are_priced_only_when_a_budget_needs_them(space) -> None:
    roomy = Driver(space, budget=float("inf"))
    roomy.plan()
    assert roomy.configurations._candidates is None  # everything fitted budget-free
    priced = roomy.candidates
    expected = candidate_segments(space, "auto")
    assert [c.node_index for c in priced] == [c.node_index for c in expected]
    assert roomy.with_budget(1.0).candidates is priced
