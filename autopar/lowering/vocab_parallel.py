"""Vocab-parallel cross entropy: ``aten.cross_entropy_loss`` on logits sharded on the class dim.

The lowering substitutes :func:`autopar_vocab_parallel_cross_entropy` for a cross-entropy node
whose chosen strategy shards the logits' class dim (dim 1) over some mesh axes
(``autopar.strategies.losses``). Each rank holds classes ``offset .. offset + C_local`` of every
sample; the collectives are part of the op, on ``[N]``-sized vectors (never ``[N, C]``):

1. all-reduce (max) of each sample's local max: the global max ``m``;
2. one all-reduce (sum) of the stacked per-sample vectors ``sum exp(x - m)`` over the local
   classes, the target's shifted logit ``x_t - m`` (zero on ranks that do not hold class ``t``)
   and, with label smoothing, ``sum (x - m)`` over the local classes.

Then every rank has each sample's loss ``log(sum exp) - (x_t - m)`` (with smoothing
``(1 - eps) * that + eps * (log(sum exp) - sum (x - m) / C)``), ignored targets give 0, and the
reduction (none / sum / mean over the non-ignored targets, as PyTorch) makes the same output on
every rank: Replicate on the class axes. The backward needs no collective: the gradient of the
local logits is ``g * (softmax - (1 - eps) * onehot - eps / C)`` on the local classes, with the
softmax kept from the forward (the local ``[N, C_local]`` block, as PyTorch keeps the log-softmax).
Class weights are not handled here: the strategy rule never shards the class dim when a weight
is given (that loss runs on replicated logits).

A custom autograd function with its collectives inside (through ``autopar.comm.collectives``, so
collective checks, error context and timeouts apply) was chosen over a capture-time
decomposition into amax / exp / sum / log ops: it keeps the captured graph (and its hash, its
plans) unchanged, needs no ``Partial("max")`` placement (which autopar's resharding does not
have), and saves one ``[N, C_local]`` block for backward instead of the several intermediates a
decomposed graph would keep.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from autopar.comm.collectives import reduce_over_axes
from autopar.comm.process_groups import AxisGroups, lookup_axis_groups

REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2

__all__ = ["autopar_vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: Tensor,
        target: Tensor,
        groups: AxisGroups,
        axes: tuple[int, ...],
        class_start: int,
        num_classes: int,
        reduction: int,
        ignore_index: int,
        smoothing: float,
    ) -> Tensor:
        num_local = logits.shape[1]
        local_max = logits.detach().amax(dim=1)
        global_max = reduce_over_axes(local_max, groups, axes, "max")
        shifted = logits - global_max.unsqueeze(1)
        exp = shifted.exp()
        local_target = target - class_start
        valid = target != ignore_index
        here = valid & (local_target >= 0) & (local_target < num_local)
        index = local_target.masked_fill(~here, 0).unsqueeze(1)
        picked = shifted.gather(1, index).squeeze(1).masked_fill(~here, 0.0)
        parts = [exp.sum(dim=1), picked]
        if smoothing:
            parts.append(shifted.sum(dim=1))
        sums = reduce_over_axes(torch.stack(parts), groups, axes, "sum")
        log_sum_exp = sums[0].log()
        loss = log_sum_exp - sums[1]
        if smoothing:
            loss = (1.0 - smoothing) * loss + smoothing * (log_sum_exp - sums[2] / num_classes)
        loss = loss.masked_fill(~valid, 0.0)
        count = valid.sum()
        softmax = exp.div_(sums[0].unsqueeze(1))
        ctx.save_for_backward(softmax, index, here, valid, count)
        ctx.args = (reduction, smoothing, num_classes)
        if reduction == REDUCTION_NONE:
            return loss
        total = loss.sum()
        return total if reduction == REDUCTION_SUM else total / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        softmax, index, here, valid, count = ctx.saved_tensors
        reduction, smoothing, num_classes = ctx.args
        if reduction == REDUCTION_NONE:
            per_sample = grad
        elif reduction == REDUCTION_SUM:
            per_sample = grad.expand(valid.shape)
        else:
            per_sample = (grad / count).expand(valid.shape)
        per_sample = per_sample.masked_fill(~valid, 0.0).unsqueeze(1)
        grad_logits = softmax.clone()
        if smoothing:
            grad_logits.sub_(smoothing / num_classes)
        grad_logits.scatter_add_(
            1, index, (here.to(softmax.dtype) * -(1.0 - smoothing)).unsqueeze(1)
        )
        grad_logits.mul_(per_sample)
        return grad_logits, None, None, None, None, None, None, None, None


def autopar_vocab_parallel_cross_entropy(
    logits: Tensor,
    target: Tensor,
    group_key: str,
    class_axes: Sequence[int],
    num_classes: int,
    reduction: int = REDUCTION_MEAN,
    ignore_index: int = -100,
    smoothing: float = 0.0,
) -> Tensor:
    """``aten.cross_entropy_loss`` of logits whose class dim is split over ``class_axes``.

    The local classes start at (mixed-radix coordinate over ``class_axes``) x (local class
    count); the result is the full loss on every rank (module docstring).
    """
    groups = lookup_axis_groups(group_key)
    coordinate = 0
    for axis in class_axes:
        coordinate = coordinate * groups.mesh_shape[axis] + groups.coordinate[axis]
    return _VocabParallelCrossEntropy.apply(
        logits,
        target,
        groups,
        tuple(class_axes),
        coordinate * logits.shape[1],
        num_classes,
        reduction,
        ignore_index,
        float(smoothing),
    )
