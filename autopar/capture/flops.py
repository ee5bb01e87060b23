"""Work per graph node: FLOPs and bytes of forward and backward, on GLOBAL shapes.

Nothing real runs. This module maps fx nodes onto the formulas of ``cost_models.compute``, the
one definition of each (``matmul_flops``, ``attention_flops``, ``elementwise_flops``,
``backward_flops_factor``, ``op_bytes``); ops without a closed form that ``FlopCounterMode``
knows (``mv``, ``einsum``, ...) run once on meta tensors under it. The conventions (2 FLOPs per
multiply-add, causal attention counts its unmasked pairs, attention backward 2.5x, norm
backward 2x, ...) are documented on those functions and in README.md ("The cost model").

A node with no input needing a gradient has no backward work at all. An op that returns its
input tensor itself (``returns_input``: ``dropout`` with p = 0 or in eval, ``contiguous`` of a
contiguous tensor) does no work and is priced like a view; a cast to the tensor's own dtype
(``to``, ``type_as``) is flagged ``same_dtype_cast``: free in the captured precision, a real cast
under mixed precision, where the planner prices it as one.

Results are cached by (op, argument shapes/dtypes/requires-grad, constants, output shapes):
the layers of a transformer repeat, so a 5,000-node graph prices a few dozen distinct calls.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from cost_models.compute import (
    attention_flops,
    backward_flops_factor,
    elementwise_flops,
    matmul_flops,
    op_bytes,
)

FAMILIES = (
    "matmul",
    "attention",
    "convolution",
    "pointwise",
    "activation",
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
    same_dtype_cast: bool = False
    """A ``to`` / ``type_as`` to the tensor's own captured dtype: it returns its input (no work)
    when the graph runs in that dtype; the FLOPs and bytes above are those of a real cast, what
    it costs under mixed precision (autocast changes the input's dtype)."""

    def cast_is_free(self, mixed_precision: str | None) -> bool:
        """Whether this op is a same-dtype cast that returns its input when the graph runs in its
        captured dtype (``mixed_precision`` None); under autocast it may be a real cast."""
        return self.same_dtype_cast and mixed_precision is None


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
_CONVOLUTION = frozenset(
    """convolution _convolution conv1d conv2d conv3d conv_transpose1d conv_transpose2d
    conv_transpose3d""".split()
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
# Elementwise ops whose every element takes a transcendental function (erf, exp, tanh, log,
# sin): on a CPU 2-4x the time per byte of an add or a multiply, so calibration fits them apart
# (autopar.tools.calibration.family_cases). Their gradients and in-place variants too.
_ACTIVATION = frozenset(
    """gelu silu sigmoid tanh erf erfc erfinv exp exp2 expm1 log log1p log2 log10 softplus
    mish elu selu celu log_sigmoid logit sin cos tan asin acos atan sinh cosh asinh acosh atanh
    gelu_backward silu_backward sigmoid_backward tanh_backward softplus_backward mish_backward
    elu_backward log_sigmoid_forward log_sigmoid_backward logit_backward""".split()
)
# Copies and casts move every element once; priced like pointwise ops.
_COPY = frozenset(
    """clone contiguous to _to_copy type_as dropout native_dropout copy masked_fill where tril
    triu""".split()
)


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
        ("convolution", _CONVOLUTION),
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
    if (name[:-1] if name.endswith("_") and not name.endswith("__") else name) in _ACTIVATION:
        return "activation"  # an in-place variant (silu_) as its op
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
    kind = returns_input(node)
    if kind == "alias":
        return NodeWork(fwd_flops=0.0, bwd_flops=0.0, fwd_bytes=0, bwd_bytes=0, family="view")
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
        work = _work(node.target, args, kwargs, outputs)
    except TypeError:  # an unhashable constant argument: price without the cache
        work = _work.__wrapped__(node.target, args, kwargs, outputs)
    return dataclasses.replace(work, same_dtype_cast=True) if kind == "cast" else work


def returns_input(node: fx.Node) -> str | None:
    """Whether ``node``'s op returns its input tensor itself instead of computing a new one.

    Returns:
        "alias": always (``dropout`` with p = 0 or ``train=False``, whose CPU and GPU kernels both
        return the input; ``contiguous`` of a tensor already contiguous in the requested format);
        "cast": ``to.dtype`` / ``type_as`` to the input's own captured dtype (no copy requested),
        free in that dtype but a real cast under autocast; None: the op does work. ``clone`` and
        ``_to_copy`` always copy (the lowering keeps them).
    """
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or not node.args:
        return None
    source = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(source, torch.Tensor):
        return None
    bound = _bind(target, tuple(node.args), tuple(node.kwargs.items()))
    aten = torch.ops.aten
    if target is aten.dropout.default:
        p, train = bound.get("p"), bound.get("train")
        return "alias" if p == 0 or train is False else None
    if target is aten.contiguous.default:
        memory_format = bound.get("memory_format") or torch.contiguous_format
        return "alias" if source.is_contiguous(memory_format=memory_format) else None
    output = node.meta.get("val")
    if not isinstance(output, torch.Tensor) or output.dtype != source.dtype:
        return None
    if target is aten.type_as.default:
        return "cast"
    if target is aten.to.dtype and not bound.get("copy"):
        memory_format = bound.get("memory_format")
        if memory_format in (None, torch.preserve_format) or source.is_contiguous(
            memory_format=memory_format
        ):
            return "cast"
    return None


def op_costs(target: Any, args: Any, kwargs: dict[str, Any] | None = None) -> NodeWork:
    """``node_costs`` of one call ``target(*args, **kwargs)``, as the planner prices it in a graph.

    Tensor arguments (real, fake or meta) are replaced by meta placeholders keeping their shape,
    dtype and ``requires_grad``; other arguments are constants. Used by calibration and tests.
    """
    kwargs = kwargs or {}
    graph = fx.Graph()
    placeholders: list[torch.Tensor] = []

    def to_node(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        meta = torch.empty(value.shape, dtype=value.dtype, device="meta")
        meta.requires_grad_(value.requires_grad)
        node = graph.placeholder(f"x{len(placeholders)}")
        node.meta["val"] = meta
        placeholders.append(meta)
        return node

    node_args = tree_map(to_node, tuple(args))
    node_kwargs = tree_map(to_node, dict(kwargs))
    node = graph.call_function(target, node_args, node_kwargs)

    def to_meta(value: Any) -> Any:
        return value.meta["val"] if isinstance(value, fx.Node) else value

    with torch.no_grad():
        node.meta["val"] = target(*tree_map(to_meta, node_args), **tree_map(to_meta, node_kwargs))
    return node_costs(node)


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
    fwd_bytes, bwd_bytes = op_bytes(
        family,
        float_input_bytes=sum(t.num_bytes for t in inputs if t.is_float),
        other_input_bytes=sum(t.num_bytes for t in inputs if not t.is_float),
        output_bytes=sum(t.num_bytes for t in outputs),
    )
    # Inputs whose gradient costs a product of the forward's size (matmul, convolution); for
    # the other families any input needing a gradient gives the family's whole backward.
    grad_operands = [t for t in inputs if t.requires_grad and t.is_float]
    if family == "view":
        fwd_flops = 0.0
    elif family == "matmul":
        fwd_flops, operands = _matmul_flops(target, args, kwargs, outputs)
        grad_operands = [t for t in operands if t.requires_grad and t.is_float]
    elif family == "attention":
        fwd_flops = _attention_flops(target, args, kwargs)
    elif family == "convolution":
        fwd_flops = _counted_flops(target, args, kwargs)
        bound = _bind(target, args, kwargs)
        operands = [bound.get("input"), bound.get("weight")]
        grad_operands = [t for t in operands if isinstance(t, _TensorSig) and t.requires_grad]
    elif family == "other" and getattr(target, "overloadpacket", None) in flop_registry:
        fwd_flops = _counted_flops(target, args, kwargs)
    else:
        largest = max((t.numel for t in (*inputs, *outputs) if t.is_float), default=0)
        fwd_flops = elementwise_flops(family, largest)
    if not needs_grad:
        return NodeWork(
            fwd_flops=fwd_flops, bwd_flops=0.0, fwd_bytes=int(fwd_bytes), bwd_bytes=0, family=family
        )
    factor = backward_flops_factor(family, len(grad_operands))
    return NodeWork(
        fwd_flops=fwd_flops,
        bwd_flops=factor * fwd_flops,
        fwd_bytes=int(fwd_bytes),
        bwd_bytes=int(bwd_bytes),
        family=family,
    )


def _matmul_flops(
    target: Any,
    args: tuple[Any, ...],
    kwargs: tuple[tuple[str, Any], ...],
    outputs: tuple[_TensorSig, ...],
) -> tuple[float, list[_TensorSig]]:
    """Forward FLOPs and the two matrix operands (a bias is not one: its gradient is a sum)."""
    name = _op_name(target)
    bound = _bind(target, args, kwargs)
    if name == "linear":
        x, weight = bound["input"], bound["weight"]
        out_features, in_features = (
            (weight.shape[0], weight.shape[-1]) if len(weight.shape) == 2 else (1, weight.shape[0])
        )
        rows = x.numel // max(in_features, 1)
        return matmul_flops(rows, out_features, in_features), [x, weight]
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul", "addbmm"):
        a = bound.get("mat1", bound.get("batch1", bound.get("self")))
        b = bound.get("mat2", bound.get("batch2", bound.get("other")))
        contracted = a.shape[-1] if a.shape else 1
        if name == "addbmm":  # sum over the batch of (n x k) @ (k x m): out is (n x m)
            rows = a.numel // max(contracted, 1)
            return matmul_flops(rows, b.shape[-1], contracted), [a, b]
        # Every output element is one dot product of length ``contracted``.
        out_numel = outputs[0].numel if outputs else 0
        return matmul_flops(out_numel, 1, contracted), [a, b]
    operands = [t for t in _tensors((args, kwargs)) if t.is_float]
    return _counted_flops(target, args, kwargs), operands[:2]


def _attention_flops(
    target: Any, args: tuple[Any, ...], kwargs: tuple[tuple[str, Any], ...]
) -> float:
    bound = _bind(target, args, kwargs)
    query, key, value = bound["query"], bound["key"], bound["value"]
    # Fold leading dims into (batch, heads); grouped-query K/V count as if repeated per query head.
    *lead, q_len, head_dim = query.shape
    batch = 1
    for size in lead[:-1]:
        batch *= size
    # An explicit mask may be anything: the kernel computes every pair.
    causal = bool(bound.get("is_causal")) and bound.get("attn_mask", bound.get("attn_bias")) is None
    return attention_flops(
        batch,
        lead[-1] if lead else 1,
        q_len,
        key.shape[-2],
        head_dim,
        v_head_dim=value.shape[-1],
        causal=causal,
    )


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
