"""Reductions over dims (sum, mean, amax, max.dim, var, ...) and scans along one dim (cumsum, diff).

On one mesh axis a reduction may shard any dim it keeps (the output is sharded on that dim's new
position), and:

* ``sum`` (and ``nansum``) may shard a reduced dim: every rank sums its slice, output
  ``Partial("sum")``; a Partial input stays Partial (sum is linear).
* ``mean`` of a Partial input is Partial (mean is linear). A *sharded reduced dim* is **not**
  generated for ``mean``: each rank's local mean divides by its local count, so the ranks' values
  sum to N times the mean (DTensor models this as ``Partial("avg")``, which is not in autopar's
  vocabulary; the planner gets the same layout as ``sum`` followed by a scalar ``div``, where the
  graph has them).
* ``amax``/``amin``/``max``/``min``/``var``/``std``/``prod``/``argmax`` never shard a reduced dim
  and never take Partial (``Partial("max")`` is not in the vocabulary; the others are nonlinear).

Scans (``cumsum``, ``diff``) shard any dim except the scanned one; ``cumsum`` passes Partial.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.placement import PARTIAL, REPLICATE, Placement, Shard
from autopar.strategies.registry import AxisStrategy, OpCall, TensorMeta, register

aten = torch.ops.aten


def normalize_dims(dims: object, ndim: int) -> list[int]:
    """Reduced dims as sorted non-negative ints; None or [] means every dim."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % ndim if ndim else 0 for d in dims})  # type: ignore[union-attr]


def reduction_strategies(
    call: OpCall, dims: Sequence[int], keepdim: bool, *, linear: bool, shard_reduced: bool
) -> list[AxisStrategy]:
    """Strategies of a reduction of input 0 over ``dims`` (other tensor inputs are Replicate)."""
    x = call.inputs[0]
    num_outputs = len(call.outputs)
    rest = tuple(REPLICATE if isinstance(m, TensorMeta) else None for m in call.inputs[1:])

    def strategy(in_p: Placement, out_p: Placement) -> AxisStrategy:
        return AxisStrategy(outputs=(out_p,) * num_outputs, inputs=(in_p, *rest))

    strategies = [strategy(REPLICATE, REPLICATE)]
    for d in range(x.ndim):
        if d not in dims:
            out_dim = d if keepdim else d - sum(1 for r in dims if r < d)
            strategies.append(strategy(Shard(d), Shard(out_dim)))
        elif shard_reduced:
            strategies.append(strategy(Shard(d), PARTIAL))
    if linear and x.is_float:
        strategies.append(strategy(PARTIAL, PARTIAL))
    return strategies


def _arg(call: OpCall, index: int, name: str, default: object) -> object:
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


@register(aten.sum.default)
def sum_all_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    return reduction_strategies(call, list(range(x.ndim)), False, linear=True, shard_reduced=True)


@register(aten.sum.dim_IntList, aten.nansum.default)
def sum_dim_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    dims = normalize_dims(_arg(call, 1, "dim", None), x.ndim)
    keepdim = bool(_arg(call, 2, "keepdim", False))
    return reduction_strategies(call, dims, keepdim, linear=True, shard_reduced=True)


@register(aten.mean.default)
def mean_all_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    return reduction_strategies(call, list(range(x.ndim)), False, linear=True, shard_reduced=False)


@register(aten.mean.dim)
def mean_dim_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    dims = normalize_dims(_arg(call, 1, "dim", None), x.ndim)
    keepdim = bool(_arg(call, 2, "keepdim", False))
    return reduction_strategies(call, dims, keepdim, linear=True, shard_reduced=False)


@register(aten.amax.default, aten.amin.default, aten.logsumexp.default)
def amax_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    dims = normalize_dims(_arg(call, 1, "dim", None), x.ndim)
    keepdim = bool(_arg(call, 2, "keepdim", False))
    return reduction_strategies(call, dims, keepdim, linear=False, shard_reduced=False)


@register(aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.prod.dim_int)
def max_dim_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    dim = _arg(call, 1, "dim", None)
    dims = normalize_dims(dim, x.ndim)
    keepdim = bool(_arg(call, 2, "keepdim", False))
    return reduction_strategies(call, dims, keepdim, linear=False, shard_reduced=False)


@register(aten.max.default, aten.min.default, aten.prod.default)
def full_reduction_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    return reduction_strategies(call, list(range(x.ndim)), False, linear=False, shard_reduced=False)


@register(
    aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction
)
def var_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    dims = normalize_dims(_arg(call, 1, "dim", None), x.ndim)
    keepdim = bool(call.kwargs.get("keepdim", False))
    return reduction_strategies(call, dims, keepdim, linear=False, shard_reduced=False)


@register(aten.var.dim, aten.std.dim)
def var_dim_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    dims = normalize_dims(_arg(call, 1, "dim", None), x.ndim)
    keepdim = bool(_arg(call, 3, "keepdim", False))
    return reduction_strategies(call, dims, keepdim, linear=False, shard_reduced=False)


# --------------------------------------------------------------------------------------------
# Scans along one dim


@register(
    aten.cumsum.default,
    aten.cumprod.default,
    aten.cummax.default,
    aten.cummin.default,
    aten.logcumsumexp.default,
)
def scan_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    dim = int(_arg(call, 1, "dim", 0)) % max(x.ndim, 1)
    num_outputs = len(call.outputs)
    strategies = [AxisStrategy(outputs=(REPLICATE,) * num_outputs, inputs=(REPLICATE,))]
    for d in range(x.ndim):
        if d != dim:
            strategies.append(AxisStrategy(outputs=(Shard(d),) * num_outputs, inputs=(Shard(d),)))
    if call.op is aten.cumsum.default and x.is_float:
        strategies.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,)))
    return strategies


@register(aten.diff.default)
def diff_rule(call: OpCall) -> list[AxisStrategy]:
    # diff(x, n, dim, prepend, append): prepend/append have x's dims except along ``dim``.
    x = call.inputs[0]
    dim = int(_arg(call, 2, "dim", -1)) % x.ndim
    strategies = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,) * len(call.inputs))]
    for d in range(x.ndim):
        if d != dim:
            strategies.append(
                AxisStrategy(outputs=(Shard(d),), inputs=(Shard(d),) * len(call.inputs))
            )
    if x.is_float:
        strategies.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL,) * len(call.inputs)))
    return strategies
