"""Losses: cross entropy / nll (class-index or probability targets) and elementwise losses (mse, l1,
smooth_l1, huber, bce-with-logits).

Each sample's loss is local to its row, so on one mesh axis a loss may shard any sample dim
(the batch dim and the trailing spatial dims of ``[N, C, d1, ...]`` inputs, never the class dim,
whose log-sum-exp needs every class), with the target sharded alike and class weights Replicate:

* ``reduction="none"``: the per-sample output is sharded on the same dim;
* ``reduction="sum"``: the output is ``Partial("sum")`` (and so is nll's ``total_weight``);
* ``reduction="mean"``: **not generated** when a sample dim is sharded. Each rank would divide by
  its own count (of non-ignored, weighted targets), so the ranks' values do not sum to the global
  mean (not even for equal shards, where they sum to N times it). Mean losses therefore take
  Replicate inputs on every axis; the planner pays one gather of the logits (or of the
  prediction) before the loss.

No loss is linear in its input, so no Partial input is generated.
"""

from __future__ import annotations

import torch

from autopar.placement import PARTIAL, REPLICATE, Placement, Shard
from autopar.strategies.pointwise import broadcast_placement
from autopar.strategies.registry import AxisStrategy, OpCall, TensorMeta, register

aten = torch.ops.aten

REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


def _arg(call: OpCall, index: int, name: str, default: object) -> object:
    if len(call.args) > index:
        return call.args[index]
    return call.kwargs.get(name, default)


def _sample_dims(x: TensorMeta) -> list[tuple[int, int]]:
    """(dim of the input, dim of an index target / unreduced output) for each sample dim."""
    if x.ndim <= 1:
        return []
    return [(0, 0)] + [(d, d - 1) for d in range(2, x.ndim)]


def class_loss_strategies(call: OpCall, reduction: int) -> list[AxisStrategy]:
    """cross_entropy / nll: inputs (self, target, weight?); outputs (loss,) or (loss, total_weight)."""
    x, target = call.inputs[0], call.inputs[1]
    probability_target = target.ndim == x.ndim
    num_outputs = len(call.outputs)
    weights: tuple[Placement | None, ...] = tuple(
        REPLICATE if isinstance(m, TensorMeta) else None for m in call.inputs[2:]
    )
    strategies = [
        AxisStrategy(outputs=(REPLICATE,) * num_outputs, inputs=(REPLICATE, REPLICATE, *weights))
    ]
    if reduction == REDUCTION_MEAN:
        return strategies
    for x_dim, t_dim in _sample_dims(x):
        target_p = Shard(x_dim if probability_target else t_dim)
        if reduction == REDUCTION_SUM:
            outputs: tuple[Placement, ...] = (PARTIAL,) * num_outputs
        else:
            # nll_loss_forward's total_weight is 0 on every rank for reduction="none".
            outputs = (Shard(t_dim),) + (REPLICATE,) * (num_outputs - 1)
        strategies.append(AxisStrategy(outputs=outputs, inputs=(Shard(x_dim), target_p, *weights)))
    return strategies


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(call: OpCall) -> list[AxisStrategy]:
    return class_loss_strategies(call, int(_arg(call, 3, "reduction", REDUCTION_MEAN)))


@register(
    aten.nll_loss.default,
    aten.nll_loss_nd.default,
    aten.nll_loss_forward.default,
    aten.nll_loss2d_forward.default,
    aten.nll_loss2d.default,
)
def nll_rule(call: OpCall) -> list[AxisStrategy]:
    return class_loss_strategies(call, int(_arg(call, 3, "reduction", REDUCTION_MEAN)))


def elementwise_loss_strategies(call: OpCall, reduction: int) -> list[AxisStrategy]:
    """mse-like losses: every input broadcasts against self; any dim may be sharded."""
    x = call.inputs[0]

    def inputs_for(d: int) -> tuple[Placement | None, ...]:
        return (Shard(d),) + tuple(
            broadcast_placement(x.shape, m, d) if isinstance(m, TensorMeta) else None
            for m in call.inputs[1:]
        )

    replicated = tuple(REPLICATE if isinstance(m, TensorMeta) else None for m in call.inputs)
    strategies = [AxisStrategy(outputs=(REPLICATE,), inputs=replicated)]
    if reduction == REDUCTION_MEAN:
        return strategies
    for d in range(x.ndim):
        out: Placement = PARTIAL if reduction == REDUCTION_SUM else Shard(d)
        strategies.append(AxisStrategy(outputs=(out,), inputs=inputs_for(d)))
    return strategies


@register(
    aten.mse_loss.default,
    aten.l1_loss.default,
    aten.smooth_l1_loss.default,
    aten.huber_loss.default,
)
def elementwise_loss_rule(call: OpCall) -> list[AxisStrategy]:
    return elementwise_loss_strategies(call, int(_arg(call, 2, "reduction", REDUCTION_MEAN)))


@register(aten.binary_cross_entropy_with_logits.default, aten.binary_cross_entropy.default)
def bce_rule(call: OpCall) -> list[AxisStrategy]:
    index = 4 if call.op is aten.binary_cross_entropy_with_logits.default else 3
    return elementwise_loss_strategies(call, int(_arg(call, index, "reduction", REDUCTION_MEAN)))
