"""An activation read alike by several ops is priced one all-reduce of its Partial gradient,
as the lowering issues (``autopar.planner.sibling_grads``).

On the tiny LLaMA under the megatron recipe, q, k and v (and w1 and w3) read one normed
activation column-parallel: the lowering inserts one ``GradAllReduce`` for each such value.
The plan's figures count exactly the all-reduces issued (one per conversion), where the
per-consumer prices count every use; the solver's per-node costs are unchanged.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

import autopar
from autopar.api import plan_captured
from autopar.capture.export import capture
from autopar.comm import collectives
from autopar.lowering import lower
from autopar.options import PlanOptions
from autopar.plan.document import Plan
from autopar.planner.evaluation_sums import zero_free_sums
from autopar.planner.sibling_grads import shared_grad_saving
from autopar.strategies import input_nodes
from tests.models import LAYERS, tiny_gpt, tiny_llama


@functools.cache
def _planned(model: str, mesh: str, recipe: str) -> tuple[Any, Any]:
    built = tiny_llama() if model == "llama" else tiny_gpt()
    captured = capture(*built)
    plan = plan_captured(captured, autopar.Mesh.parse(mesh, device="h100"),
                         PlanOptions(recipe=recipe), model_name=model,
                         price_baselines=False)  # fmt: skip
    return captured, plan


def _activation_uses(captured: Any, space: Any, choice: tuple[int, ...]) -> tuple[int, int]:
    """(activation uses whose Partial gradient the nodes price, of them the later uses of a
    conversion an earlier sibling made)."""
    shape, count = space.mesh.shape, 0
    for node in captured.gm.graph.nodes:
        k = space.index.get(node.name)
        if k is None or space.nodes[k].kind != "op":
            continue
        strategy = space.nodes[k].strategies[choice[k]]
        for j, inp in enumerate(input_nodes(node)):
            grad = strategy.input_grads[j] if j < len(strategy.input_grads) else None
            if inp.op != "placeholder" and inp.name in space.needs_grad and grad is not None:
                count += any(p.is_partial() and shape[a] > 1 for a, p in enumerate(grad))
    later = 0
    for group in space.sibling_grads:
        taken: set = set()
        for k, keys, _ in group:
            key = keys[choice[k]]
            later += key is not None and key in taken
            taken.add(key)
    return count, later


@pytest.mark.parametrize(("model", "mesh"), [("llama", "2"), ("llama", "2x2"), ("gpt", "2")])
def test_figures_count_one_all_reduce_per_conversion_the_lowering_issues(
    model: str, mesh: str
) -> None:
    captured, plan = _planned(model, mesh, "megatron")
    space, choice = plan.space, plan.choice
    lowered = lower(captured, Plan(data=dict(plan.data)).choices(), space.mesh.shape, "k")
    issued = [n for n in lowered.gm.graph.nodes if n.target is collectives.autopar_grad_all_reduce]
    priced, later = _activation_uses(captured, space, choice)
    # Each use prices a whole all-reduce; the lowering issues one per conversion.
    assert priced - later == len(issued)
    if model == "llama":  # q, k, v and w1, w3 of every layer: 3 later uses per layer
        assert later == 3 * LAYERS
    else:
        assert later == 0  # GPT's fused c_attn and c_fc: one consumer per value
    saving = shared_grad_saving(space.sibling_grads, choice)
    sums = zero_free_sums(space, tuple(choice))
    per_node = sum(float(n.grad_comm_s[choice[i]]) for i, n in enumerate(space.nodes))
    assert sums["act_comm"] == pytest.approx(per_node - sum(saving.values()), rel=1e-12)
    assert plan.data["predicted"]["breakdown"]["activation_grad_comm_s"] == pytest.approx(
        sums["act_comm"], rel=1e-12
    )
    assert (sum(saving.values()) > 0) == (later > 0)


def test_a_pipeline_stage_prices_the_shared_all_reduces_once(monkeypatch) -> None:
    """The stage pricer's backward (head + blocks + tail) is the nodes' less the same saving."""
    from types import SimpleNamespace

    from autopar.planner import stage_pricing

    _, plan = _planned("llama", "2x2", "megatron")
    space, solved = plan.space, SimpleNamespace(choice=plan.choice)

    def backward(parts) -> float:
        return (
            parts.head.backward_s
            + parts.block.backward_s * parts.num_probe_blocks
            + (parts.tail.backward_s)
        )

    shared = backward(stage_pricing.probe_parts(space, solved, layouts="megatron"))
    monkeypatch.setattr(stage_pricing, "shared_grad_saving", lambda groups, choice: {})
    each = backward(stage_pricing.probe_parts(space, solved, layouts="megatron"))
    saving = sum(shared_grad_saving(space.sibling_grads, plan.choice).values())
    assert saving > 0 and each - shared == pytest.approx(saving, rel=1e-9)
