"""The FLOP and byte model: hand-counted ops, and torch's FlopCounterMode wherever it counts.

The planner prices every node with ``autopar.capture.flops.node_costs`` (``op_costs`` is the same for
one call), which maps nodes onto the formulas of ``cost_models.compute``; these tests check
those numbers, forward and backward, against counts made by hand and against FlopCounterMode
run on small real tensors. The one documented difference: causal attention counts only its
unmasked (query, key) pairs, FlopCounterMode counts all of them.
"""

from __future__ import annotations

import pytest
import torch

from autopar.capture.flops import node_costs, op_costs, returns_input
from cost_models import attention_pairs
from tests.flop_counting import counted_forward_backward

aten = torch.ops.aten
F32 = 4  # bytes per float32 element
I64 = 8


def _t(*shape: int, grad: bool = True) -> torch.Tensor:
    generator = torch.Generator().manual_seed(sum(shape))
    return torch.randn(*shape, generator=generator).requires_grad_(grad)


# --------------------------------------------------------------------------------------------
# (a) Hand-counted FLOPs and bytes


def test_linear_counts_2mnk_and_one_product_per_operand_needing_a_gradient() -> None:
    w, b = _t(48, 32), _t(48)
    for x_grad, products in ((False, 1), (True, 2)):
        x = _t(4, 6, 32, grad=x_grad)
        work = op_costs(aten.linear.default, (x, w, b))
        assert work.family == "matmul"
        assert work.fwd_flops == 2 * 24 * 32 * 48
        assert work.bwd_flops == products * 2 * 24 * 32 * 48  # dW (and dX); db is a sum
        assert work.fwd_bytes == F32 * (24 * 32 + 48 * 32 + 48 + 24 * 48)
        assert work.bwd_bytes == 2 * work.fwd_bytes


def test_addmm_bmm_baddbmm_matmul_hand_counts() -> None:
    cases = [
        (aten.mm.default, (_t(24, 32), _t(32, 48)), 2 * 24 * 32 * 48),
        (aten.addmm.default, (_t(48), _t(24, 32), _t(32, 48)), 2 * 24 * 32 * 48),
        (aten.bmm.default, (_t(3, 5, 7), _t(3, 7, 11)), 2 * 3 * 5 * 7 * 11),
        (aten.baddbmm.default, (_t(3, 5, 11), _t(3, 5, 7), _t(3, 7, 11)), 2 * 3 * 5 * 7 * 11),
        (aten.matmul.default, (_t(2, 3, 5, 7), _t(7, 11)), 2 * 2 * 3 * 5 * 7 * 11),
        (aten.addbmm.default, (_t(5, 11), _t(3, 5, 7), _t(3, 7, 11)), 2 * 3 * 5 * 7 * 11),
    ]
    for target, args, flops in cases:
        work = op_costs(target, args)
        assert (work.family, work.fwd_flops, work.bwd_flops) == ("matmul", flops, 2 * flops), target
        assert work.fwd_bytes == F32 * (sum(a.numel() for a in args) + target(*args).numel()), (
            target
        )
    # Only the bias needs a gradient: no product in backward, but its bytes still move.
    bias_only = op_costs(
        aten.addmm.default, (_t(48), _t(24, 32, grad=False), _t(32, 48, grad=False))
    )
    assert bias_only.bwd_flops == 0 and bias_only.bwd_bytes == 2 * bias_only.fwd_bytes


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_counts_unmasked_pairs_and_backward_is_2_5x(causal: bool) -> None:
    q, k, v = _t(2, 4, 16, 8), _t(2, 4, 16, 8), _t(2, 4, 16, 8)
    work = op_costs(aten.scaled_dot_product_attention.default, (q, k, v), {"is_causal": causal})
    pairs = 16 * 17 // 2 if causal else 16 * 16
    # QK^T and PV: two products of 2 * head_dim FLOPs per (query, key) pair and head.
    assert work.family == "attention"
    assert work.fwd_flops == 2 * 2 * 4 * pairs * (8 + 8)
    # Flash backward: recompute QK^T, then dP, dV, dQ, dK -- five products against two.
    assert work.bwd_flops == 2.5 * work.fwd_flops
    assert work.fwd_bytes == F32 * 4 * q.numel()  # q, k, v in, one output
    no_grad = [t.detach() for t in (q, k, v)]
    assert op_costs(aten.scaled_dot_product_attention.default, no_grad).bwd_flops == 0


def test_sdpa_with_grouped_kv_and_an_explicit_mask() -> None:
    q, kv = _t(2, 4, 16, 8), _t(2, 2, 16, 8)
    gqa = op_costs(aten.scaled_dot_product_attention.default, (q, kv, kv), {"enable_gqa": True})
    assert gqa.fwd_flops == 2 * 2 * 4 * 16 * 16 * 16  # every query head does its own products
    mask = torch.ones(16, 16, dtype=torch.bool).tril()
    masked = op_costs(
        aten.scaled_dot_product_attention.default,
        (q, q, q),
        {"attn_mask": mask, "is_causal": False},
    )
    assert masked.fwd_flops == 2 * 2 * 4 * 16 * 16 * 16  # a mask is not known to skip blocks


