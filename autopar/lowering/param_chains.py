"""Partial gradients carried back through ops on one parameter, to the parameter.

A GPT's position embedding ``wpe(arange(T))`` under data parallelism: the lookup's indices and
the table are replicated, so its output is the same on every rank; the ``add`` that broadcasts
it over the batch-sharded token embeddings leaves that output a Partial gradient (each rank
summed its own batch rows). Reduced where it appears, that is an all-reduce of the ``[T, E]``
activation gradient inside backward, one collective more than DDP issues (DDP sums
``wpe.weight.grad`` in its buckets). A backward is linear in the output gradient, and an op
whose inputs are replicated over a mesh axis applies the same map on every rank of it: the sum
over those ranks of the parameter gradients each computes from its summand IS the parameter
gradient of the sum. So the reduction can move to the parameter and join the runtime's buckets
(or ZeRO's reduce-scatter).

A **parameter chain node** is a call with one tensor output and exactly one input that may
carry a gradient (a value computed from a parameter, or from a floating input that is not a
buffer: a pipeline stage's activation input brings the next stage's gradient), that input
being a parameter or another chain node (the table of an
``embedding``, the tensor of a view, a cast, a ``tanh``; other inputs are indices or
constants); the edge into it converts nothing, and only the first node of a chain may leave a
Partial gradient on its parameter. The chain nodes from one parameter form a tree, so every
gradient reaching one comes through its own uses.

``passable(N)``: the mesh axes over which ``N``'s output gradient may stay Partial back to the
parameter: those on which every tensor input of ``N`` is Replicate, and every use of ``N``
either is a chain node whose own ``passable`` has the axis, or leaves a Partial gradient there
without converting ``N``'s output. A use the edges do not list (the graph's output) empties
it: a whole gradient added to summands would be counted once per rank.

:meth:`ParamChains.chain_grad_axes` gives a parameter edge's axes to add to its Partial ones
(those ``deferred_param_axes`` intersects over the parameter's uses), and
:meth:`ParamChains.skipped_axes` the axes whose in-graph reduction the conversions then leave
out on every edge out of a chain node: the parameter's deferred axes within the first chain
node's ``passable`` (which every later node's ``passable`` contains).

The moved reduction is of the parameter's size, not the value's (a 1024-row position table
read 64 rows at a time sums 16x the bytes); in the buckets it costs no collective of its own
(DDP pays the same). It moves only where the parameter's local bytes exceed the value's by at
most ``CARRY_EXTRA_BYTES`` (``planner.chain_grads.carry_too_big``, which holds the rule and
prices with it; a chain node failing it passes nothing): a large table read a few rows at a
time (a token embedding whose tokens are replicated) keeps its value's all-reduce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch.fx as fx

from autopar.placement import is_replicate
from autopar.planner.chain_grads import carry_too_big, chain_roots
from autopar.planner.space import local_bytes
from autopar.strategies.registry import Strategy, input_nodes, tensor_meta

if TYPE_CHECKING:
    from autopar.lowering.conversions import Edge

__all__ = ["ParamChains", "param_chains"]


class ParamChains:
    """The parameter chain nodes of one graph, with their roots and ``passable`` axes."""

    def __init__(self) -> None:
        self.root: dict[fx.Node, fx.Node] = {}
        """Chain node -> the parameter placeholder it starts from."""
        self.first: dict[fx.Node, fx.Node] = {}
        """Chain node -> the chain node the parameter feeds directly, on its path."""
        self.passable: dict[fx.Node, frozenset[int]] = {}

    def chain_grad_axes(self, edge: Edge) -> frozenset[int]:
        """Axes on which the parameter edge ``edge`` (parameter -> consumer) receives a Partial
        gradient through a chain (none when its consumer starts no chain)."""
        if self.root.get(edge.consumer) is edge.producer:
            return self.passable[edge.consumer]
        return frozenset()

    def skipped_axes(
        self,
        producer: fx.Node,
        deferred: Mapping[str, tuple[int, ...]],
        param_fqn: Mapping[str, str],
    ) -> frozenset[int]:
        """Axes whose in-graph reduction is left out on the edges out of ``producer``."""
        root = self.root.get(producer)
        if root is None:
            return frozenset()
        return self.passable[self.first[producer]] & frozenset(
            deferred.get(param_fqn[root.name], ())
        )


def param_chains(
    gm: fx.GraphModule,
    edges: Sequence[Edge],
    strategies: Mapping[fx.Node, Strategy],
    param_names: set[str],
    buffer_names: set[str],
    mesh_shape: tuple[int, ...],
) -> ParamChains:
    """Find the parameter chain nodes of ``gm``'s graph (module docstring; their structure is
    ``planner.chain_grads.chain_roots``, shared with the pricing)."""
    chains = ParamChains()
    into: dict[fx.Node, list[Edge]] = {}
    out_of: dict[fx.Node, list[Edge]] = {}
    for edge in edges:
        into.setdefault(edge.consumer, []).append(edge)
        out_of.setdefault(edge.producer, []).append(edge)
    for node, (root, carried) in chain_roots(gm, param_names, buffer_names).items():
        if node not in strategies or len(strategies[node].outputs) != 1:
            continue
        source = input_nodes(node)[carried]
        if source is root:
            first = node
        elif source in chains.first:
            first = chains.first[source]
        else:
            continue
        edge = next((e for e in into.get(node, ()) if e.producer is source), None)
        if edge is None or edge.src != edge.dst or (edge.partial_axes and first is not node):
            continue
        chains.root[node] = root
        chains.first[node] = first
    for node in reversed(list(chains.root)):
        passable = _passable(node, strategies[node], out_of.get(node, []), chains)
        param = chains.root[node]
        if passable and carry_too_big(
            local_bytes(tensor_meta(param.meta["val"]), strategies[param].outputs[0], mesh_shape),
            local_bytes(tensor_meta(node.meta["val"]), strategies[node].outputs[0], mesh_shape),
        ):
            passable = frozenset()
        chains.passable[node] = passable
    return chains


def _passable(
    node: fx.Node, strategy: Strategy, uses: Sequence[Edge], chains: ParamChains
) -> frozenset[int]:
    if not uses or {e.consumer for e in uses} != set(node.users):
        return frozenset()
    axes: set[int] | None = None
    for edge in uses:
        if edge.src != edge.dst:
            return frozenset()
        if chains.root.get(edge.consumer) is not None and edge.consumer in chains.passable:
            these = set(chains.passable[edge.consumer])
        else:
            these = set(edge.partial_axes)
        axes = these if axes is None else axes & these
    replicated = {
        a for a in axes or () if all(p is None or is_replicate(p[a]) for p in strategy.inputs)
    }
    return frozenset(replicated)
