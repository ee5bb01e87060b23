"""The pricing of Partial gradients the lowering carries back to a parameter
(``autopar.planner.chain_grads``, mirroring ``autopar.lowering.param_chains``).

On the tiny GPT (its position embedding ``embedding(wpe, arange)`` added to the batch-sharded
token embeddings), built with and without the pass:

* under the ddp recipe on 4 and 2x2, the lowering issues no gradient all-reduce, and the
  position embedding's edge into the ``add`` is priced at ``wpe``'s bucketed share on every
  axis, the ``add`` node no longer pricing a whole all-reduce;
* for every pair of strategies of the edge's two ends, the pass only moves the price: the
  edge plus the consumer's ``grad_comm_s`` equals what the space without the pass prices,
  less the whole all-reduce and plus the bucketed share on each axis where the producer's
  inputs are all Replicate and the layouts agree, and unchanged elsewhere;
* the plan's predicted step under ddp is the one without the pass less the whole all-reduce
  plus the share (the other terms equal).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

import autopar
from autopar.api import plan_captured
from autopar.capture.export import capture
from autopar.comm import collectives
from autopar.lowering import lower
from autopar.options import PlanOptions
from autopar.placement import is_replicate
from autopar.plan.document import Plan
from autopar.planner import space as space_module
from autopar.planner.pricing import CommPricer
from autopar.strategies.registry import tensor_meta
from tests.models import tiny_gpt

aten = torch.ops.aten


def _plan(mesh: str, *, chains: bool) -> tuple[Any, Any]:
    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    mp = pytest.MonkeyPatch()
    if not chains:
        mp.setattr(space_module, "price_chain_grads", lambda *args: 0)
    try:
        plan = plan_captured(
            captured,
            autopar.Mesh.parse(mesh, device="h100"),
            PlanOptions(recipe="ddp"),
            model_name="gpt",
            price_baselines=False,
        )
    finally:
        mp.undo()
    return captured, plan


@functools.cache
def _both(mesh: str) -> tuple[Any, Any, Any]:
    captured, plan = _plan(mesh, chains=True)
    return captured, plan, _plan(mesh, chains=False)[1]


def _ends(space: Any) -> tuple[int, int, Any]:
    src, dst = space.index["embedding_1"], space.index["add"]
    edge = next(e for e in space.edges if e.src == src and e.dst == dst and e.input_index >= 0)
    return src, dst, edge


def _wpe_bytes(captured: Any) -> float:
    wpe = next(n for n, fqn in captured.param_nodes.items() if fqn == "wpe.weight")
    val = captured.gm.graph.find_nodes(op="placeholder", target=wpe)[0].meta["val"]
    return float(val.numel() * val.element_size())


@pytest.mark.parametrize("mesh", ["4", "2x2"])
def test_ddp_position_gradient_is_priced_as_the_bucketed_share_the_lowering_issues(
    mesh: str,
) -> None:
    captured, plan, _ = _both(mesh)
    space = plan.space
    lowered = lower(captured, Plan(data=dict(plan.data)).choices(), space.mesh.shape, "k")
    assert not [
        n for n in lowered.gm.graph.nodes if n.target is collectives.autopar_grad_all_reduce
    ]
    assert lowered.param_grad_reduce_axes["wpe.weight"] == tuple(range(len(space.mesh.shape)))
    pricer = CommPricer(space.mesh, None)
    share = sum(pricer.grad_sync_s(_wpe_bytes(captured), a) for a in range(len(space.mesh.shape)))
    src, dst, edge = _ends(space)
    choice = plan.choice
    assert edge.cost_s[choice[src], choice[dst]] == pytest.approx(share, rel=1e-9)
    assert space.nodes[dst].grad_comm_s[choice[dst]] == 0.0


@pytest.mark.parametrize("mesh", ["4", "2x2"])
def test_the_pass_only_moves_the_price_and_defers_where_the_lowering_does(mesh: str) -> None:
    captured, plan, before = _both(mesh)
    space, old = plan.space, before.space
    src, dst, edge = _ends(space)
    _, _, old_edge = _ends(old)
    producer, consumer = space.nodes[src], space.nodes[dst]
    pricer = CommPricer(space.mesh, None)
    shape = space.mesh.shape
    meta = tensor_meta(
        captured.gm.graph.find_nodes(op="call_function", target=aten.embedding.default)[1].meta[
            "val"
        ]
    )
    deferred_pairs = 0
    for s, ps in enumerate(producer.strategies):
        for t, cs in enumerate(consumer.strategies):
            want = old_edge.cost_s[s, t] + old.nodes[dst].grad_comm_s[t]
            got = edge.cost_s[s, t] + consumer.grad_comm_s[t]
            grad = cs.input_grads[1]
            for a in range(len(shape)):
                if grad is None or not grad[a].is_partial():
                    continue
                inputs_replicated = all(p is None or is_replicate(p[a]) for p in ps.inputs)
                if inputs_replicated and ps.outputs[0] == cs.inputs[1]:
                    split = np.prod(
                        [shape[b] for b, p in enumerate(ps.inputs[0]) if not is_replicate(p)]
                    )
                    want += pricer.grad_sync_s(_wpe_bytes(captured) / split, a)
                    act_bytes = space_module.local_bytes(meta, cs.inputs[1], shape)
                    want -= pricer.all_reduce_s(act_bytes, a)
                    deferred_pairs += 1
            assert got == pytest.approx(want, rel=1e-9, abs=1e-15), (s, t)
    assert deferred_pairs > 0


@pytest.mark.parametrize("mesh", ["4", "2x2"])
def test_ddp_prediction_changes_by_the_moved_reduction_only(mesh: str) -> None:
    captured, plan, before = _both(mesh)
    assert plan.choice == before.choice
    pricer = CommPricer(plan.space.mesh, None)
    axes = range(len(plan.space.mesh.shape))
    moved = sum(
        pricer.grad_sync_s(_wpe_bytes(captured), a) - pricer.all_reduce_s(16 * 64 * 4.0, a)
        for a in axes
    )
    assert plan.predicted_step_s - before.predicted_step_s == pytest.approx(moved, rel=1e-6)


def test_a_table_too_big_to_move_is_priced_where_its_rows_are_reduced() -> None:
    from autopar.planner.chain_grads import CARRY_EXTRA_BYTES
    from tests.distributed.test_param_chains import SEQ, WIDTH, position_tables

    rows = (CARRY_EXTRA_BYTES + SEQ * WIDTH * 4) // (WIDTH * 4) + 1
    reduced = {}
    for n in (rows, rows - 1):
        model, args, kwargs = position_tables(pos_rows=n)
        captured = capture(model, args, kwargs)
        plan = plan_captured(
            captured,
            autopar.Mesh.parse("2", device="h100"),
            PlanOptions(recipe="ddp"),
            model_name="tables",
            price_baselines=False,
        )
        space, choice = plan.space, plan.choice
        unsqueeze = space.index["unsqueeze"]
        consumer = next(e.dst for e in space.edges if e.src == unsqueeze and e.input_index >= 0)
        reduced[n] = space.nodes[consumer].grad_comm_s[choice[consumer]]
        lowered = lower(captured, Plan(data=dict(plan.data)).choices(), space.mesh.shape, "k")
        assert ("pos" in lowered.param_grad_reduce_axes) == (n < rows)
    # Too big: the consumer still prices the rows' whole all-reduce; one row fewer: moved.
    assert reduced[rows] > 0.0
    assert reduced[rows - 1] < reduced[rows]
