"""A captured model's FLOPs, node by node as the planner prices them, against FlopCounterMode.

FlopCounterMode counts matmuls and attention (forward and backward) over a real eager training
step; the planner's matmul-family total must equal its matmul counts exactly, and its attention
total its SDPA counts times the causal share (the documented convention: a causal kernel skips
the masked half). The per-element families (norms, softmax, pointwise, loss) are counted only by
the planner's conventions; FlopCounterMode does not count them.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from autopar.capture import capture
from autopar.flops import node_costs
from cost_models import attention_pairs
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
