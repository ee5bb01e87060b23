"""Back-to-back all-reduces priced as the lowering fuses them (one latency for the group).

The lowering (:mod:`autopar.lowering.fused_reductions`) turns all-reduces on one mesh axis that
follow each other, with nothing between them using their results, into one
``autopar_all_reduce_many`` call, after ordering chained all-reduces (a value Partial on several
axes) by chain step. Conversions are inserted right before their consumer, so this happens where
one op takes two or more inputs (a data-parallel mean loss's sum and its token count) that are
each converted by all-reduces only (Partial to Replicate on a set of axes, every other axis
unchanged) and whose values may share a buffer (:func:`autopar.comm.fusion.buffer_members`:
dtype, counts, size). Where the two conversions are the same, each of their axes saves one
all-reduce latency (and ``sync_s``): on a 2x2 data-parallel mesh the sum and count take two
calls, one per axis, instead of four.

The saving depends on three choices (the two producers' layouts and the consumer's), and the
ILP's costs are per node and per pair of nodes, so it is split in two (per mesh axis ``a``, ``L``
one all-reduce's latency on it, for consecutive members ``i``, ``j`` of the group):

* the edge from producer ``i`` to the consumer gives back ``L`` where its conversion is
  all-reduces only, one of them on ``a``, and the consumer takes ``j`` in the same layout as
  ``i``;
* a new edge between the two producers charges ``L`` where ``i`` is Partial on ``a`` and ``j``
  has another layout than ``i``.

Where the consumer takes both in one layout and ``i`` is all-reduces only from it, ``j``'s
conversion is the same calls exactly when the producers' layouts are equal: then the pair pays
one latency per axis, as issued, and otherwise two per axis of ``i``'s, never less than issued. Elsewhere (``i`` Partial on ``a`` and ``j`` in another
layout, with no fused pair) the pair edge charges one latency that is not issued: a price too
high, never too low, for layouts where the two values of one loss are reduced differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.fx as fx

from autopar.comm.fusion import MAX_FUSED_NUMEL, buffer_members, tensor_value
from autopar.placement import Placements

__all__ = ["price_fused_reductions"]


def price_fused_reductions(gm: fx.GraphModule, nodes: Sequence, edges: list, pricer) -> int:
    """Price the fused all-reduces of the strategy space (module docstring): replaces the cost
    arrays of the first members' edges (arrays shared by repeated layers get one shared
    replacement) and appends the pair edges to ``edges`` (``input_index`` -2). Returns the
    number of pairs priced."""
    from autopar.planner.space import EdgeSpace

    mesh = pricer.mesh
    latency = {a: pricer.all_reduce_latency_s(a) for a in range(mesh.ndim) if mesh.shape[a] > 1}
    latency = {a: s for a, s in latency.items() if s > 0}
    if not latency:
        return 0
    fx_nodes = {n.name: n for n in gm.graph.nodes}
    incoming: dict[int, list] = {}
    for edge in edges:
        src = nodes[edge.src]
        if edge.input_index >= 0 and _may_fuse(src, fx_nodes.get(src.name)):
            incoming.setdefault(edge.dst, []).append(edge)
    existing = {(e.src, e.dst): e for e in edges}
    # Keyed by ids of arrays and strategy lists: each entry keeps the replaced array alive, so
    # that no later array reuses its id.
    memo: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    pairs = 0
    for dst, into in incoming.items():
        into = sorted(into, key=lambda e: e.input_index)
        found = (
            buffer_members([fx_nodes[nodes[e.src].name] for e in into]) if len(into) > 1 else None
        )
        if found is None:
            continue
        members = [into[k] for k in found[1]]
        for first, second in zip(members, members[1:]):
            if first.src == second.src:
                continue
            src_i, src_j, consumer = nodes[first.src], nodes[second.src], nodes[dst]
            key = (
                id(first.cost_s),
                id(src_i.strategies),
                id(src_j.strategies),
                id(consumer.strategies),
                first.input_index,
                second.input_index,
            )
            if key not in memo:
                credit, pair = _pair_prices(
                    src_i.strategies, src_j.strategies, consumer.strategies,
                    first.input_index, second.input_index, latency,
                )  # fmt: skip
                memo[key] = (first.cost_s, np.maximum(first.cost_s - credit, 0.0), pair)
            _, first.cost_s, pair = memo[key]
            pairs += 1
            if not pair.any():
                continue
            ends = (first.src, second.src)
            matrix = pair if ends[0] < ends[1] else pair.T
            ends = (min(ends), max(ends))
            if ends in existing:
                existing[ends].cost_s = existing[ends].cost_s + matrix
            else:
                existing[ends] = EdgeSpace(src=ends[0], dst=ends[1], input_index=-2, cost_s=matrix)
                edges.append(existing[ends])
    return pairs


def _may_fuse(src, fx_node: fx.Node | None) -> bool:
    """A producer whose value is small enough to share a buffer and that can be Partial."""
    value = tensor_value(fx_node)
    if value is None or value.numel() > MAX_FUSED_NUMEL or not isinstance(value, torch.Tensor):
        return False
    return any(
        s.outputs and s.outputs[0] is not None and any(p.is_partial() for p in s.outputs[0])
        for s in src.strategies
    )


def _all_reduce_on(src: Placements | None, dst: Placements | None, axis: int) -> bool:
    """Whether converting ``src`` to ``dst`` is all-reduces only (Partial to Replicate on some
    axes, every other axis unchanged), one of them on ``axis``."""
    if src is None or dst is None or not (src[axis].is_partial() and dst[axis].is_replicate()):
        return False
    return all(p == q or (p.is_partial() and q.is_replicate()) for p, q in zip(src, dst))


def _pair_prices(
    strategies_i: Sequence,
    strategies_j: Sequence,
    consumer: Sequence,
    input_i: int,
    input_j: int,
    latency: dict[int, float],
) -> tuple[np.ndarray, np.ndarray]:
    """(credit [strategy of i, consumer strategy], pair [strategy of i, strategy of j])."""
    out_i = [s.outputs[0] if s.outputs else None for s in strategies_i]
    out_j = [s.outputs[0] if s.outputs else None for s in strategies_j]
    need_i = [t.inputs[input_i] if input_i < len(t.inputs) else None for t in consumer]
    need_j = [t.inputs[input_j] if input_j < len(t.inputs) else None for t in consumer]
    same = np.array([p is not None and p == q for p, q in zip(need_i, need_j)], dtype=float)
    differs = np.array([[float(p != q) for q in out_j] for p in out_i]).reshape(len(out_i), -1)
    credit = np.zeros((len(out_i), len(consumer)))
    pair = np.zeros((len(out_i), len(out_j)))
    for axis, seconds in latency.items():
        one = np.array(
            [[float(_all_reduce_on(p, q, axis)) for q in need_i] for p in out_i]
        ).reshape(len(out_i), -1)
        credit += seconds * one * same[None, :]
        partial = np.array([float(p is not None and p[axis].is_partial()) for p in out_i])
        pair += seconds * partial[:, None] * differs
    return credit, pair
