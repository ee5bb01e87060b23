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
  the placement it takes, and the parameter is not too big to move (its bytes, divided over
  the axes on which the chain node's gradient-carrying input is split, at most
  ``CARRY_EXTRA_BYTES`` more than the value's: :func:`carry_too_big`): the
  parameter's bucketed share on ``a`` (``grad_sync_s`` of those bytes);
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
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from autopar.placement import is_replicate
from autopar.planner.pricing import CommPricer
from autopar.strategies import input_nodes
from autopar.strategies.registry import tensor_meta

__all__ = [
    "CARRY_EXTRA_BYTES",
    "allowed_carried_axes",
    "carry_too_big",
    "carried_partial_axes",
    "chain_edges",
    "chain_roots",
    "price_chain_grads",
]


CARRY_EXTRA_BYTES = 4 * 2**20
"""How many more bytes than the value's the parameter's gradient may add to the buckets when
its reduction moves there: about what one collective's latency is worth at its link's
bandwidth (a gloo all-reduce's milliseconds at about 1 GB/s, NVLink's 10-20 us at 200-400
GB/s). A position table of 1024 x 768 fp32 (3 MiB) read 64 rows at a time moves; a 128k-row
token embedding does not."""


def carry_too_big(param_bytes: float, value_bytes: float) -> bool:
    """Whether summing the parameter's gradient (``param_bytes`` here) in the buckets would cost
    more than all-reducing the value's (``value_bytes``) where it appears: more than
    :data:`CARRY_EXTRA_BYTES` more bytes (module docstring)."""
    return param_bytes > value_bytes + CARRY_EXTRA_BYTES


def chain_roots(
    gm: fx.GraphModule, param_names, buffer_names
) -> dict[fx.Node, tuple[fx.Node, int]]:
    """Chain node -> (its parameter placeholder, the input position of its gradient-carrying
    input): a call with one tensor output whose one input that may carry a gradient is a
    parameter or a chain node. Any floating input but a buffer may carry a gradient (a
    pipeline stage's activation input does). An embedding with sparse gradients is none. The
    lowering (``lowering.param_chains``) and the pricing here share this definition."""
    from autopar.planner.space import grad_nodes

    sources = {
        n.name
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and n.name not in buffer_names
        and isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].is_floating_point()
    }
    carriers = grad_nodes(gm, sources)
    roots: dict[fx.Node, tuple[fx.Node, int]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.name not in carriers:
            continue
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if node.target is torch.ops.aten.embedding.default and len(node.args) > 4 and node.args[4]:
            continue  # sparse gradients
        carried = [(j, n) for j, n in enumerate(input_nodes(node)) if n.name in carriers]
        if len(carried) != 1:
            continue
        j, source = carried[0]
        if source.op == "placeholder" and source.name in param_names:
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


def _split(strategy, carried: int, shape) -> int:
    """Over how many devices the chain node's carried input is split (the parameter's share
    of it: its layout where the parameter feeds the node directly)."""
    held = strategy.inputs[carried] if carried < len(strategy.inputs) else None
    return math.prod(shape[b] for b, p in enumerate(held or ()) if not is_replicate(p))


def _movable(
    strategies: Sequence, carried: int, param_bytes: float, value_meta, shape
) -> np.ndarray:
    """[chain node strategy, mesh axis]: whether the lowering may move the reduction of a
    Partial gradient on the axis to the parameter: the strategy's tensor inputs all Replicate
    there, and the parameter not too big to move (:func:`carry_too_big`)."""
    from autopar.planner.space import local_bytes

    movable = np.zeros((len(strategies), len(shape)), dtype=bool)
    for s, strategy in enumerate(strategies):
        if carried >= len(strategy.inputs) or strategy.inputs[carried] is None:
            continue
        if carry_too_big(
            param_bytes / _split(strategy, carried, shape),
            local_bytes(value_meta, strategy.outputs[0], shape),
        ):
            continue
        for a in range(len(shape)):
            if shape[a] > 1 and all(p is None or is_replicate(p[a]) for p in strategy.inputs):
                movable[s, a] = True
    return movable


def _chain_terms(node: fx.Node, roots: dict) -> tuple[float, int, Any, Any]:
    """(the parameter's global bytes, the carried input's position, the value's meta, the
    parameter placeholder) of chain node ``node``."""
    param, carried = roots[node]
    param_meta = tensor_meta(param.meta["val"])
    # A parameter's gradient keeps its dtype (as ``_op_space`` prices it).
    param_bytes = float(math.prod(param_meta.shape)) * param_meta.dtype.itemsize
    return param_bytes, carried, tensor_meta(node.meta["val"]), param


def price_chain_grads(
    gm: fx.GraphModule,
    nodes: Sequence,
    index: dict[str, int],
    edges: list,
    pricer: CommPricer,
    needs_grad,
    captured,
    signatures: dict[str, tuple],
) -> int:
    """Move the price of each chain node's Partial gradient from its consumer's
    ``grad_comm_s`` onto their data edge (module docstring), where some pair of strategies
    moves the reduction; never in place (arrays are shared by repeated layers). A consumer
    whose signature another node shares keeps its price: layer tying (``tying``) takes nodes
    of one signature to cost the same, and a first layer repriced alone would no longer tie
    (measured: llama-8l-2048's budget row went from 7.7 s to 141 s, 139,369 variables). There
    the whole all-reduce stays priced, above what the lowering issues. Returns the number of
    edges repriced."""
    roots = {
        k: v
        for k, v in chain_roots(gm, captured.param_nodes, captured.buffer_nodes).items()
        if k.name in needs_grad
    }
    shape = pricer.mesh.shape
    if not roots:
        return 0
    data_edges = {(e.src, e.dst, e.input_index): e for e in edges if e.input_index >= 0}
    sharing = Counter(signatures.values())
    replaced: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    repriced = 0
    for node in gm.graph.nodes:
        dst = index.get(node.name)
        if dst is None or nodes[dst].kind != "op":
            continue
        for j, inp in enumerate(input_nodes(node)):
            edge = data_edges.get((index.get(inp.name), dst, j))
            if inp not in roots or edge is None or sharing[signatures.get(node.name)] > 1:
                continue
            consumer, producer = nodes[dst], nodes[edge.src]
            whole = _activation_prices(consumer.strategies, j, tensor_meta(inp.meta["val"]), pricer)
            if not whole.any():
                continue
            param_bytes, carried, value_meta, _ = _chain_terms(inp, roots)
            movable = _movable(producer.strategies, carried, param_bytes, value_meta, shape)
            if not movable[:, whole.any(axis=0)].any():
                continue  # reduced where it appears whatever the layouts: priced so already
            shares = np.array(
                [
                    [
                        pricer.grad_sync_s(param_bytes / _split(ps, carried, shape), a)
                        for a in range(len(shape))
                    ]
                    for ps in producer.strategies
                ]
            ).reshape(len(producer.strategies), len(shape))
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
                can = (same * movable[:, a][:, None] * partial[None, :]) > 0
                moved = np.where(can, shares[:, a][:, None], whole[None, :, a])
                matrix += moved
            key = (id(consumer.grad_comm_s), id(consumer.strategies), j, inp.meta["val"].shape)
            if key not in replaced:  # the entry keeps the replaced array (and its id) alive
                before = consumer.grad_comm_s
                replaced[key] = (before, np.maximum(before - whole.sum(axis=1), 0.0))
            consumer.grad_comm_s = replaced[key][1]
            edge.cost_s = edge.cost_s + matrix
            repriced += 1
    return repriced


def chain_edges(space) -> list[tuple[Any, int, int, np.ndarray]]:
    """``(data edge, consumer input position, parameter node index, movable)`` for every edge
    out of a chain node (an alias counts for its original; ``movable`` as :func:`_movable`,
    per strategy of the chain node). Memoised in the space's evaluation cache."""
    cache = space.evaluation_cache
    out = cache.get("chain_edges")
    if out is None:
        gm, captured, shape = space.captured.gm, space.captured, space.mesh.shape
        needs = space.needs_grad
        roots = {
            n: r
            for n, r in chain_roots(gm, captured.param_nodes, captured.buffer_nodes).items()
            if needs is None or n.name in needs
        }
        by_name = {n.name: n for n in roots}
        out = []
        for edge in space.edges:
            node = by_name.get(space.nodes[edge.src].name)
            if edge.input_index < 0 or node is None:
                continue
            param_bytes, carried, value_meta, param = _chain_terms(node, roots)
            if param.name not in space.index:
                continue
            owner = space.index[space.nodes[space.index[param.name]].alias_of or param.name]
            movable = _movable(
                space.nodes[edge.src].strategies, carried, param_bytes, value_meta, shape
            )
            out.append((edge, edge.input_index, owner, movable))
        cache["chain_edges"] = out
    return out


def carried_partial_axes(space, choice) -> dict[int, set[int]]:
    """Per parameter node: the mesh axes on which the lowering reduces its gradient because a
    chain from it carries a Partial gradient back under ``choice`` (as priced above)."""
    shape, nodes = space.mesh.shape, space.nodes
    out: dict[int, set[int]] = {}
    for edge, j, owner, movable in chain_edges(space):
        s = choice[edge.src]
        produced, taken = (
            nodes[edge.src].strategies[s],
            nodes[edge.dst].strategies[choice[edge.dst]],
        )
        grad = taken.input_grads[j] if j < len(taken.input_grads) else None
        if grad is None or produced.outputs[0] != taken.inputs[j]:
            continue
        for a, p in enumerate(grad):
            if p.is_partial() and shape[a] > 1 and movable[s, a]:
                out.setdefault(owner, set()).add(a)
    return out


def allowed_carried_axes(space, allowed) -> dict[int, set[int]]:
    """Per parameter node: the mesh axes on which some allowed strategy of a chain node's
    consumer leaves the chain a Partial gradient (``zero_pricing.allowed_partial_axes``)."""
    shape, nodes = space.mesh.shape, space.nodes
    out: dict[int, set[int]] = {}
    for edge, j, owner, _ in chain_edges(space):
        dst = nodes[edge.dst]
        idx = allowed.get(dst.name) if allowed else None
        for t in range(len(dst.strategies)) if idx is None else idx:
            grads = dst.strategies[t].input_grads
            grad = grads[j] if j < len(grads) else None
            if grad is not None:
                out.setdefault(owner, set()).update(
                    a for a, p in enumerate(grad) if p.is_partial() and shape[a] > 1
                )
    return out
