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

**Vocab-parallel cross entropy.** ``cross_entropy_loss`` with class-index targets and no class
weights may also shard the class dim (dim 1) of its logits, with the target Replicate: the op
then all-gathers a few per-sample ``[N]`` vectors inside itself (each rank's max, sum of
exponentials and target logit; ``autopar.lowering.vocab_parallel``) and every rank gets
the whole loss, so the output is Replicate on that axis, for every reduction (the mean divides
by a count every rank has: the samples are not split on that axis). Those collectives are listed
by :func:`cross_entropy_collectives` for the planner. ``ignore_index`` and ``label_smoothing``
are supported; with a ``weight`` the class dim is never sharded.
"""

from __future__ import annotations

import math

import torch

from autopar.placement import PARTIAL, REPLICATE, Placement, Shard, local_shape
from autopar.strategies.pointwise import broadcast_placement
from autopar.strategies.registry import (
    AxisStrategy,
    OpCall,
    Strategy,
    TensorMeta,
    register,
    register_in_op_collectives,
)

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


CLASS_DIM = 1


def vocab_parallel(call: OpCall) -> bool:
    """Whether a cross entropy may shard its logits' class dim (class-index targets, no weight)."""
    x, target = call.inputs[0], call.inputs[1]
    weight = _arg(call, 2, "weight", None)
    return x.ndim >= 2 and target.ndim == x.ndim - 1 and not isinstance(weight, TensorMeta)


def class_axes(strategy: Strategy) -> tuple[int, ...]:
    """Mesh axes on which a cross-entropy strategy shards the logits' class dim."""
    logits = strategy.inputs[0]
    if logits is None:
        return ()
    return tuple(a for a, p in enumerate(logits) if isinstance(p, Shard) and p.dim == CLASS_DIM)


@register(aten.cross_entropy_loss.default)
def cross_entropy_rule(call: OpCall) -> list[AxisStrategy]:
    strategies = class_loss_strategies(call, int(_arg(call, 3, "reduction", REDUCTION_MEAN)))
    if vocab_parallel(call):
        weights = tuple(REPLICATE if isinstance(m, TensorMeta) else None for m in call.inputs[2:])
        strategies.append(
            AxisStrategy(outputs=(REPLICATE,), inputs=(Shard(CLASS_DIM), REPLICATE, *weights))
        )
    return strategies


@register_in_op_collectives(aten.cross_entropy_loss.default)
def cross_entropy_collectives(
    call: OpCall, strategy: Strategy, mesh_shape: list[int] | tuple[int, ...]
) -> list[tuple[str, int, float]]:
    """A vocab-parallel cross entropy's forward all-gathers, per class axis, 3 per-sample
    vectors (4 with label smoothing) of this rank's samples (the batch may be split on other
    axes); its backward has no collective. Bytes as ``collective_time_s`` counts an all-gather's:
    the gathered (full) size."""
    axes = class_axes(strategy)
    if not axes:
        return []
    x = call.inputs[0]
    shape = local_shape(x.shape, strategy.inputs[0], mesh_shape)
    samples = shape[0] * math.prod(shape[2:])
    num_rows = 4 if float(_arg(call, 5, "label_smoothing", 0.0)) else 3
    nbytes = float(samples * num_rows * x.dtype.itemsize)
    return [("all_gather", axis, nbytes * mesh_shape[axis]) for axis in axes]


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
