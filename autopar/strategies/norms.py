"""Normalizations (layer_norm, rms_norm) and softmax-like ops.

A normalization reads whole rows of its normalized dims, so on one mesh axis it may shard only
the other dims (the leading ones for layer/RMS norm; every dim but ``dim`` for softmax), with
weight and bias Replicate. None of these ops is linear (only the softmax backward ops, in
grad_output), so no other Partial strategy exists.
"""

from __future__ import annotations

import torch

from autopar.placement import PARTIAL, REPLICATE, Placement, Shard
from autopar.strategies.registry import AxisStrategy, OpCall, TensorMeta, register

aten = torch.ops.aten


def _normalized_ndim(call: OpCall) -> int:
    normalized_shape = call.args[1] if len(call.args) > 1 else call.kwargs["normalized_shape"]
    return len(normalized_shape)


def norm_strategies(call: OpCall, num_outer: int) -> list[AxisStrategy]:
    """R; and Shard(d) on input 0 and every output for each outer dim d < num_outer.

    Outputs with fewer dims than the input (mean/rstd of native_layer_norm keep the outer dims
    first) are sharded on the same dim; other tensor inputs (weight, bias) stay Replicate.
    """
    rest: tuple[Placement | None, ...] = tuple(
        REPLICATE if isinstance(m, TensorMeta) else None for m in call.inputs[1:]
    )
    num_outputs = len(call.outputs)
    strategies = [AxisStrategy(outputs=(REPLICATE,) * num_outputs, inputs=(REPLICATE, *rest))]
    for d in range(num_outer):
        strategies.append(AxisStrategy(outputs=(Shard(d),) * num_outputs, inputs=(Shard(d), *rest)))
    return strategies


@register(
    aten.layer_norm.default,
    aten.native_layer_norm.default,
    aten.rms_norm.default,
    aten._fused_rms_norm.default,
)
def layer_norm_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    return norm_strategies(call, x.ndim - _normalized_ndim(call))


@register(
    aten.softmax.int,
    aten._softmax.default,
    aten._safe_softmax.default,
    aten.log_softmax.int,
    aten._log_softmax.default,
)
def softmax_rule(call: OpCall) -> list[AxisStrategy]:
    x = call.inputs[0]
    dim = call.args[1] if len(call.args) > 1 else call.kwargs["dim"]
    dim = int(dim) % max(x.ndim, 1)
    strategies = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,))]
    for d in range(x.ndim):
        if d != dim:
            strategies.append(AxisStrategy(outputs=(Shard(d),), inputs=(Shard(d),)))
    return strategies


@register(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def softmax_backward_rule(call: OpCall) -> list[AxisStrategy]:
    # (grad_output, output, dim, input_dtype): both tensors share the layout.
    x = call.inputs[0]
    dim = int(call.args[2]) % max(x.ndim, 1)
    strategies = [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE, REPLICATE))]
    for d in range(x.ndim):
        if d != dim:
            strategies.append(AxisStrategy(outputs=(Shard(d),), inputs=(Shard(d), Shard(d))))
    # Linear in grad_output for a fixed output.
    strategies.append(AxisStrategy(outputs=(PARTIAL,), inputs=(PARTIAL, REPLICATE)))
    return strategies
