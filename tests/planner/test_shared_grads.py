"""A parameter read by two ops (a GPT's embedding tied to its head) has its gradient reduced once
by the runtime, after autograd sums both uses; the planner prices it once
(``autopar.planner.shared_grads``).

Over every pair of strategies of the two consumers, the pair term prices what the lowering
issues: nothing more on an axis where both leave the gradient Partial in the same placements
(one bucketed reduction, the first use's), the in-graph all-reduces elsewhere. On the ddp recipe over 2x2 the step drops by one
gradient all-reduce of the tied table per axis.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

import autopar
from autopar.api import plan_captured
from autopar.capture.export import capture
from autopar.options import PlanOptions
from autopar.planner import space as space_module
from autopar.planner.pricing import GRAD_BUCKET_BYTES
from autopar.planner.shared_grads import SHARED_GRAD_EDGE
from tests.models import hf_gpt2

MESH = "2x2"


@functools.cache
def _plans(shared: bool) -> tuple[Any, Any]:
    model, args, kwargs = hf_gpt2()
    captured = capture(model, args, kwargs)
    assert captured.tied_params, "hf_gpt2 ties its embedding and head"
    original = space_module.price_shared_param_grads
    if not shared:
        space_module.price_shared_param_grads = lambda *a, **k: frozenset()
    try:
        plan = plan_captured(
            captured,
            autopar.Mesh.parse(MESH, device="h100"),
            PlanOptions(recipe="ddp"),
            model_name="gpt2",
            price_baselines=False,
        )
    finally:
        space_module.price_shared_param_grads = original
    return captured, plan


def _tied_uses(space: Any) -> list[tuple[int, int]]:
    """(consumer index, input position) of the tied table's uses, in graph order."""
    owner = {n.name: n.alias_of or n.name for n in space.nodes if n.kind == "param"}
    tied = {
        name
        for name, node in ((n.name, n) for n in space.nodes)
        if node.kind == "param" and node.fqn in space.captured.tied_params
    }
    owners = {owner[name] for name in tied}
    uses = []
    for node in space.captured.gm.graph.nodes:
        k = space.index.get(node.name)
        if k is None or space.nodes[k].kind != "op":
            continue
        for j, inp in enumerate(node.all_input_nodes):
            if owner.get(inp.name) in owners:
                uses.append((k, j))
    return uses


def test_the_tied_table_is_read_by_two_ops_and_gets_one_pair_edge() -> None:
    space = _plans(True)[1].space
    uses = _tied_uses(space)
    assert len(uses) == 2, uses
    (c1, _), (c2, _) = uses
    pairs = [e for e in space.edges if e.input_index == SHARED_GRAD_EDGE]
    assert [(e.src, e.dst) for e in pairs] == [(min(c1, c2), max(c1, c2))]


def test_every_pair_of_layouts_pays_one_reduction_where_the_uses_agree_and_two_elsewhere() -> None:
    """The later use (the head) prices no reduction of the table on its own; the pair edge
    prices, per axis where the two uses do not both leave the gradient Partial in the same
    placements, the in-graph all-reduces the lowering then issues (the head's whole, the
    embedding's topped up from its bucketed price)."""
    new, old = _plans(True)[1].space, _plans(False)[1].space
    (c1, j1), (c2, j2) = _tied_uses(new)
    assert not new.nodes[c2].param_grad_comm_s.any()  # the head's only parameter is the table
    assert old.nodes[c2].param_grad_comm_s.any()
    pair = next(e for e in new.edges if e.input_index == SHARED_GRAD_EDGE)
    matrix = pair.cost_s if pair.src == c1 else pair.cost_s.T
    first, later = new.nodes[c1].strategies, new.nodes[c2].strategies
    shape = new.mesh.shape
    pricer = space_module.CommPricer(new.mesh, None)
    fx_node = next(n for n in new.captured.gm.graph.nodes if n.name == new.nodes[c2].name)
    meta = space_module.tensor_meta(fx_node.all_input_nodes[j2].meta["val"])
    agreeing = disagreeing = 0
    for s, t in np.ndindex(len(first), len(later)):
        g1, g2 = first[s].input_grads[j1], later[t].input_grads[j2]
        same = first[s].inputs[j1] == later[t].inputs[j2]
        bytes_1 = space_module.local_bytes(meta, first[s].inputs[j1], shape)
        bytes_2 = space_module.local_bytes(meta, later[t].inputs[j2], shape)
        want = 0.0
        for a in range(len(shape)):
            p1 = shape[a] > 1 and g1 is not None and g1[a].is_partial()
            p2 = shape[a] > 1 and g2 is not None and g2[a].is_partial()
            if p1 and p2 and same:
                agreeing += 1
                continue
            if p2:  # the later use's gradient all-reduced in the graph, whole
                want += pricer.all_reduce_s(bytes_2, a)
                disagreeing += 1
            if p1:  # the first use's, topped up from its bucketed price
                want += pricer.all_reduce_s(bytes_1, a) - pricer.grad_sync_s(bytes_1, a)
        assert matrix[s, t] == pytest.approx(want, rel=1e-12, abs=1e-18), (s, t)
    assert agreeing >= 1 and disagreeing >= 1


def test_the_ddp_step_pays_one_all_reduce_of_the_tied_table_per_axis() -> None:
    new, old = _plans(True)[1], _plans(False)[1]
    space = new.space
    (c1, j1), _ = _tied_uses(space)
    strategy = space.nodes[c1].strategies[new.choice[c1]]
    fx_node = next(n for n in space.captured.gm.graph.nodes if n.name == space.nodes[c1].name)
    meta = space_module.tensor_meta(fx_node.all_input_nodes[j1].meta["val"])
    nbytes = space_module.local_bytes(meta, strategy.inputs[j1], space.mesh.shape)
    pricer = space_module.CommPricer(space.mesh, None)
    # Every gradient fits one bucket: the buckets' latencies are about one call per axis either
    # way (pricing.bucket_rounding shares the last bucket's latency over the pool, which no
    # longer holds the table twice), so the table's second copy cost its bytes' part, to the
    # redistributed rounding (1% here).
    axes = range(len(space.mesh.shape))
    bytes_part = sum(
        pricer.grad_sync_s(nbytes, a) - pricer.all_reduce_latency_s(a) * nbytes / GRAD_BUCKET_BYTES
        for a in axes
    )
    assert new.choice == old.choice
    saved = old.data["predicted"]["step_s"] - new.data["predicted"]["step_s"]
    assert saved == pytest.approx(bytes_part, rel=0.03)
    breakdown = [p.data["predicted"]["breakdown"]["grad_sync_s"] for p in (old, new)]
    assert breakdown[0] - breakdown[1] == pytest.approx(saved, rel=1e-9)
