"""capture/stages.py: a captured model split at a pipeline plan's cuts.

Chained in order (each stage fed the previous stage's outputs and the model inputs it names),
the stage graphs compute exactly (bitwise) the whole graph's loss and gradients; the planner's
``build_space`` / ``plan_captured`` work on a stage; bad cuts are one clear line each.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from autopar.capture.export import Captured, capture
from autopar.capture.stages import split_stages
from autopar.errors import UnsupportedModelError
from autopar.planner.stages import PipelinePlan, Stage, even_stages
from tests import models

STACKS = {"gpt": "blocks", "llama": "layers"}


@pytest.fixture(scope="module", params=sorted(STACKS))
def captured_4(request: pytest.FixtureRequest) -> tuple[str, Any, tuple, Captured]:
    builder = models.tiny_gpt if request.param == "gpt" else models.tiny_llama
    model, args, _ = builder(layers=4)
    return request.param, model, args, capture(model, args)


def _values(model: Any, captured: Captured, args: tuple) -> dict[str, Any]:
    state = dict(model.named_parameters(remove_duplicate=False))
    state.update(model.named_buffers())
    values = {n: state[f] for n, f in {**captured.param_nodes, **captured.buffer_nodes}.items()}
    values.update(zip(captured.input_nodes, args, strict=True))
    return values


def _run(captured: Captured, values: dict[str, Any]) -> tuple[Any, ...]:
    placeholders = [n.name for n in captured.gm.graph.nodes if n.op == "placeholder"]
    return tuple(captured.gm(*[values[name] for name in placeholders]))


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_chained_stages_equal_whole_graph(captured_4, num_stages: int) -> None:
    name, model, args, captured = captured_4
    whole_values = _values(model, captured, args)
    (want,) = _run(captured, whole_values)
    want_grads = torch.autograd.grad(want, list(model.parameters()))

    pipeline = even_stages(
        stack=STACKS[name], num_blocks=4, num_stages=num_stages, microbatches=1, schedule="1f1b"
    )
    stages = split_stages(captured, pipeline)
    assert [s.blocks for s in stages] == [s.blocks for s in pipeline.stages]
    assert stages[0].model_inputs == (captured.input_nodes[0],)  # idx
    assert stages[-1].model_inputs[-1] == captured.input_nodes[1]  # targets
    values = dict(whole_values)
    owned: set[str] = set()
    for stage in stages:
        assert stage.captured.input_nodes == [*stage.activation_inputs, *stage.model_inputs]
        owned |= set(stage.captured.param_nodes.values())
        outputs = _run(stage.captured, values)
        values.update(zip(stage.outputs, outputs, strict=True))
        if stage.index < num_stages - 1:
            assert stage.outputs and all(o.requires_grad for o in outputs)
    (got,) = outputs
    assert torch.equal(got, want)
    assert owned == set(captured.param_nodes.values())
    got_grads = torch.autograd.grad(got, list(model.parameters()))
    for (fqn, _), g, w in zip(model.named_parameters(), got_grads, want_grads, strict=True):
        assert torch.equal(g, w), fqn
    if name == "gpt":  # the tied embedding / output layer is used by the first and last stage
        assert stages[0].shared_params == {"lm_head.weight": (0, num_stages - 1)}


def test_stage_plans_on_a_submesh(captured_4) -> None:
    from autopar.api import plan_captured
    from autopar.mesh import Mesh
    from autopar.options import PlanOptions

    name, _, _, captured = captured_4
    pipeline = even_stages(
        stack=STACKS[name], num_blocks=4, num_stages=2, microbatches=1, schedule="gpipe"
    )
    last = split_stages(captured, pipeline)[-1]
    plan = plan_captured(
        last.captured,
        Mesh.spec((2,), ("tp",), device="h100"),
        PlanOptions.from_kwargs({"recipe": "megatron"}),
        model_name=name,
        price_baselines=False,
    )
    assert plan.graph_hash == last.captured.graph_hash
    assert plan.data["predicted"]["step_s"] > 0


def _plan(stack: str, num_blocks: int, blocks: list[tuple[int, int]], first: list[str]) -> Any:
    return PipelinePlan(
        axis=0,
        stack=stack,
        num_blocks=num_blocks,
        stages=tuple(
            Stage(index=i, blocks=b, first_fqn=f, pp_rank=i)
            for i, (b, f) in enumerate(zip(blocks, first, strict=True))
        ),
        microbatches=1,
        schedule="gpipe",
    )


def test_bad_cuts_are_one_line_errors(captured_4) -> None:
    name, _, _, captured = captured_4
    stack = STACKS[name]
    bad = {
        "more pipeline stages than blocks": _plan(
            stack, 4, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 4)], [f"{stack}.{i}" for i in range(5)]
        ),
        "no stack of blocks named": _plan("nope", 4, [(0, 2), (2, 4)], ["nope.0", "nope.2"]),
        "which is not block": _plan(stack, 4, [(0, 2), (2, 4)], [f"{stack}.0", f"{stack}.2.mlp"]),
        "plan the pipeline for this model": _plan(
            stack, 6, [(0, 3), (3, 6)], [f"{stack}.0", f"{stack}.3"]
        ),
    }
    for words, pipeline in bad.items():
        with pytest.raises(UnsupportedModelError, match=words) as error:
            split_stages(captured, pipeline)
        assert "\n" not in str(error.value)


def test_one_block_model_is_refused() -> None:
    model, args, _ = models.tiny_gpt(layers=1)
    captured = capture(model, args)
    pipeline = _plan("blocks", 1, [(0, 1)], ["blocks.0"])
    with pytest.raises(UnsupportedModelError, match="has one block") as error:
        split_stages(captured, pipeline)
    assert "\n" not in str(error.value)
