"""Graph rewrites that keep values and open up sharding: ``fn(gm) -> gm`` passes.

``exact_means``: a mean over a batch-sharded dim is not a Partial("sum") of local means (each
rank divides by its own count). Written as ``sum / count`` instead, with the count a constant
(static shapes) or a tensor computed from the targets (ignore_index), the sum becomes Partial
over the sharded dim and the division keeps it Partial, so the loss of a data-parallel plan
needs one scalar all-reduce instead of gathering the logits. Values are those of the original
graph up to floating-point rounding (PyTorch's mean is a sum divided by the count as well).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

aten = torch.ops.aten

MEAN_REDUCTION = 1
SUM_REDUCTION = 2


def _fake_value(node: fx.Node) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _insert(
    graph: fx.Graph, like: fx.Node, target: Any, args: tuple, kwargs: dict | None = None
) -> fx.Node:
    """Insert ``target(*args)`` before ``like`` with its FakeTensor value and provenance."""
    kwargs = kwargs or {}
    with graph.inserting_before(like):
        node = graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = tree_map(_fake_value, (args, kwargs))
    fake_mode = like.meta["val"].fake_mode if hasattr(like.meta["val"], "fake_mode") else None
    if fake_mode is not None:
        with fake_mode:
            node.meta["val"] = target(*fake_args, **fake_kwargs)
    else:
        node.meta["val"] = target(*fake_args, **fake_kwargs)
    for key in ("nn_module_stack", "stack_trace", "autopar_module_path", "source_fn_stack"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    return node


def _divide(graph: fx.Graph, node: fx.Node, total: fx.Node, count: Any) -> None:
    """Replace ``node`` by ``total / count`` (count an int or a tensor node)."""
    target = aten.div.Tensor if isinstance(count, fx.Node) else aten.div.Scalar
    out = _insert(graph, node, target, (total, count))
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _mean_dim(graph: fx.Graph, node: fx.Node) -> bool:
    x = node.args[0]
    shape = tuple(x.meta["val"].shape)
    if node.target is aten.mean.default:
        dims = list(range(len(shape)))
        keepdim = False
    else:
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if dims is None or len(dims) == 0:
            dims = list(range(len(shape)))
    if "dtype" in node.kwargs and node.kwargs["dtype"] is not None:
        return False
    if not x.meta["val"].dtype.is_floating_point:
        return False
    count = math.prod(shape[d % len(shape)] for d in dims) if shape else 1
    total = _insert(graph, node, aten.sum.dim_IntList, (x, list(dims), keepdim))
    _divide(graph, node, total, count)
    return True


def _arg(node: fx.Node, index: int, name: str, default: Any) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _mse_loss(graph: fx.Graph, node: fx.Node) -> bool:
    if _arg(node, 2, "reduction", MEAN_REDUCTION) != MEAN_REDUCTION:
        return False
    x, y = node.args[0], node.args[1]
    shape = torch.broadcast_shapes(tuple(x.meta["val"].shape), tuple(y.meta["val"].shape))
    total = _insert(graph, node, aten.mse_loss.default, (x, y, SUM_REDUCTION))
    _divide(graph, node, total, math.prod(shape))
    return True


def _cross_entropy(graph: fx.Graph, node: fx.Node) -> bool:
    logits, target = node.args[0], node.args[1]
    weight = _arg(node, 2, "weight", None)
    reduction = _arg(node, 3, "reduction", MEAN_REDUCTION)
    ignore_index = _arg(node, 4, "ignore_index", -100)
    smoothing = _arg(node, 5, "label_smoothing", 0.0)
    if reduction != MEAN_REDUCTION or weight is not None or smoothing != 0.0:
        return False
    if target.meta["val"].dtype.is_floating_point:  # class probabilities: mean over samples
        shape = tuple(target.meta["val"].shape)
        count: Any = math.prod(shape) // shape[1] if len(shape) > 1 else 1
    else:
        kept = _insert(graph, node, aten.ne.Scalar, (target, ignore_index))
        count = _insert(graph, node, aten.sum.default, (kept,))
    total = _insert(
        graph,
        node,
        aten.cross_entropy_loss.default,
        (logits, target, None, SUM_REDUCTION, ignore_index, 0.0),
    )
    _divide(graph, node, total, count)
    return True


_PASSES: dict[Any, Callable[[fx.Graph, fx.Node], bool]] = {
    aten.mean.default: _mean_dim,
    aten.mean.dim: _mean_dim,
    aten.mse_loss.default: _mse_loss,
    aten.cross_entropy_loss.default: _cross_entropy,
}


def exact_means(gm: fx.GraphModule, *, recompile: bool = True) -> fx.GraphModule:
    """Rewrite mean reductions and mean-reduced losses as sum / count (see module docstring);
    ``recompile=False`` leaves the code generation to a caller that changes the graph again."""
    changed = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _PASSES:
            changed |= _PASSES[node.target](gm.graph, node)
    if changed and recompile:
        gm.graph.lint()
        gm.recompile()
    return gm
