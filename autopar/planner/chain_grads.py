"""A Partial gradient the lowering carries back to its parameter is priced as the parameter's.

``autopar.lowering.param_chains``: where an op reads a value computed from one parameter alone
(a GPT's position embedding ``embedding(wpe, arange)``, a slice of a position table), every op
on the way has its inputs Replicate on a mesh axis ``a``, and the consumer leaves that value a
Partial gradient on ``a`` without converting it, the lowering issues no all-reduce of the
activation's gradient in backward: the parameter's gradient joins the runtime's buckets on
``a`` instead. ``space._op_space`` prices a Partial gradient of an op's input as a whole
all-reduce of the input's bytes; for such inputs this module moves that price onto the data
edge (chain node -> consumer), per pair of strategies:

* the chain node's strategy has every tensor input Replicate on ``a`` and hands the consumer
  the placement it takes: the parameter's bucketed share on ``a`` (``grad_sync_s`` of the
  parameter's bytes, divided over the axes on which the chain node's gradient-carrying input is
  split);
* otherwise: the whole all-reduce, as before.

A **chain node** here is the structural part of the lowering's condition (a call with one
tensor output whose one gradient-carrying input is a parameter or a chain node). The rest of
the lowering's condition (every use of the value and of the parameter leaves the gradient
Partial on ``a``) involves several consumers' choices and is not priced: a chain node with a
second use that takes a whole gradient is priced as deferred on its Partial use while the
lowering reduces it in the graph (a price too low by one all-reduce, on models where a value of
one parameter is used both ways; none of the presets).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.fx as fx

from autopar.placement import is_replicate
from autopar.planner.pricing import CommPricer
from autopar.strategies import input_nodes
from autopar.strategies.registry import tensor_meta

__all__ = ["chain_roots", "price_chain_grads"]


def chain_roots(
    gm: fx.GraphModule, param_nodes: dict[str, str], needs_grad
) -> dict[fx.Node, tuple[fx.Node, int]]:
    """Chain node -> (its parameter placeholder, the input position of its gradient-carrying
    input)."""
    roots: dict[fx.Node, tuple[fx.Node, int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in needs_grad:
            continue
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        carried = [(j, n) for j, n in enumerate(input_nodes(node)) if n.name in needs_grad]
        if len(carried) != 1:
            continue
        j, source = carried[0]
        if source.op == "placeholder" and source.name in param_nodes:
            roots[node] = (source, j)
        elif source in roots:
            roots[node] = (roots[source][0], j)
    return roots


def _activation_prices(strategies: Sequence, j: int, meta, pricer: CommPricer) -> np.ndarray:
    """[consumer strategy, mesh axis]: the whole all-reduce ``space._op_space`` prices for the
    Partial gradient of input ``j`` (0 where not Partial)."""
    from autopar.planner.space import local_bytes

    shape = pricer.mesh.shape
    prices = np.zeros((len(strategies), len(shape)))
    scale = pricer.itemsize(meta) / meta.dtype.itemsize
    for t, strategy in enumerate(strategies):
        if j >= len(strategy.input_grads):
            continue
        placements, grad = strategy.inputs[j], strategy.input_grads[j]
        if placements is None or grad is None:
            continue
        nbytes = local_bytes(meta, placements, shape) * scale
        for a, p in enumerate(grad):
            if p.is_partial() and shape[a] > 1:
                prices[t, a] = pricer.all_reduce_s(nbytes, a)
    return prices


def _deferred_prices(
    strategies: Sequence, carried: int, param_bytes: float, pricer: CommPricer
) -> np.ndarray:
    """[chain node strategy, mesh axis]: the parameter's bucketed share where the strategy's
    tensor inputs are all Replicate on the axis; -1 where they are not."""
    shape = pricer.mesh.shape
    prices = np.full((len(strategies), len(shape)), -1.0)
    for s, strategy in enumerate(strategies):
        held = strategy.inputs[carried] if carried < len(strategy.inputs) else None
        if held is None:
            continue
        split = math.prod(shape[b] for b, p in enumerate(held) if not is_replicate(p))
        for a in range(len(shape)):
            if shape[a] > 1 and all(p is None or is_replicate(p[a]) for p in strategy.inputs):
                prices[s, a] = pricer.grad_sync_s(param_bytes / split, a)
    return prices


def price_chain_grads(
    gm: fx.GraphModule,
    nodes: Sequence,
    index: dict[str, int],
    edges: list,
    pricer: CommPricer,
    needs_grad,
    param_nodes: dict[str, str],
) -> int:
    """Move the price of each chain node's Partial gradient from its consumer's
    ``grad_comm_s`` onto their data edge (module docstring); never in place (arrays are shared
    by repeated layers). Returns the number of edges repriced."""
    roots = chain_roots(gm, param_nodes, needs_grad)
    if not roots:
        return 0
    data_edges = {(e.src, e.dst, e.input_index): e for e in edges if e.input_index >= 0}
    replaced: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    repriced = 0
    for node in gm.graph.nodes:
        dst = index.get(node.name)
        if dst is None or nodes[dst].kind != "op":
            continue
        for j, inp in enumerate(input_nodes(node)):
            edge = data_edges.get((index.get(inp.name), dst, j))
            if inp not in roots or edge is None:
                continue
            consumer, producer = nodes[dst], nodes[edge.src]
            whole = _activation_prices(consumer.strategies, j, tensor_meta(inp.meta["val"]), pricer)
            if not whole.any():
                continue
            param, carried = roots[inp]
            param_meta = tensor_meta(param.meta["val"])
            # A parameter's gradient keeps its dtype (as ``_op_space`` prices it).
            param_bytes = float(math.prod(param_meta.shape)) * param_meta.dtype.itemsize
            deferred = _deferred_prices(producer.strategies, carried, param_bytes, pricer)
            same = np.array(
                [
                    [float(s.outputs[0] == t.inputs[j]) for t in consumer.strategies]
                    for s in producer.strategies
                ]
            ).reshape(len(producer.strategies), len(consumer.strategies))
            matrix = np.zeros_like(same)
            for a in range(whole.shape[1]):
                partial = whole[:, a] > 0
                if not partial.any():
                    continue
                can = (same * (deferred[:, a] >= 0)[:, None] * partial[None, :]) > 0
                moved = np.where(can, np.maximum(deferred[:, a], 0.0)[:, None], whole[None, :, a])
                matrix += moved
            key = (id(consumer.grad_comm_s), id(consumer.strategies), j, inp.meta["val"].shape)
            if key not in replaced:  # the entry keeps the replaced array (and its id) alive
                before = consumer.grad_comm_s
                replaced[key] = (before, np.maximum(before - whole.sum(axis=1), 0.0))
            consumer.grad_comm_s = replaced[key][1]
            edge.cost_s = edge.cost_s + matrix
            repriced += 1
    return repriced
