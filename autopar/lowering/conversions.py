"""The conversions ``lower`` inserts: resharding on edges, gradient all-reduces, outputs.

:func:`collect_edges` lists every (producer output -> consumer input) edge of a graph with the
layouts on both ends and the axes on which the consumer leaves a Partial gradient;
:func:`deferred_param_axes` picks the parameter gradients the runtime may sum after backward;
:func:`insert_conversions` and :func:`convert_outputs` insert the forward steps of
:func:`autopar.resharding.steps.reshard_steps` as calls of the autograd-aware collectives of
:mod:`autopar.comm.collectives`. The rules (when a conversion is shared, when a parameter's
reduction is deferred, DDP's convention for sharded outputs) are stated in
:mod:`autopar.lowering.rewrite`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.comm import collectives
from autopar.lowering.local_ops import autopar_scale_grad, emit_steps, itemsize, shape_of
from autopar.lowering.param_chains import ParamChains
from autopar.placement import Placements, Shard, replicated
from autopar.resharding.steps import Step, reshard_steps
from autopar.strategies.registry import Strategy, input_nodes

__all__ = [
    "Edge",
    "collect_edges",
    "convert_outputs",
    "deferred_param_axes",
    "insert_conversions",
    "producer_placements",
    "requires_grad_nodes",
]


@dataclass(slots=True)
class Edge:
    """One (producer output -> consumer input ``slot``) edge and the conversion it needs."""

    consumer: fx.Node
    slot: int
    producer: fx.Node
    tensor: fx.Node
    """The node whose global value is converted (the getitem itself for a tuple element)."""
    src: Placements
    dst: Placements
    partial_axes: tuple[int, ...]


def requires_grad_nodes(graph: fx.Graph, param_names: set[str]) -> set[fx.Node]:
    """Nodes whose value depends on a parameter (so gradients flow through them)."""
    needs: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in param_names:
                needs.add(node)
        elif any(inp in needs for inp in node.all_input_nodes):
            val = node.meta.get("val")
            if (
                not isinstance(val, torch.Tensor)
                or val.dtype.is_floating_point
                or val.dtype.is_complex
            ):
                needs.add(node)
    return needs


def producer_placements(node: fx.Node, strategies: Mapping[fx.Node, Strategy]) -> Placements:
    outputs = strategies[node].outputs
    if len(outputs) != 1 or outputs[0] is None:
        raise AssertionError(
            f"node {node.name} has {len(outputs)} outputs; its tensor consumers must index it with getitem"
        )
    return outputs[0]


def _replace_input(node: fx.Node, slot: int, value: fx.Node) -> None:
    """Replace the ``slot``-th fx.Node leaf of (args, kwargs) by ``value`` (handles x op x)."""
    leaves, spec = tree_flatten((node.args, node.kwargs))
    seen = -1
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, fx.Node):
            seen += 1
            if seen == slot:
                leaves[i] = value
                break
    args, kwargs = tree_unflatten(leaves, spec)
    node.args = tuple(args)
    node.kwargs = dict(kwargs)


def collect_edges(
    graph: fx.Graph, strategies: Mapping[fx.Node, Strategy], requires_grad: set[fx.Node]
) -> list[Edge]:
    """Every (producer -> consumer input) edge with its layouts and partial-gradient axes."""
    edges: list[Edge] = []
    for node in graph.nodes:
        if node.op != "call_function" or node not in strategies:
            continue
        strategy = strategies[node]
        inputs = input_nodes(node)
        if len(strategy.inputs) != len(inputs):
            raise ValueError(
                f"strategy for {node.name} describes {len(strategy.inputs)} inputs but the node has {len(inputs)}"
            )
        for slot, producer in enumerate(inputs):
            dst = strategy.inputs[slot]
            if dst is None:
                continue
            if node.target is operator.getitem:
                src = strategies[producer].outputs[int(node.args[1])]
            else:
                src = producer_placements(producer, strategies)
            assert src is not None, (node.name, producer.name)
            grads = strategy.input_grads[slot] if slot < len(strategy.input_grads) else None
            partial_axes: tuple[int, ...] = ()
            if grads is not None and producer in requires_grad:
                partial_axes = tuple(a for a, p in enumerate(grads) if p.is_partial())
            tensor = node if node.target is operator.getitem else producer
            edges.append(Edge(node, slot, producer, tensor, tuple(src), tuple(dst), partial_axes))
    return edges


def deferred_param_axes(
    edges: Sequence[Edge],
    param_fqn: Mapping[str, str],
    num_axes: int,
    chains: ParamChains,
) -> dict[str, tuple[int, ...]]:
    """Axes over which the runtime may sum a parameter's gradient after backward: those on
    which EVERY use leaves a Partial gradient, directly or through a chain of ops on the
    parameter alone (:mod:`autopar.lowering.param_chains`), for parameters no use converts."""
    uses: dict[str, list[Edge]] = {}
    for edge in edges:
        if edge.producer.op == "placeholder" and edge.producer.name in param_fqn:
            uses.setdefault(param_fqn[edge.producer.name], []).append(edge)
    deferred: dict[str, tuple[int, ...]] = {}
    for fqn, param_edges in uses.items():
        if any(e.src != e.dst for e in param_edges):
            continue
        common = set(range(num_axes))
        for e in param_edges:
            common &= set(e.partial_axes) | chains.chain_grad_axes(e)
        if common:
            deferred[fqn] = tuple(sorted(common))
    return deferred


def insert_conversions(
    graph: fx.Graph,
    edges: Sequence[Edge],
    deferred: Mapping[str, tuple[int, ...]],
    param_fqn: Mapping[str, str],
    mesh_shape: tuple[int, ...],
    group_key: str,
    chains: ParamChains,
) -> None:
    converted: dict[tuple[fx.Node, Placements, tuple[int, ...]], fx.Node] = {}
    actual: dict[fx.Node, fx.Node] = {}  # getitem node -> the value holding its declared layout
    for edge in edges:
        node = edge.consumer
        axes = edge.partial_axes
        if edge.producer.op == "placeholder" and edge.producer.name in param_fqn:
            skip = deferred.get(param_fqn[edge.producer.name], ())
            axes = tuple(a for a in axes if a not in skip)
        elif axes:
            skip = chains.skipped_axes(edge.producer, deferred, param_fqn)
            axes = tuple(a for a in axes if a not in skip)
        if node.target is operator.getitem:
            # The element keeps the layout of its tuple slot; convert it after indexing.
            if edge.src != edge.dst or axes:
                users = list(node.users)
                with graph.inserting_before(node.next):
                    value = _convert(graph, node, edge, axes, mesh_shape, group_key)
                for user in users:
                    user.replace_input_with(node, value)
                actual[node] = value
            continue
        if edge.src == edge.dst and not axes:
            continue
        key = (edge.producer, edge.dst, axes)
        value = converted.get(key)
        if value is None:
            with graph.inserting_before(node):
                source = actual.get(edge.producer, edge.producer)
                value = _convert(graph, source, edge, axes, mesh_shape, group_key)
            converted[key] = value
        _replace_input(node, edge.slot, value)


def convert_outputs(
    graph: fx.Graph,
    output_node: fx.Node,
    output_src: Sequence[Placements],
    output_placements: Sequence[Placements] | None,
    mesh_shape: tuple[int, ...],
    group_key: str,
) -> tuple[Placements, ...]:
    leaves, spec = tree_flatten(output_node.args[0])
    if output_placements is None:
        out_placements = tuple(replicated(len(mesh_shape)) for _ in output_src)
    else:
        out_placements = tuple(tuple(p) for p in output_placements)
        if len(out_placements) != len(output_src):
            raise ValueError(
                f"output_placements has {len(out_placements)} entries but the model returns "
                f"{len(output_src)} tensors"
            )
    new_leaves = []
    k = 0
    for leaf in leaves:
        if isinstance(leaf, fx.Node):
            src, dst = output_src[k], out_placements[k]
            k += 1
            if src != dst:
                tensor = _shape_source(leaf)
                fwd, _ = reshard_steps(src, dst, shape_of(tensor), itemsize(tensor), mesh_shape)
                with graph.inserting_before(output_node):
                    leaf = emit_steps(graph, leaf, fwd, group_key)
            num_shards = math.prod(m for m, p in zip(mesh_shape, dst) if isinstance(p, Shard))
            if num_shards > 1:
                # DDP's convention for a loss computed on local outputs: mean over the shards.
                with graph.inserting_before(output_node):
                    leaf = graph.call_function(autopar_scale_grad, (leaf, 1.0 / num_shards))
        new_leaves.append(leaf)
    output_node.args = (tree_unflatten(new_leaves, spec),)
    return out_placements


def _shape_source(node: fx.Node) -> fx.Node:
    """The node carrying the global shape of ``node``'s value (walks back over inserted
    collectives, which have no shape metadata and take their tensor as first argument)."""
    while "val" not in node.meta:
        node = node.args[0]
    return node


def _convert(
    graph: fx.Graph,
    value: fx.Node,
    edge: Edge,
    axes: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    group_key: str,
) -> fx.Node:
    """Steps ``edge.src -> edge.dst`` on ``value``, then a GradAllReduce over ``axes``, at the
    graph's current insertion point."""
    fwd: tuple[Step, ...] = ()
    if edge.src != edge.dst:
        fwd, _ = reshard_steps(
            edge.src, edge.dst, shape_of(edge.tensor), itemsize(edge.tensor), mesh_shape
        )
    return _emit_with_grad_reduce(graph, value, fwd, axes, group_key)


def _emit_with_grad_reduce(
    graph: fx.Graph, value: fx.Node, fwd: Sequence[Step], axes: tuple[int, ...], group_key: str
) -> fx.Node:
    value = emit_steps(graph, value, fwd, group_key)
    if axes:
        value = graph.call_function(collectives.autopar_grad_all_reduce, (value, group_key, axes))
    return value
