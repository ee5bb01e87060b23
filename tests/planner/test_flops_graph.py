"""A captured model's FLOPs, node by node as the planner prices them, against FlopCounterMode.

FlopCounterMode counts matmuls and attention (forward and backward) over a real eager training
step; the planner's matmul-family total must equal its matmul counts exactly, and its attention
total its SDPA counts times the causal share (the documented convention: a causal kernel skips
the masked half). The per-element families (norms, softmax, pointwise, loss) are counted only by
the planner's conventions; FlopCounterMode does not count them. And the strategy space prices
every node with exactly that work: its compute seconds are the roofline of ``node_costs``.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from autopar.capture.export import capture
from autopar.capture.flops import node_costs
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.placement import REPLICATE
from autopar.planner.space import build_space
from cost_models import attention_pairs, compute_time_s
from tests.flop_counting import CPU_SDPA_MAPPING, flop_counter
from tests.models import ALL_MODELS, SEQ


@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_llama"])
def test_captured_training_step_flops_match_flop_counter_mode(name: str) -> None:
    model, args, kwargs = ALL_MODELS[name]()
    captured = capture(model, args, kwargs, decompose=False)
    ours: dict[str, float] = defaultdict(float)
    for node in captured.gm.graph.nodes:
        work = node_costs(node)
        ours[work.family] += work.fwd_flops + work.bwd_flops

    with flop_counter() as counter:
        model(*args, **kwargs).backward()
    per_op = counter.get_flop_counts()["Global"]
    attention = sum(count for op, count in per_op.items() if op in CPU_SDPA_MAPPING)
    matmul = counter.get_total_flops() - attention
    assert attention > 0 and matmul > 0, per_op

    assert ours["matmul"] == matmul
    causal_share = attention_pairs(SEQ, SEQ, causal=True) / (SEQ * SEQ)
    assert ours["attention"] == pytest.approx(attention * causal_share, rel=1e-12)
    # What only our conventions count stays a minority of the step even at width 64.
    elementwise = sum(v for f, v in ours.items() if f not in ("matmul", "attention"))
    assert 0 < elementwise < 0.5 * (ours["matmul"] + ours["attention"])


@pytest.mark.parametrize("name", ["tiny_gpt", "tiny_llama"])
def test_planner_prices_each_replicated_node_with_node_costs(name: str) -> None:
    """The strategy space's compute seconds are the roofline of exactly ``node_costs``' work."""
    model, args, kwargs = ALL_MODELS[name]()
    captured = capture(model, args, kwargs, decompose=False)
    mesh = Mesh.spec((2,), ("dp",), device="h100")
    space = build_space(captured, mesh, PlanOptions())
    graph_nodes = {node.name: node for node in captured.gm.graph.nodes}
    families = set()
    for node_space in space.nodes:
        node = graph_nodes[node_space.name]
        if node_space.kind != "op" or node.op != "call_function":
            continue
        work = node_costs(node)
        for i, strategy in enumerate(node_space.strategies):
            placements = [p for p in (*strategy.inputs, *strategy.outputs) if p is not None]
            if any(p != REPLICATE for placement in placements for p in placement):
                continue
            expected = 0.0
            if work.family != "view" and not work.same_dtype_cast:
                for flops, nbytes in (
                    (work.fwd_flops, work.fwd_bytes),
                    (work.bwd_flops, work.bwd_bytes),
                ):
                    expected += compute_time_s(
                        flops=flops, bytes_accessed=nbytes, device=mesh.device, family=work.family
                    )
            assert node_space.compute_s[i] == pytest.approx(expected, rel=1e-9), node.name
            families.add(work.family)
    assert {"matmul", "attention", "embedding", "pointwise", "loss"} <= families


def test_same_dtype_casts_are_free_in_fp32_and_priced_under_mixed_precision() -> None:
    """tiny_llama's RMSNorm and rotary casts to float32 return their input in an fp32 graph;
    under autocast (bf16) they are real casts and stay priced."""
    model, args, kwargs = ALL_MODELS["tiny_llama"]()
    captured = capture(model, args, kwargs, decompose=False)
    casts = {n.name for n in captured.gm.graph.nodes if node_costs(n).same_dtype_cast}
    assert len(casts) >= 4
    mesh = Mesh.spec((2,), ("dp",), device="h100")
    for options, free in ((PlanOptions(), True), (PlanOptions(mixed_precision="bf16"), False)):
        space = build_space(captured, mesh, options)
        priced = [n for n in space.nodes if n.name in casts]
        assert len(priced) == len(casts)
        for node_space in priced:
            assert all((s == 0.0) == free for s in node_space.compute_s), node_space.name
            assert all((b == 0.0) == free for b in node_space.transient_bytes), node_space.name
