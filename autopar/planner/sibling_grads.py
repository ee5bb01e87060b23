"""An activation read alike by several ops has its Partial gradient all-reduced once.

``space._op_space`` prices, per consumer strategy, a whole all-reduce of each Partial gradient
of the consumer's activation inputs. The lowering issues fewer: it inserts one conversion per
(producer, placements the consumer takes, Partial axes of the gradient)
(``lowering.conversions.insert_conversions``), so where several consumers take one value
alike and leave its gradient Partial on the same axes -- a LLaMA block's q, k and v
projections, and its w1 and w3, reading one normed activation column-parallel -- autograd sums
their gradients into one ``GradAllReduce``, whose backward all-reduces once. Priced per
consumer, a LLaMA layer's tensor-parallel backward paid five all-reduces where the runtime
issues two: megatron on the benchmark LLaMA over 2x2 was priced 28 ms of its 187 ms above the
collectives it issues, and measured 157-161 ms (README "Session 30").

The saving depends on several consumers' choices. The plan's figures
(:func:`autopar.planner.evaluation_sums.zero_free_sums`, so every predicted step) count the
all-reduces the lowering issues: per producer, a consumer whose (placements, axes) an earlier
consumer of the same producer already took is not charged again. The solver's objective keeps
the per-consumer price: an exact pair term between siblings (as ``shared_grads`` adds for a
parameter's uses) would join every layer's siblings in triangles on the graph the elimination
runs on, at 80 layers for a 70B model; so the solver may price a plan whose siblings share a
reduction above its figures, never below. Where a recipe's figures then come out below the
auto plan's, the driver's margin rule (``auto_margin``) keeps the recipe.

A producer that is a chain node (``chain_grads``: a value computed from one parameter, whose
Partial gradient may join the parameter's buckets) is left out: its consumers' prices were
moved onto their data edges there. A ``getitem`` consumer converts after indexing, one
conversion per ``getitem``: not shared either.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch.fx as fx

from autopar.planner.pricing import CommPricer
from autopar.strategies import input_nodes
from autopar.strategies.registry import tensor_meta

__all__ = ["SiblingUse", "shared_grad_saving", "sibling_uses"]

SiblingUse = tuple[int, tuple[Any, ...], np.ndarray]
"""(consumer node index, per strategy the conversion's key -- (placements, Partial axes), None
where the gradient is not Partial -- and per strategy the all-reduce priced for that input)."""


def _prices(strategies: Sequence, j: int, meta, pricer: CommPricer) -> tuple[tuple, np.ndarray]:
    """Per strategy of a consumer reading an activation as input ``j``: the lowering's key of
    the conversion and the all-reduces ``space._op_space`` prices for the Partial gradient."""
    from autopar.planner.space import activation_grad_s, partial_axes

    keys: list[Any] = []
    prices = np.zeros(len(strategies))
    for t, strategy in enumerate(strategies):
        placements = strategy.inputs[j] if j < len(strategy.inputs) else None
        grad = strategy.input_grads[j] if j < len(strategy.input_grads) else None
        axes = partial_axes(grad or (), pricer.mesh.shape)
        if placements is None or not axes:
            keys.append(None)
            continue
        prices[t] = activation_grad_s(meta, placements, grad, pricer)
        keys.append((tuple(placements), axes))
    return tuple(keys), prices


def sibling_uses(
    gm: fx.GraphModule,
    nodes: Sequence,
    index: dict[str, int],
    pricer: CommPricer,
    needs_grad,
    chain_nodes: frozenset[str],
) -> tuple[tuple[SiblingUse, ...], ...]:
    """Per activation producer read by two or more op inputs that may leave its gradient
    Partial (module docstring), those uses in graph order."""
    uses: dict[str, list[SiblingUse]] = {}
    memo: dict[tuple, tuple[tuple, np.ndarray]] = {}
    for node in gm.graph.nodes:
        k = index.get(node.name)
        if k is None or nodes[k].kind != "op" or node.target is operator.getitem:
            continue
        for j, inp in enumerate(input_nodes(node)):
            if inp.op == "placeholder" or inp.name not in needs_grad or inp.name in chain_nodes:
                continue
            if inp.name not in index or "val" not in inp.meta:
                continue
            meta = tensor_meta(inp.meta["val"])
            key = (id(nodes[k].strategies), j, meta)
            if key not in memo:
                memo[key] = _prices(nodes[k].strategies, j, meta, pricer)
            keys, prices = memo[key]
            if prices.any():
                uses.setdefault(inp.name, []).append((k, keys, prices))
    return tuple(tuple(group) for group in uses.values() if len(group) > 1)


def shared_grad_saving(
    groups: Sequence[Sequence[SiblingUse]], choice: Sequence[int]
) -> dict[int, float]:
    """Per consumer node under ``choice``: the seconds its priced all-reduces exceed what the
    lowering issues (a later use whose conversion an earlier use of the producer made)."""
    saving: dict[int, float] = {}
    for group in groups:
        taken: set = set()
        for k, keys, prices in group:
            key = keys[choice[k]]
            if key is None:
                continue
            if key in taken:
                saving[k] = saving.get(k, 0.0) + float(prices[choice[k]])
            taken.add(key)
    return saving
