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
``c_i`` (``i >= 2``, another node than ``c_1``) no longer prices its own reduction in its node
cost, and a new edge between ``c_1`` and ``c_i`` prices, per pair of strategies and per mesh
axis ``a``, what the lowering issues (``lowering.rewrite``: a parameter's gradient joins the
buckets on ``a`` only where every use leaves it Partial there; otherwise each Partial use's
gradient is all-reduced in the graph, a whole collective):

* both Partial on ``a`` and taking the parameter in the same placements: nothing more
  (``c_1``'s bucketed price is the one reduction issued);
* otherwise: ``c_i``'s gradient, where Partial on ``a``, as a whole all-reduce, and ``c_1``'s,
  where Partial on ``a``, topped up from its bucketed price to a whole all-reduce.

So where the uses agree the parameter pays one bucketed reduction per axis, as issued, and
where they disagree the in-graph all-reduces issued (before: each use a bucketed share, below
what runs: gpt's auto plan on 2x2 computed the embedding with the tokens replicated over one
axis and the head Partial on both, and was priced 2.7 ms for two whole 2 MiB all-reduces). A
use that converts the parameter is also reduced in the graph; the pair cannot see the
parameter's own layout, so that case keeps the bucketed price (``bucket_count`` counts it
after the solve). The plan's breakdown counts the pair edges in ``grad_sync_s``
(``evaluation_sums``; in ``resharding_s`` where one joined two consumers already joined by a
data edge and was added to it). With three or more uses each later one is paired with the
first only: ``c_1``'s top-up may be charged more than once, a price too high, never too low.
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


def _prices(strategies: Sequence, j: int, meta, pricer: CommPricer) -> tuple[np.ndarray, ...]:
    """[strategy, mesh axis] each: the bucketed reduction a consumer strategy prices for its
    input ``j`` (a parameter) on each axis, as ``space._op_space`` prices it, and the whole
    in-graph all-reduce of the same bytes (0 where the gradient is not Partial)."""
    from autopar.planner.space import local_bytes

    shape = pricer.mesh.shape
    bucketed = np.zeros((len(strategies), len(shape)))
    in_graph = np.zeros((len(strategies), len(shape)))
    for t, strategy in enumerate(strategies):
        if j >= len(strategy.inputs) or j >= len(strategy.input_grads):
            continue
        placements, grad = strategy.inputs[j], strategy.input_grads[j]
        if placements is None or grad is None:
            continue
        nbytes = local_bytes(meta, placements, shape)
        for a, p in enumerate(grad):
            if p.is_partial() and shape[a] > 1:
                bucketed[t, a] = pricer.grad_sync_s(nbytes, a)
                in_graph[t, a] = pricer.all_reduce_s(nbytes, a)
    return bucketed, in_graph


def _same_placements(first: Sequence, j1: int, later: Sequence, ji: int) -> np.ndarray:
    """[strategy of c_1, strategy of c_i]: 1 where both take the parameter alike."""

    def placements(s, j):
        return s.inputs[j] if j < len(s.inputs) else None

    return np.array(
        [[float(placements(s, j1) == placements(t, ji)) for t in later] for s in first]
    ).reshape(len(first), len(later))


def _pair(first: Sequence, j1: int, later: Sequence, ji: int, meta, pricer) -> tuple:
    """(pair matrix [strategy of c_1, strategy of c_i], the later use's bucketed price per
    strategy): the module docstring's charge."""
    bucketed_1, in_graph_1 = _prices(first, j1, meta, pricer)
    bucketed_i, in_graph_i = _prices(later, ji, meta, pricer)
    same = _same_placements(first, j1, later, ji)
    pair = np.zeros((len(first), len(later)))
    for a in range(bucketed_i.shape[1]):
        partial_1, partial_i = bucketed_1[:, a] > 0, bucketed_i[:, a] > 0
        if not (partial_1.any() or partial_i.any()):
            continue
        agree = same * partial_1[:, None] * partial_i[None, :]
        top_up = (in_graph_1[:, a] - bucketed_1[:, a])[:, None]
        pair += (1.0 - agree) * (in_graph_i[None, :, a] + top_up)
    return pair, bucketed_i.sum(axis=1)


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
                pair, own = _pair(first.strategies, j1, later.strategies, ji, meta, pricer)
                pair_memo[key] = pair
                node_memo[(*key, "node")] = own
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
