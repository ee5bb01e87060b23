"""Sharding rules for scaled dot-product attention.

``sdpa(q [*B, L, E], k [*B', S, E], v [*B', S, Ev], attn_mask [.., L, S]) -> [*B, L, Ev]``. The
leading dims (batch, heads) are independent problems, so any of them may be sharded on q, k, v
and the output alike; the mask follows where it is not broadcast (size 1 -> stays Replicate).
Under grouped-query attention (``enable_gqa``, fewer key/value heads) query head h reads KV head
``h // (Hq / Hk)``, so an even split of both head counts keeps each rank's query heads with their
own KV heads: the heads dim is sharded on both when the mesh axis divides both (the expander's
divisibility check).

The query sequence dim L may be sharded with k, v replicated (each query row attends
independently) only when ``is_causal`` is False: the built-in causal mask is aligned to the local
block's row 0, which is wrong for every rank but the first. An explicit mask is sharded along its
L dim with q. The key/value sequence S and the head dim E are never sharded (the softmax and the
q.k contraction need all of them), and nothing is Partial (softmax is not linear).

With ``dropout_p > 0`` every rank draws its own dropout mask, as in :mod:`dropout`; tests compare
with ``dropout_p = 0``.

``_scaled_dot_product_flash_attention_for_cpu`` (what SDPA decomposes to on CPU) gets the same
strategies; its second output, the logsumexp ``[*B, L]``, is sharded like the output.
"""

from __future__ import annotations

import torch

from autopar.placement import REPLICATE, Placement, Shard
from autopar.strategies.registry import AxisStrategy, OpCall, TensorMeta, register

aten = torch.ops.aten


def _kv_dim(q: TensorMeta, kv: TensorMeta, dim: int, gqa: bool) -> Placement | None:
    """The placement of k or v when q's leading dim ``dim`` is sharded, or None if impossible."""
    kv_dim = dim - (q.ndim - kv.ndim)
    if kv_dim < 0 or kv.shape[kv_dim] == 1:
        return REPLICATE
    if kv.shape[kv_dim] == q.shape[dim]:
        return Shard(kv_dim)
    if gqa and dim == q.ndim - 3 and q.shape[dim] % kv.shape[kv_dim] == 0:
        return Shard(kv_dim)
    return None


def _mask_dim(mask: TensorMeta, out_ndim: int, dim: int, out_size: int) -> Placement:
    """The mask's placement when output dim ``dim`` is sharded (a broadcast dim stays R)."""
    mask_dim = dim - (out_ndim - mask.ndim)
    if mask_dim < 0 or mask.shape[mask_dim] == 1:
        return REPLICATE
    assert mask.shape[mask_dim] == out_size, "attention mask does not broadcast to the scores"
    return Shard(mask_dim)


def attention_strategies(
    q: TensorMeta,
    k: TensorMeta,
    v: TensorMeta,
    mask: TensorMeta | None,
    *,
    is_causal: bool,
    gqa: bool,
    num_outputs: int,
) -> list[AxisStrategy]:
    """Per-axis strategies; inputs are ordered q, k, v[, mask] and every output shares q's
    leading dims and L (output and logsumexp)."""
    score_ndim = q.ndim  # scores are [*B, L, S]: as many dims as q

    def strategy(
        out: Placement, qkv: tuple[Placement, Placement, Placement], m: Placement
    ) -> AxisStrategy:
        ins = (*qkv, m) if mask is not None else qkv
        return AxisStrategy(outputs=(out,) * num_outputs, inputs=ins)

    options = [strategy(REPLICATE, (REPLICATE, REPLICATE, REPLICATE), REPLICATE)]
    for dim in range(q.ndim - 2):
        k_pl, v_pl = _kv_dim(q, k, dim, gqa), _kv_dim(q, v, dim, gqa)
        if k_pl is None or v_pl is None:
            continue
        m_pl = REPLICATE if mask is None else _mask_dim(mask, score_ndim, dim, q.shape[dim])
        options.append(strategy(Shard(dim), (Shard(dim), k_pl, v_pl), m_pl))
    if not is_causal:
        seq = q.ndim - 2
        m_pl = REPLICATE if mask is None else _mask_dim(mask, score_ndim, seq, q.shape[seq])
        options.append(strategy(Shard(seq), (Shard(seq), REPLICATE, REPLICATE), m_pl))
    return options


def _arg(call: OpCall, position: int, name: str, default: object) -> object:
    if name in call.kwargs:
        return call.kwargs[name]
    return call.args[position] if len(call.args) > position else default


@register(aten.scaled_dot_product_attention.default)
def sdpa_rule(call: OpCall) -> list[AxisStrategy]:
    q, k, v = call.inputs[:3]
    mask = call.inputs[3] if len(call.inputs) > 3 else None
    return attention_strategies(
        q,
        k,
        v,
        mask,
        is_causal=bool(_arg(call, 5, "is_causal", False)),
        gqa=bool(call.kwargs.get("enable_gqa", False)),
        num_outputs=1,
    )


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_flash_cpu_rule(call: OpCall) -> list[AxisStrategy]:
    q, k, v = call.inputs[:3]
    mask = call.inputs[3] if len(call.inputs) > 3 else None
    return attention_strategies(
        q,
        k,
        v,
        mask,
        is_causal=bool(_arg(call, 4, "is_causal", False)),
        gqa=False,
        num_outputs=2,
    )
