"""Work per graph node: FLOPs and bytes of forward and backward, on GLOBAL shapes.

Nothing real runs. Matmuls and attention use closed forms from the shapes (attention through
``torch.utils.flop_counter.sdpa_flop_count``, times the causal fraction); other ops that
``FlopCounterMode`` knows (convolutions, ...) run once on meta tensors under it; everything else
is priced per element by family. Backward work is a per-family multiple of forward work:

* matmul: 1x forward per floating matrix operand that needs a gradient (dX = dY W^T, dW = X^T dY);
* attention: 2.5x forward (FlashAttention's backward recomputes the scores: ~5 matmuls vs 2);
* everything else: 1x forward.

Bytes are input plus output bytes in forward (views and tuple indexing move nothing) and about
twice that in backward (read the saved inputs and the output gradient, write input gradients);
an embedding lookup reads only the selected rows, and its backward writes a dense table gradient.
A node with no input needing a gradient has no backward work at all.

Results are cached by (op, argument shapes/dtypes/requires-grad, constants, output shapes):
the layers of a transformer repeat, so a 5,000-node graph prices a few dozen distinct calls.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_flop_count

FAMILIES = (
    "matmul",
    "attention",
    "pointwise",
    "norm",
    "softmax",
    "reduction",
    "embedding",
    "view",
    "loss",
    "other",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeWork:
    """FLOPs and memory traffic of one node, forward and backward, on global shapes."""

    fwd_flops: float
    """Floating-point operations of the forward op."""
    bwd_flops: float
    """Floating-point operations of its backward (0 when no input needs a gradient)."""
    fwd_bytes: int
    """Bytes read and written by the forward op (0 for views)."""
    bwd_bytes: int
    """Bytes read and written by its backward."""
    family: str
    """One of FAMILIES: how the op scales and which roofline applies."""


@dataclass(frozen=True, slots=True)
class _TensorSig:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def num_bytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


# --------------------------------------------------------------------------------------------
# Families (by op packet name; pointwise also by torch.Tag.pointwise)

_VIEW = frozenset(
    """view _unsafe_view reshape transpose t permute expand expand_as squeeze unsqueeze slice
    select split split_with_sizes chunk unbind alias detach as_strided unflatten flatten view_as
    narrow diagonal movedim swapaxes unfold lift_fresh _reshape_alias view_as_real
    view_as_complex broadcast_tensors tensor_split real imag""".split()
)
_MATMUL = frozenset(
    """linear mm addmm bmm baddbmm matmul mv addmv dot einsum _scaled_mm addbmm vdot inner
    outer tensordot""".split()
)
_ATTENTION = frozenset(
    """scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu
    _scaled_dot_product_flash_attention _scaled_dot_product_efficient_attention
    _scaled_dot_product_cudnn_attention _scaled_dot_product_attention_math
    _scaled_dot_product_fused_attention_overrideable""".split()
)
_NORM = frozenset(
    """layer_norm native_layer_norm rms_norm _fused_rms_norm group_norm native_group_norm
    batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_no_training
    _native_batch_norm_legit_functional instance_norm""".split()
)
_SOFTMAX = frozenset("softmax _softmax log_softmax _log_softmax _safe_softmax".split())
_REDUCTION = frozenset(
    """sum mean amax amin max min var std var_mean std_mean norm linalg_vector_norm cumsum
    cumprod any all argmax argmin prod logsumexp""".split()
)
_EMBEDDING = frozenset("embedding embedding_bag _embedding_bag".split())
_LOSS = frozenset(
    """cross_entropy_loss nll_loss nll_loss_forward nll_loss2d_forward nll_loss_nd mse_loss
    l1_loss smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits
    kl_div""".split()
)
# Copies and casts move every element once; priced like pointwise ops.
_COPY = frozenset(
    """clone contiguous to _to_copy type_as dropout native_dropout copy masked_fill where tril
    triu""".split()
)

# FLOPs per element (of the largest tensor) for the per-element families.
_FLOPS_PER_ELEMENT = {"pointwise": 1.0, "norm": 5.0, "softmax": 5.0, "reduction": 1.0, "loss": 5.0}
_ATTENTION_BWD_FACTOR = 2.5


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def op_family(target: Any) -> str:
    """The family of an op target (an OpOverload or a Python callable such as operator.getitem)."""
    if target is operator.getitem:
        return "view"
    name = _op_name(target)
    for family, names in (
        ("view", _VIEW),
        ("matmul", _MATMUL),
        ("attention", _ATTENTION),
        ("norm", _NORM),
        ("softmax", _SOFTMAX),
        ("reduction", _REDUCTION),
        ("embedding", _EMBEDDING),
        ("loss", _LOSS),
    ):
        if name in names:
            return family
    if name in _COPY:
        return "pointwise"
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return "pointwise"
    return "other"


# --------------------------------------------------------------------------------------------
# Public entry point


def node_costs(node: fx.Node) -> NodeWork:
    """Forward/backward FLOPs and bytes of one node on its global shapes (from meta["val"]).

    Non-call_function nodes (placeholders, outputs) do no work. Whether an input needs a
    gradient is derived from the graph: parameter placeholders' values have requires_grad set,
    and it propagates through floating-point ops.
    """
    if node.op != "call_function":
        return NodeWork(fwd_flops=0.0, bwd_flops=0.0, fwd_bytes=0, bwd_bytes=0, family="other")
    requires_grad = _requires_grad_map(node)

    def sig(value: Any) -> Any:
        if isinstance(value, fx.Node):
            val = value.meta.get("val")
            if isinstance(val, torch.Tensor):
                return _TensorSig(
                    tuple(int(s) for s in val.shape), val.dtype, requires_grad.get(value, False)
                )
            if isinstance(val, (list, tuple)):
                return tuple(
                    _TensorSig(
                        tuple(int(s) for s in v.shape), v.dtype, requires_grad.get(value, False)
                    )
                    if isinstance(v, torch.Tensor)
                    else None
                    for v in val
                )
            return ("scalar", type(val).__name__)
        if isinstance(value, (list, tuple)):
            return tuple(sig(v) for v in value)
        if isinstance(value, (torch.device,)):
            return "device"
        return value

    args = tuple(sig(a) for a in node.args)
    kwargs = tuple(sorted((k, sig(v)) for k, v in node.kwargs.items()))
    outputs = _output_sigs(node.meta.get("val"))
    try:
        return _work(node.target, args, kwargs, outputs)
    except TypeError:  # an unhashable constant argument: price without the cache
        return _work.__wrapped__(node.target, args, kwargs, outputs)


def _output_sigs(val: Any) -> tuple[_TensorSig, ...]:
    leaves, _ = tree_flatten(val)
    return tuple(
        _TensorSig(tuple(int(s) for s in leaf.shape), leaf.dtype, False)
        for leaf in leaves
        if isinstance(leaf, torch.Tensor)
    )


def _requires_grad_map(node: fx.Node) -> dict[fx.Node, bool]:
    """Whether each input of ``node`` needs a gradient (float and downstream of a parameter).

    The flags live in ``node.meta["autopar_requires_grad"]``, written for the whole graph in
    one topological walk the first time a node (or a newly added one) lacks them.
    """
    key = "autopar_requires_grad"
    inputs = node.all_input_nodes
    if any(key not in n.meta for n in (node, *inputs)):
        for n in node.graph.nodes:
            leaves, _ = tree_flatten(n.meta.get("val"))
            tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
            is_float = any(v.dtype.is_floating_point or v.dtype.is_complex for v in tensors)
            if n.op == "placeholder":
                flag = is_float and any(v.requires_grad for v in tensors)
            else:
                flag = is_float and any(i.meta.get(key, False) for i in n.all_input_nodes)
            n.meta[key] = flag
    return {n: n.meta[key] for n in inputs}


# --------------------------------------------------------------------------------------------
# Pricing (cached on signatures)


def _tensors(tree: Any) -> list[_TensorSig]:
    leaves, _ = tree_flatten(tree, is_leaf=lambda x: isinstance(x, _TensorSig))
    return [leaf for leaf in leaves if isinstance(leaf, _TensorSig)]


def _bind(
    target: Any, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]
) -> dict[str, Any]:
    """Argument name -> value, by the op's schema (positional and keyword alike)."""
    bound = dict(kwargs)
    schema = getattr(target, "_schema", None)
    if schema is not None:
        for argument, value in zip(schema.arguments, args):
            bound[argument.name] = value
        for argument in schema.arguments:
            if argument.name not in bound and argument.has_default_value():
                bound[argument.name] = argument.default_value
    return bound


