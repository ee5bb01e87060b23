"""build_problem with one ProblemMemo shared by every ZeRO configuration (as
ConfigurationSolver shares it: parameter states per configuration, parameter keys per node)
gives the very problems built with a fresh memo each, on a 4-layer tiny GPT on 2x2."""

from __future__ import annotations

from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from tests.models import tiny_gpt


def test_a_shared_memo_builds_the_problems_a_fresh_one_builds() -> None:
    from autopar.planner.problem import ProblemMemo, build_problem
    from autopar.planner.space import build_space
    from autopar.planner.zero_choice import zero_candidates

    model, args, kwargs = tiny_gpt(layers=4)
    space = build_space(capture(model, args, kwargs), Mesh.parse("2x2"), PlanOptions())
    zeros = zero_candidates(space.mesh.ndim, space.mesh.shape)
    assert len(zeros) > 2 and any(3 in z.stages for z in zeros)
    shared = ProblemMemo()
    for zero in zeros:
        got = build_problem(space, zero, memory_budget_bytes=1e9, memo=shared).problem
        want = build_problem(space, zero, memory_budget_bytes=1e9, memo=ProblemMemo()).problem
        assert got == want
    assert len(shared.param_keys) == sum(
        n.kind == "param" and n.alias_of is None for n in space.nodes
    )
