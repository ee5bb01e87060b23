"""The loss's reductions priced as the lowering fuses them (autopar.planner.fused_pricing).

A GPT's mean loss is ``sum / count``, both Partial over the batch axes; the lowering all-reduces
both right before the division and fuses the two calls when each is one all-reduce on the same
axis (``lowering.fused_reductions``). On 1-D ddp: one call, priced as one; on 2x2 ddp each value
takes two all-reduces (one per axis), which the lowering orders by chain step and fuses axis by
axis: two calls, priced as two. Over every layout of the two producers and the division, the price is never below what
the lowering issues, and equal to it wherever the two values are converted alike.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest

import autopar
from autopar.api import plan_captured
from autopar.capture.export import capture
from autopar.comm import collectives
from autopar.lowering import lower
from autopar.lowering.fused_reductions import fuse_all_reduces
from autopar.options import PlanOptions
from autopar.plan.document import Plan
from autopar.planner.pricing import CommPricer
from tests.chains import loss_and_count_chains
from tests.models import tiny_gpt


@functools.cache
def _ddp(mesh: str) -> tuple[Any, Any]:
    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    plan = plan_captured(
        captured,
        autopar.Mesh.parse(mesh, device="h100"),
        PlanOptions(recipe="ddp"),
        model_name="gpt",
        price_baselines=False,
    )
    return captured, plan


def _loss_edges(space: Any) -> tuple[int, list[Any], list[Any]]:
    """The loss node, its incoming edges and the pair edges between its producers."""
    out = next(n for n in space.captured.gm.graph.nodes if n.op == "output")
    loss = space.index[out.all_input_nodes[0].name]
    into = sorted(
        (e for e in space.edges if e.dst == loss and e.input_index >= 0),
        key=lambda e: e.input_index,
    )
    producers = {e.src for e in into}
    pairs = [e for e in space.edges if e.input_index == -2 and {e.src, e.dst} <= producers]
    return loss, into, pairs


def _priced_s(space: Any, choice: Any, loss: int, edges: list[Any]) -> float:
    cost = sum(float(e.cost_s[choice[e.src], choice[e.dst]]) for e in edges)
    return cost + float(space.nodes[loss].output_comm_s[choice[loss]])


@pytest.mark.parametrize(("mesh", "calls"), [("2", 1), ("2x2", 2)])
def test_the_loss_reductions_are_priced_as_the_all_reduces_the_lowering_issues(
    mesh: str, calls: int
) -> None:
    captured, plan = _ddp(mesh)
    space = plan.space
    lowered = lower(captured, Plan(data=dict(plan.data)).choices(), space.mesh.shape, "k")
    reductions = (collectives.autopar_all_reduce, collectives.autopar_all_reduce_many)
    issued = [n for n in lowered.gm.graph.nodes if n.target in reductions]
    assert len(issued) == calls
    assert all(n.target is collectives.autopar_all_reduce_many for n in issued)
    assert sorted(n.args[2] for n in issued) == list(range(calls))
    pricer = CommPricer(space.mesh, None)
    # Each issued call's price (an axis argument; bytes of two scalars).
    want = sum(pricer.all_reduce_s(8.0, n.args[2]) for n in issued)
    loss, into, pairs = _loss_edges(space)
    assert _priced_s(space, plan.choice, loss, into + pairs) == pytest.approx(want, rel=1e-3)


def _issued_calls(steps_i: list[int], steps_j: list[int]) -> list[tuple[int, int]]:
    """(axis, scalars) of each call the lowering's fusion pass issues for a loss sum all-reduced
    on ``steps_i`` and a token count on ``steps_j`` (in that order, as the conversions are
    inserted before the division)."""
    graph, ends = loss_and_count_chains(steps_i, steps_j, "k")
    graph.output(tuple(ends))
    fuse_all_reduces(graph)
    calls = []
    for node in graph.nodes:
        if node.target is collectives.autopar_all_reduce:
            calls.append((node.args[2], 1))
        elif node.target is collectives.autopar_all_reduce_many:
            calls.append((node.args[2], len(node.args[0])))
    return calls


@pytest.mark.parametrize("mesh", ["2", "2x2"])
def test_the_loss_price_is_never_below_the_calls_issued_and_exact_for_alike_values(
    mesh: str,
) -> None:
    """Every combination of layouts of the sum, the count and the division: the calls the
    lowering issues (each input's conversion before the division, one all-reduce per
    Partial-to-Replicate axis in axis order, run through the lowering's own fusion pass on a
    graph of just those calls; then the output's conversion) against the price. Exact where the
    division takes both in one layout and the producers have one layout."""
    space = _ddp(mesh)[1].space
    pricer = CommPricer(space.mesh, None)
    loss, into, pairs = _loss_edges(space)
    first, second = into
    nodes = space.nodes
    choice = list(_ddp(mesh)[1].choice)
    checked = exact = 0
    for s_i, s_j, t in itertools.product(
        range(len(nodes[first.src].strategies)),
        range(len(nodes[second.src].strategies)),
        range(len(nodes[loss].strategies)),
    ):
        if not all(e.cost_s[s, t] < float("inf") for e, s in ((first, s_i), (second, s_j))):
            continue
        choice[first.src], choice[second.src], choice[loss] = s_i, s_j, t
        steps, layouts = [], []
        for e, s in ((first, s_i), (second, s_j)):
            src = nodes[e.src].strategies[s].outputs[0]
            dst = nodes[loss].strategies[t].inputs[e.input_index]
            layouts.append((src, dst))
            steps.append(
                [a for a in range(len(src)) if src[a].is_partial() and dst[a].is_replicate()]
            )
        issued_s = sum(
            pricer.all_reduce_s(4.0 * count, axis) for axis, count in _issued_calls(*steps)
        )
        issued_s += float(nodes[loss].output_comm_s[t])
        priced_s = _priced_s(space, choice, loss, into + pairs)
        alike = layouts[0] == layouts[1]
        assert priced_s >= issued_s * (1 - 1e-6), (s_i, s_j, t)
        if alike:
            assert priced_s == pytest.approx(issued_s, rel=1e-3), (s_i, s_j, t)
            exact += 1
        checked += 1
    assert checked >= 4 and exact >= 2