@functools.lru_cache(maxsize=4096)
def _work(
    target: Any,
    args: tuple[Any, ...],
    kwargs: tuple[tuple[str, Any], ...],
    outputs: tuple[_TensorSig, ...],
) -> NodeWork:
    family = op_family(target)
    inputs = _tensors((args, kwargs))
    needs_grad = any(t.requires_grad and t.is_float for t in inputs)
    if family == "view":
        return NodeWork(fwd_flops=0.0, bwd_flops=0.0, fwd_bytes=0, bwd_bytes=0, family=family)
    fwd_bytes = sum(t.num_bytes for t in inputs) + sum(t.num_bytes for t in outputs)
    bwd_bytes = 2 * fwd_bytes
    if family == "embedding" and inputs:
        # A lookup reads the selected rows, not the table; its backward writes a dense table
        # gradient (PyTorch's default) and reads the output gradient.
        out_bytes = sum(t.num_bytes for t in outputs)
        fwd_bytes = sum(t.num_bytes for t in inputs if not t.is_float) + 2 * out_bytes
        bwd_bytes = sum(t.num_bytes for t in inputs if t.is_float) + 2 * out_bytes
    bwd_factor = 1.0
    if family == "matmul":
        fwd_flops, operands = _matmul_flops(target, args, kwargs, outputs)
        bwd_factor = float(sum(1 for t in operands if t.requires_grad and t.is_float))
    elif family == "attention":
        fwd_flops = _attention_flops(target, args, kwargs)
        bwd_factor = _ATTENTION_BWD_FACTOR
    elif family in _FLOPS_PER_ELEMENT:
        largest = max((t.numel for t in (*inputs, *outputs) if t.is_float), default=0)
        fwd_flops = _FLOPS_PER_ELEMENT[family] * largest
    elif isinstance(target, torch._ops.OpOverload) and target.overloadpacket in flop_registry:
        fwd_flops = _counted_flops(target, args, kwargs)
    else:  # embedding lookups, concatenation, padding, factories: data movement only
        fwd_flops = 0.0
    if not needs_grad:
        return NodeWork(
            fwd_flops=fwd_flops, bwd_flops=0.0, fwd_bytes=fwd_bytes, bwd_bytes=0, family=family
        )
    return NodeWork(
        fwd_flops=fwd_flops,
        bwd_flops=bwd_factor * fwd_flops,
        fwd_bytes=fwd_bytes,
        bwd_bytes=bwd_bytes,
        family=family,
    )


