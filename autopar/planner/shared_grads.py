"""A parameter used by several ops has its gradient reduced once, and is priced once.

Each op prices, per strategy, the reduction of the Partial gradients of its parameter inputs
(``space._op_space``: ``param_grad_comm_s``, ``grad_sync_s`` per Partial mesh axis). The
runtime reduces a parameter's gradient once, after autograd has summed every use into
``param.grad`` (``autopar.runtime.grad_sync``'s buckets, or ZeRO's reduce-scatter). A
parameter with two consumers -- a GPT's embedding tied to its output head, lifted by
torch.export as one placeholder read by ``embedding`` and the head's ``linear`` -- was priced
twice: on gpt2-small-2l's 2x2 ddp plan 2 x 3.5 ms for the one all-reduce of the 38.6M-element
table (and a ZeRO configuration gives back only one of them, ``problem._param_state_of``).

The saving depends on two consumers' choices, so it is a pair term, kept non-negative as the
solver's costs are: for a parameter (an alias counts for its original) whose uses are
``(c_1, j_1), ..., (c_k, j_k)`` (consumer, input position; graph order), each later consumer
``c_i`` (``i >= 2``, another node than ``c_1``) no longer prices its own reduction on axis
``a`` in its node cost; a new edge between ``c_1`` and ``c_i`` charges it back, per pair of
strategies, unless ``c_1`` also leaves the gradient Partial on ``a`` and takes the parameter
in the same placements as ``c_i`` (then both partial sums land in one gradient of one layout,
and ``c_1``'s price is the one reduction issued). So where the uses agree the parameter pays
one reduction per axis, as issued, and otherwise what it paid before: never below what is
issued. The plan's breakdown counts the pair edges in ``grad_sync_s`` (``evaluation_sums``;
in ``resharding_s`` where one joined two consumers already joined by a data edge and was added
to it). With three or more uses that disagree with ``c_1`` but agree among themselves, each
still pays its own: a price too high, never too low.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch.fx as fx

from autopar.planner.pricing import CommPricer
from autopar.strategies import input_nodes
from autopar.strategies.registry import tensor_meta

__all__ = ["SHARED_GRAD_EDGE", "price_shared_param_grads"]

SHARED_GRAD_EDGE = -3
"""``EdgeSpace.input_index`` of the pair edges this module adds (no data flows on them)."""


def _uses(gm: fx.GraphModule, nodes: Sequence, index: dict[str, int], needs_grad) -> dict:
    """Parameter (owner placeholder name) -> its uses ``(consumer index, input position, fx
    input)`` in graph order, where the consumer is an op and the parameter needs a gradient."""
    owner = {n.name: n.alias_of or n.name for n in nodes if n.kind == "param"}
    uses: dict[str, list[tuple[int, int, fx.Node]]] = {}
    for node in gm.graph.nodes:
        k = index.get(node.name)
        if k is None or nodes[k].kind != "op":
            continue
        for j, inp in enumerate(input_nodes(node)):
            if inp.name in owner and inp.name in needs_grad:
                uses.setdefault(owner[inp.name], []).append((k, j, inp))
    return uses


def _shares(strategies: Sequence, j: int, meta, pricer: CommPricer) -> np.ndarray:
    """[strategy, mesh axis]: the reduction a consumer strategy prices for its input ``j`` (a
    parameter) on each axis, as ``space._op_space`` prices it."""
    from autopar.planner.space import local_bytes

    shape = pricer.mesh.shape
    out = np.zeros((len(strategies), len(shape)))
    for t, strategy in enumerate(strategies):
        if j >= len(strategy.inputs) or j >= len(strategy.input_grads):
            continue
        placements, grad = strategy.inputs[j], strategy.input_grads[j]
        if placements is None or grad is None:
            continue
        nbytes = local_bytes(meta, placements, shape)
        for a, p in enumerate(grad):
            if p.is_partial() and shape[a] > 1:
                out[t, a] = pricer.grad_sync_s(nbytes, a)
    return out


def _agrees(first: Sequence, j1: int, later: Sequence, ji: int, axis: int) -> np.ndarray:
    """[strategy of c_1, strategy of c_i]: 1 where ``c_1`` leaves the gradient Partial on
    ``axis`` and takes the parameter in the placements ``c_i`` takes it in."""

    def placements(s, j):
        return s.inputs[j] if j < len(s.inputs) else None

    def partial(s, j):
        grad = s.input_grads[j] if j < len(s.input_grads) else None
        return grad is not None and grad[axis].is_partial()

    return np.array(
        [
            [float(partial(s, j1) and placements(s, j1) == placements(t, ji)) for t in later]
            for s in first
        ]
    ).reshape(len(first), len(later))


def price_shared_param_grads(
    gm: fx.GraphModule,
    nodes: Sequence,
    index: dict[str, int],
    edges: list,
    pricer: CommPricer,
    needs_grad,
) -> frozenset[tuple[int, int]]:
    """Price each parameter's gradient reduction once (module docstring): replaces the later
    consumers' ``param_grad_comm_s`` (never written in place; arrays shared by repeated
    layers get one shared replacement) and adds the pair edges to ``edges`` (or to an edge
    already joining the two consumers). Returns the later uses ``(consumer, input)`` priced
    (``pricing.bucket_rounding`` leaves them out of the bucket pool)."""
    from autopar.planner.space import EdgeSpace

    existing = {(e.src, e.dst): e for e in edges}
    node_memo: dict[tuple, np.ndarray] = {}
    pair_memo: dict[tuple, np.ndarray] = {}
    replaced: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    priced: set[tuple[int, int]] = set()
    for owner_uses in _uses(gm, nodes, index, needs_grad).values():
        c1, j1, _ = owner_uses[0]
        for ci, ji, inp in owner_uses[1:]:
            if ci == c1:
                continue  # one op reading the parameter twice: both keep their price
            first, later = nodes[c1], nodes[ci]
            meta = tensor_meta(inp.meta["val"])
            key = (id(first.strategies), j1, id(later.strategies), ji, meta)
            if key not in pair_memo:
                shares = _shares(later.strategies, ji, meta, pricer)
                pair = np.zeros((len(first.strategies), len(later.strategies)))
                for a in range(shares.shape[1]):
                    if shares[:, a].any():
                        agree = _agrees(first.strategies, j1, later.strategies, ji, a)
                        pair += shares[None, :, a] * (1.0 - agree)
                pair_memo[key] = pair
                node_memo[(*key, "node")] = shares.sum(axis=1)
            pair, own = pair_memo[key], node_memo[(*key, "node")]
            if not own.any():
                continue
            # Keyed by the id of the replaced array, which the entry keeps alive (no later
            # array reuses its id).
            replace_key = (id(later.param_grad_comm_s), *key)
            if replace_key not in replaced:
                before = later.param_grad_comm_s
                replaced[replace_key] = (before, np.maximum(before - own, 0.0))
            later.param_grad_comm_s = replaced[replace_key][1]
            priced.add((ci, ji))
            ends, matrix = (c1, ci), pair
            if c1 > ci:
                ends, matrix = (ci, c1), pair.T
            if ends in existing:
                existing[ends].cost_s = existing[ends].cost_s + matrix
            else:
                edge = EdgeSpace(
                    src=ends[0], dst=ends[1], input_index=SHARED_GRAD_EDGE, cost_s=matrix
                )
                existing[ends] = edge
                edges.append(edge)
    return frozenset(priced)
