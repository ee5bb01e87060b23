"""Sharding rules for ``aten.embedding``: data-parallel lookups and Megatron's vocab parallelism.

``embedding(weight [V, E], indices [*]) -> [*, E]`` per mesh axis:

* weight R, indices Shard(d) -> output Shard(d): each rank looks up its own tokens.
* weight Shard(1) (the embedding dim), indices R -> output Shard(last): each rank holds a slice
  of every row.
* weight Shard(0) (the vocabulary), indices R -> output Partial: Megatron's vocab-parallel
  embedding. Each rank holds rows ``[r*V/n, (r+1)*V/n)`` and must look up ``indices - r*V/n``
  with out-of-range tokens masked to zero rows, so that the ranks' outputs sum to the full
  lookup. A plain local ``aten.embedding`` on the shard is NOT this op: the lowering has to emit
  the masked lookup (see :func:`vocab_parallel_embedding`, the reference the tests use).
  DTensor calls this output ``_MaskPartial`` (a sum-Partial that remembers the mask).
* all Replicate.

The weight's gradient follows the gradient convention: with indices sharded and the weight
replicated it is Partial (each rank scatters its own tokens' gradients); with the weight sharded
it is sharded like the weight. ``padding_idx`` only zeroes a row's gradient and keeps all of this
true (its row id is global, so a vocab-sharded lowering must translate it to the local row).
"""

from __future__ import annotations

import torch

from autopar.placement import PARTIAL, REPLICATE, Shard
from autopar.strategies.registry import AxisStrategy, OpCall, register

aten = torch.ops.aten


def vocab_parallel_embedding(
    local_weight: torch.Tensor, indices: torch.Tensor, vocab_start: int, padding_idx: int = -1
) -> torch.Tensor:
    """One rank's part of an embedding whose weight rows ``vocab_start ..`` are ``local_weight``.

    Tokens outside the local rows give zero rows; summing the parts of all ranks gives the full
    lookup (the Partial output of the vocab-parallel strategy).
    """
    num_rows = local_weight.shape[0]
    local = indices - vocab_start
    outside = (local < 0) | (local >= num_rows)
    local = local.masked_fill(outside, 0)
    local_padding = padding_idx - vocab_start if 0 <= padding_idx - vocab_start < num_rows else -1
    out = torch.ops.aten.embedding(local_weight, local, local_padding)
    # In place: the lookup's backward does not read its output, and no [N, D] copy is made.
    return out.masked_fill_(outside.unsqueeze(-1), 0.0)


@register(aten.embedding.default)
def embedding_rule(call: OpCall) -> list[AxisStrategy]:
    indices = call.inputs[1]
    out_ndim = indices.ndim + 1
    options = [
        AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE, REPLICATE)),
        AxisStrategy(outputs=(Shard(out_ndim - 1),), inputs=(Shard(1), REPLICATE)),
        AxisStrategy(outputs=(PARTIAL,), inputs=(Shard(0), REPLICATE)),
    ]
    options += [
        AxisStrategy(outputs=(Shard(d),), inputs=(REPLICATE, Shard(d))) for d in range(indices.ndim)
    ]
    return options