def _matmul_flops(
    target: Any,
    args: tuple[Any, ...],
    kwargs: tuple[tuple[str, Any], ...],
    outputs: tuple[_TensorSig, ...],
) -> tuple[float, list[_TensorSig]]:
    """Forward FLOPs (2 per multiply-add) and the two matrix operands."""
    name = _op_name(target)
    bound = _bind(target, args, kwargs)
    if name == "linear":
        x, weight = bound["input"], bound["weight"]
        out_features, in_features = (
            (weight.shape[0], weight.shape[-1]) if len(weight.shape) == 2 else (1, weight.shape[0])
        )
        rows = x.numel // max(in_features, 1)
        return 2.0 * rows * in_features * out_features, [x, weight]
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "addbmm"):
        a = bound.get("mat1", bound.get("batch1", bound.get("self")))
        b = bound.get("mat2", bound.get("batch2", bound.get("other")))
        contracted = a.shape[-1] if a.shape else 1
        if name == "addbmm":
            out = a.numel // max(a.shape[-1], 1) * b.shape[-1]
            return 2.0 * out * contracted, [a, b]
        out_numel = outputs[0].numel if outputs else 0
        return 2.0 * out_numel * contracted, [a, b]
    operands = [t for t in _tensors((args, kwargs)) if t.is_float]
    return _counted_flops(target, args, kwargs), operands[:2]


def _attention_flops(
    target: Any, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]
) -> float:
    bound = _bind(target, args, kwargs)
    query, key, value = bound["query"], bound["key"], bound["value"]
    # Fold leading dims into (batch, heads); grouped-query K/V count as if repeated per query head.
    *lead, q_len, head_dim = query.shape
    k_len, v_dim = key.shape[-2], value.shape[-1]
    batch = 1
    for size in lead[:-1]:
        batch *= size
    heads = lead[-1] if lead else 1
    flops = float(
        sdpa_flop_count(
            (batch, heads, q_len, head_dim),
            (batch, heads, k_len, head_dim),
            (batch, heads, k_len, v_dim),
        )
    )
    if bound.get("is_causal") and bound.get("attn_mask", bound.get("attn_bias")) is None:
        flops *= causal_fraction(q_len, k_len)
    return flops


def causal_fraction(q_len: int, k_len: int) -> float:
    """Share of (query, key) pairs a causal mask keeps (PyTorch's top-left aligned tril)."""
    if q_len == 0 or k_len == 0:
        return 0.0
    # Row i keeps min(i + 1, k_len) keys.
    full_rows = max(q_len - k_len, 0)
    ramp = min(q_len, k_len)
    kept = ramp * (ramp + 1) // 2 + full_rows * k_len
    return kept / (q_len * k_len)


def _counted_flops(
    target: Any, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]
) -> float:
    """Run the op once on meta tensors under FlopCounterMode (for ops without a closed form)."""

    def materialize(value: Any) -> Any:
        if isinstance(value, _TensorSig):
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        if value == "device":
            return torch.device("meta")
        return value

    meta_args = tree_map(materialize, args, is_leaf=lambda x: isinstance(x, _TensorSig))
    meta_kwargs = {
        k: tree_map(materialize, v, is_leaf=lambda x: isinstance(x, _TensorSig)) for k, v in kwargs
    }
    counter = FlopCounterMode(display=False)
    try:
        with counter:
            target(*meta_args, **meta_kwargs)
    except Exception:  # an op that cannot run on meta: no FLOPs known, bytes still counted
        return 0.0
    return float(counter.get_total_flops())
