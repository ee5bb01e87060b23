"""Vocab-parallel cross entropy: ``aten.cross_entropy_loss`` on logits sharded on the class dim.

The lowering substitutes :func:`autopar_vocab_parallel_cross_entropy` for a cross-entropy node
whose chosen strategy shards the logits' class dim (dim 1) over some mesh axes
(``autopar.strategies.losses``). Each rank holds classes ``start .. start + C_local`` of every
sample and computes, per sample, over its classes: the max ``m``, ``s = sum exp(x - m)``, the
target's logit ``x_t`` (0 where the target is not among its classes) and, with label smoothing,
``sum x``. ONE all-gather per class axis of those 3-4 per-sample vectors (never ``[N, C]``)
gives every rank every part; the parts combine exactly as a log-sum-exp does
(``M = max m``, ``S = sum s * exp(m - M)``, the other rows summed), in coordinate order, so every
rank gets the same bits. Each sample's loss is ``(M - x_t) + log S`` (with smoothing
``(1 - eps) * that + eps * (M + log S - sum x / C)``), an ignored target gives 0, and the
reduction (none / sum / mean over the non-ignored targets, as PyTorch) makes the same output on
every rank: Replicate on the class axes. The backward needs no collective: the gradient of the
local logits is ``g * (softmax - (1 - eps) * onehot - eps / C)`` on the local classes, with the
softmax kept from the forward as the local ``[N, C_local]`` block of ``exp(x - m)`` and the
per-sample factor ``exp(m - M) / S`` (one block, as PyTorch keeps the log-softmax).
Class weights are not handled here: the strategy rule never shards the class dim when a weight
is given (that loss runs on replicated logits).

One all-gather of ``[k, N]`` stats rather than Megatron's all-reduces (max, then sums): one
collective's latency instead of two or three, the bytes being tiny either way; so under the cost
model this strategy is cheaper than gathering the logits whenever ``C_local > k``.

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

from autopar.comm.collectives import gather_stacked
from autopar.comm.process_groups import AxisGroups, lookup_axis_groups

REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2

__all__ = ["autopar_vocab_parallel_cross_entropy"]


def _combine(parts: Tensor) -> Tensor:
    """``[n, k, N]`` stats of n class blocks -> the ``[k, N]`` stats of their union: the max,
    the sum of exponentials rescaled to that max, the other rows summed."""
    top = parts[:, 0].amax(dim=0)
    sum_exp = (parts[:, 1] * (parts[:, 0] - top).exp()).sum(dim=0)
    return torch.cat([top.unsqueeze(0), sum_exp.unsqueeze(0), parts[:, 2:].sum(dim=0)])


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
        exp = (logits - local_max.unsqueeze(1)).exp_()  # one [N, C] temporary, not two
        local_target = target - class_start
        valid = target != ignore_index
        here = valid & (local_target >= 0) & (local_target < num_local)
        index = local_target.masked_fill(~here, 0).unsqueeze(1)
        picked = logits.gather(1, index).squeeze(1).masked_fill(~here, 0.0)
        rows = [local_max, exp.sum(dim=1), picked]
        if smoothing:
            rows.append(logits.sum(dim=1))
        stats = torch.stack(rows)
        for axis in axes:
            stats = _combine(gather_stacked(stats, groups, axis))
        global_max, sum_exp, target_logit = stats[0], stats[1], stats[2]
        log_sum_exp = sum_exp.log()
        loss = (global_max - target_logit) + log_sum_exp
        if smoothing:
            uniform = (global_max + log_sum_exp) - stats[3] / num_classes
            loss = (1.0 - smoothing) * loss + smoothing * uniform
        loss = loss.masked_fill(~valid, 0.0)
        count = valid.sum()
        # softmax = exp(x - m) * exp(m - M) / S on the local classes: the backward applies the
        # per-sample factor with the incoming gradient, one pass over [N, C] instead of two.
        scale = (local_max - global_max).exp() / sum_exp
        ctx.save_for_backward(exp, scale, index, here, valid, count)
        ctx.args = (reduction, smoothing, num_classes)
        if reduction == REDUCTION_NONE:
            return loss
        total = loss.sum()
        return total if reduction == REDUCTION_SUM else total / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        exp, scale, index, here, valid, count = ctx.saved_tensors
        reduction, smoothing, num_classes = ctx.args
        if reduction == REDUCTION_NONE:
            per_sample = grad
        elif reduction == REDUCTION_SUM:
            per_sample = grad.expand(valid.shape)
        else:
            per_sample = (grad / count).expand(valid.shape)
        per_sample = per_sample.masked_fill(~valid, 0.0).unsqueeze(1)
        # g * (softmax - eps / C) in one pass over the [N, C] block, then the target's
        # -(1 - eps) * g: the terms aten's log-softmax backward sums, in its order.
        if smoothing:
            grad_logits = torch.addcmul(
                per_sample * (-smoothing / num_classes), exp, scale.unsqueeze(1) * per_sample
            )
        else:
            grad_logits = exp * (scale.unsqueeze(1) * per_sample)
        grad_logits.scatter_add_(
            1, index, here.to(exp.dtype).unsqueeze(1) * per_sample * -(1.0 - smoothing)
        )
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
    if torch.is_autocast_enabled(logits.device.type):
        # Autocast runs cross entropy in fp32 (its fp32 op list): so does the sharded one, or a
        # bf16 run's loss would be rounded to bf16 (8 bits) unlike the unsharded loss's.
        logits = logits.float()
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