def test_norm_softmax_loss_pointwise_reduction_per_element_counts() -> None:
    x = _t(4, 8, 32)
    n = x.numel()
    layer_norm = op_costs(aten.layer_norm.default, (x, [32], _t(32), _t(32)))
    assert (layer_norm.family, layer_norm.fwd_flops, layer_norm.bwd_flops) == (
        "norm",
        5 * n,
        10 * n,
    )
    assert layer_norm.fwd_bytes == F32 * (2 * n + 2 * 32)
    rms_norm = op_costs(aten.rms_norm.default, (x, [32], _t(32)))
    assert (rms_norm.family, rms_norm.fwd_flops, rms_norm.bwd_flops) == ("norm", 5 * n, 10 * n)
    for target, args in ((aten._softmax.default, (x, -1, False)), (aten.softmax.int, (x, -1))):
        softmax = op_costs(target, args)
        assert (softmax.family, softmax.fwd_flops, softmax.bwd_flops) == ("softmax", 5 * n, 5 * n)
        assert softmax.fwd_bytes == F32 * 2 * n and softmax.bwd_bytes == F32 * 4 * n
    logits, targets = _t(32, 128), torch.randint(0, 128, (32,))
    loss = op_costs(aten.cross_entropy_loss.default, (logits, targets))
    assert (loss.family, loss.fwd_flops, loss.bwd_flops) == ("loss", 5 * 32 * 128, 5 * 32 * 128)
    assert loss.fwd_bytes == F32 * (32 * 128 + 1) + I64 * 32
    add = op_costs(aten.add.Tensor, (x, _t(32)))
    assert (add.family, add.fwd_flops, add.bwd_flops) == ("pointwise", n, n)
    assert add.fwd_bytes == F32 * (2 * n + 32) and add.bwd_bytes == 2 * add.fwd_bytes
    gelu = op_costs(aten.gelu.default, (x.detach(),))
    assert (gelu.fwd_flops, gelu.bwd_flops, gelu.bwd_bytes) == (n, 0, 0)  # nothing needs a grad
    # transcendental elementwise ops (and their in-place variants) are calibrated apart
    for target in (aten.gelu.default, aten.silu.default, aten.silu_.default, aten.tanh.default,
                   aten.exp.default, aten.sigmoid.default):  # fmt: skip
        work = op_costs(target, (x.detach().clone(),))
        assert (work.family, work.fwd_flops) == ("activation", n), target
    for target in (aten.mul.Tensor, aten.sub.Tensor, aten.add_.Tensor):
        assert op_costs(target, (x.detach().clone(), x.detach())).family == "pointwise", target
    total = op_costs(aten.sum.dim_IntList, (x, [-1]))
    assert (total.family, total.fwd_flops, total.bwd_flops) == ("reduction", n, n)


def test_embedding_reads_rows_and_views_cost_nothing() -> None:
    table, idx = _t(1000, 64), torch.zeros(4, 8, dtype=torch.long)
    work = op_costs(aten.embedding.default, (table, idx))
    out_bytes = F32 * 4 * 8 * 64
    assert (work.family, work.fwd_flops, work.bwd_flops) == ("embedding", 0, 0)
    assert work.fwd_bytes == I64 * 4 * 8 + 2 * out_bytes
    assert work.bwd_bytes == F32 * 1000 * 64 + 2 * out_bytes  # a dense table gradient
    view = op_costs(aten.view.default, (_t(8, 16), [16, 8]))
    assert (view.family, view.fwd_flops, view.bwd_flops, view.fwd_bytes, view.bwd_bytes) == (
        "view",
        0,
        0,
        0,
        0,
    )


# --------------------------------------------------------------------------------------------
# (b) Against FlopCounterMode, forward and backward, for every op it counts


MATMUL_CASES = {
    "linear": (aten.linear.default, lambda: (_t(4, 6, 32), _t(48, 32), _t(48)), {}),
    "linear_no_input_grad": (
        aten.linear.default,
        lambda: (_t(4, 6, 32, grad=False), _t(48, 32), _t(48)),
        {},
    ),
    "linear_no_bias": (aten.linear.default, lambda: (_t(24, 32), _t(48, 32)), {}),
    "mm": (aten.mm.default, lambda: (_t(24, 32), _t(32, 48)), {}),
    "mm_frozen_rhs": (aten.mm.default, lambda: (_t(24, 32), _t(32, 48, grad=False)), {}),
    "addmm": (aten.addmm.default, lambda: (_t(48), _t(24, 32), _t(32, 48)), {}),
    "bmm": (aten.bmm.default, lambda: (_t(3, 5, 7), _t(3, 7, 11)), {}),
    "baddbmm": (aten.baddbmm.default, lambda: (_t(3, 5, 11), _t(3, 5, 7), _t(3, 7, 11)), {}),
    "matmul_3d_2d": (aten.matmul.default, lambda: (_t(2, 5, 7), _t(7, 11)), {}),
    "matmul_4d_4d": (aten.matmul.default, lambda: (_t(2, 3, 5, 7), _t(2, 3, 7, 11)), {}),
    "conv2d": (aten.conv2d.default, lambda: (_t(2, 3, 10, 10), _t(8, 3, 3, 3), _t(8)), {}),
    "conv2d_frozen_input": (
        aten.conv2d.default,
        lambda: (_t(2, 3, 10, 10, grad=False), _t(8, 3, 3, 3)),
        {},
    ),
    "sdpa": (aten.scaled_dot_product_attention.default, lambda: (_t(2, 4, 16, 8),) * 3, {}),
    "sdpa_gqa": (
        aten.scaled_dot_product_attention.default,
        lambda: (_t(2, 4, 16, 8), _t(2, 2, 16, 8), _t(2, 2, 16, 8)),
        {"enable_gqa": True},
    ),
}


@pytest.mark.parametrize("case", list(MATMUL_CASES))
def test_forward_and_backward_flops_equal_flop_counter_mode(case: str) -> None:
    target, make_args, kwargs = MATMUL_CASES[case]
    args = make_args()
    counted_fwd, counted_bwd = counted_forward_backward(lambda: target(*args, **kwargs))
    work = op_costs(target, args, kwargs)
    assert counted_fwd > 0
    assert (work.fwd_flops, work.bwd_flops) == (counted_fwd, counted_bwd)


@pytest.mark.parametrize(("q_len", "kv_len"), [(16, 16), (8, 16), (16, 4)])
def test_causal_sdpa_is_flop_counter_mode_times_the_unmasked_share(q_len: int, kv_len: int) -> None:
    q, k, v = _t(2, 4, q_len, 8), _t(2, 4, kv_len, 8), _t(2, 4, kv_len, 8)
    target = aten.scaled_dot_product_attention.default
    counted_fwd, counted_bwd = counted_forward_backward(lambda: target(q, k, v, is_causal=True))
    work = op_costs(target, (q, k, v), {"is_causal": True})
    share = attention_pairs(q_len, kv_len, causal=True) / (q_len * kv_len)
    assert work.fwd_flops == pytest.approx(counted_fwd * share, rel=1e-12)
    assert work.bwd_flops == pytest.approx(counted_bwd * share, rel=1e-12)


def test_flop_counter_mode_counts_nothing_for_the_per_element_families() -> None:
    # So for these ops our per-element conventions are the only count (README: cost model).
    x = _t(4, 8, 32)
    for fn in (
        lambda: aten.layer_norm.default(x, [32], None, None),
        lambda: aten.softmax.int(x, -1),
        lambda: aten.gelu.default(x),
        lambda: aten.cross_entropy_loss.default(x.view(32, 32), torch.zeros(32, dtype=torch.long)),
    ):
        assert counted_forward_backward(fn) == (0, 0)


# --------------------------------------------------------------------------------------------
# (c) Ops that return their input cost nothing (issue 15, session 9)


def test_ops_that_return_their_input_cost_nothing_and_real_copies_do() -> None:
    x = _t(8, 16)
    same = op_costs(aten.to.dtype, (x, torch.float32))
    assert same.same_dtype_cast and same.fwd_bytes > 0  # free in fp32; the bytes of a real cast
    assert op_costs(aten.type_as.default, (x, _t(2, 2))).same_dtype_cast
    cast = op_costs(aten.to.dtype, (x, torch.bfloat16))
    assert not cast.same_dtype_cast and cast.fwd_bytes == F32 * 128 + 2 * 128
    assert not op_costs(aten.to.dtype, (x, torch.float32), {"copy": True}).same_dtype_cast
    for target, args in (
        (aten.dropout.default, (x, 0.0, True)),
        (aten.dropout.default, (x, 0.5, False)),
        (aten.contiguous.default, (x,)),
    ):
        work = op_costs(target, args)
        assert (work.family, work.fwd_flops, work.bwd_flops, work.fwd_bytes, work.bwd_bytes) == (
            "view", 0.0, 0.0, 0, 0,
        ), target  # fmt: skip
    for target, args in (
        (aten.dropout.default, (x, 0.1, True)),
        (aten.clone.default, (x,)),
        (aten._to_copy.default, (x,)),
    ):
        work = op_costs(target, args)
        assert work.family == "pointwise" and work.fwd_bytes > 0 and not work.same_dtype_cast, (
            target
        )


def test_contiguous_of_a_transposed_tensor_is_a_real_copy() -> None:
    # op_costs makes its inputs contiguous meta tensors; a graph keeps the strides.
    graph = torch.fx.Graph()
    source = graph.placeholder("x")
    source.meta["val"] = torch.empty(8, 16, device="meta").t()
    node = graph.call_function(aten.contiguous.default, (source,))
    node.meta["val"] = torch.empty(16, 8, device="meta")
    assert returns_input(node) is None
    assert node_costs(node).fwd_bytes == 2 * F32 * 128
    source.meta["val"] = torch.empty(16, 8, device="meta")
    del source.meta["autopar_requires_grad"], node.meta["autopar_requires_grad"]
    assert returns_input(node) == "alias" and node_costs(node).fwd_bytes == 0
