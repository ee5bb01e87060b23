"""Lowering: a captured graph plus one chosen Strategy per node -> a graph on local shards.

``lower`` rewrites a copy of ``Captured.gm`` so that every rank runs it on its own shards:

* **Edges.** For every edge (producer output -> consumer input ``j``) whose producer placement
  differs from the placement the consumer's strategy requires, the forward steps of
  :func:`autopar.resharding.steps.reshard_steps` are inserted as calls of the autograd-aware
  collectives in :mod:`autopar.comm.collectives` (their backward follows the gradient
  convention). A conversion needed by several consumers is inserted once. ``operator.getitem``
  consumers of a tuple-producing node index into the producer's outputs, and their conversion is
  applied to the element (after the getitem).
* **Partial gradients.** Where a consumer's ``input_grads[j]`` is Partial on axis ``a``, each
  rank's gradient for that input is a summand, so it must be all-reduced over ``a``. For
  activations a ``GradAllReduce`` (identity forward, all-reduce backward) is inserted on the
  consumer's side of the edge. For parameters the reduction is deferred to the runtime's chunked
  gradient reduction (``LoweredGraph.param_grad_reduce_axes``) when that is exact: when EVERY use
  of the parameter leaves a Partial gradient on ``a`` (a use with a whole gradient would be
  counted once per rank by the later sum) and no use converts the parameter (the conversion's
  backward would run before the sum). Other cases are reduced in the graph.
* **Local ops** (:mod:`autopar.lowering.local_ops`): size arguments become local sizes,
  vocab-parallel embeddings a masked local lookup, ``squeeze`` keeps globally non-unit dims, and
  dropout draws rank-aware masks.
* **Outputs** are converted to ``output_placements`` (Replicate by default, so every rank
  returns the single-process value, e.g. the global mean loss). An output the user asks to be
  sharded over ``N`` devices gets DDP's convention (DESIGN.md): the user computes a loss on the
  local block, and the gradient entering the graph is scaled by ``1/N``, so parameter gradients
  are the mean over the shards of the local losses' gradients.

The result's ``gm.print_readable()`` shows collectives as calls such as
``autopar_runtime_collectives_autopar_all_gather(x, 'mesh0', 1, 0)``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.capture.export import ASSERT_OPS
from autopar.comm import collectives
from autopar.lowering.local_ops import (
    autopar_scale_grad,
    emit_steps,
    itemsize,
    rewrite_local_ops,
    shape_of,
)
from autopar.placement import Placements, Shard, format_placements, local_shape, replicated
from autopar.resharding.steps import Step, reshard_steps
from autopar.strategies.registry import Strategy, input_nodes

__all__ = ["LoweredGraph", "PlaceholderSource", "lower"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlaceholderSource:
    """Where the value of one placeholder of the lowered graph comes from."""

    kind: str
    """"param", "buffer" or "input"."""
    fqn: str = ""
    """Parameter or buffer FQN (canonical FQN of a tied parameter)."""
    index: int = -1
    """For "input": position among the flattened user inputs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LoweredGraph:
    """A graph on local shards and what the runtime needs to feed and synchronise it."""

    gm: fx.GraphModule
    """The rewritten graph; placeholders in the captured order (parameters, buffers, inputs)."""
    mesh_shape: tuple[int, ...]
    """Size of each mesh axis."""
    group_key: str
    """Key under which ``AxisGroups`` registered this mesh's process groups."""
    placeholders: tuple[PlaceholderSource, ...]
    """One entry per placeholder of ``gm``, in order."""
    param_placements: dict[str, Placements]
    """Canonical parameter FQN -> placement of its local shard."""
    buffer_placements: dict[str, Placements]
    """Buffer FQN -> placement of its local shard."""
    non_persistent_buffers: frozenset[str]
    """Buffer FQNs that are not part of the model's state dict."""
    param_grad_reduce_axes: dict[str, tuple[int, ...]]
    """Canonical parameter FQN -> mesh axes its gradient must be summed over after backward."""
    tied_params: dict[str, tuple[str, ...]]
    """Canonical parameter FQN -> the other FQNs sharing it."""
    param_use_order: tuple[str, ...]
    """Canonical parameter FQNs in order of first use in forward."""
    input_names: tuple[str, ...]
    """Placeholder name of each flattened user input (for messages)."""
    input_placements: tuple[Placements | None, ...]
    """Placement of each flattened user input (None for non-tensor inputs)."""
    global_input_shapes: tuple[tuple[int, ...] | None, ...]
    """Global shape of each flattened user input (None for non-tensor inputs)."""
    local_input_shapes: tuple[tuple[int, ...] | None, ...]
    """Shape each rank must pass for each flattened user input."""
    output_placements: tuple[Placements, ...]
    """Placement of each flattened output."""
    in_spec: Any
    """pytree spec of the user's (args, kwargs)."""
    out_spec: Any
    """pytree spec of the model's outputs."""


# --------------------------------------------------------------------------------------------
# Conversions


@dataclass(slots=True)
class _Edge:
    consumer: fx.Node
    slot: int
    producer: fx.Node
    tensor: fx.Node
    """The node whose global value is converted (the getitem itself for a tuple element)."""
    src: Placements
    dst: Placements
    partial_axes: tuple[int, ...]


def _requires_grad_nodes(graph: fx.Graph, param_names: set[str]) -> set[fx.Node]:
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


def _producer_placements(node: fx.Node, strategies: Mapping[fx.Node, Strategy]) -> Placements:
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


# --------------------------------------------------------------------------------------------
# lower


def lower(
    captured: Any,
    choices: Mapping[str, Strategy],
    mesh_shape: tuple[int, ...],
    group_key: str,
    *,
    output_placements: Sequence[Placements] | None = None,
    device: torch.device | str | None = None,
) -> LoweredGraph:
    """Rewrite a copy of ``captured.gm`` to run on this rank's local shards.

    Args:
        captured: an ``autopar.capture.export.Captured``.
        choices: node name -> chosen Strategy, for every placeholder (``outputs=(placements,)``)
            and every call_function node of ``captured.gm``.
        mesh_shape: size of each mesh axis.
        group_key: key the runtime's ``AxisGroups`` registered its per-axis groups under; it
            appears as a string argument of every collective call.
        output_placements: placement of each flattened output (default Replicate everywhere).
        device: when given, the ``device=`` argument of every factory call (``arange``,
            ``zeros``, ...) becomes this device, e.g. to run a graph captured on meta tensors.

    Returns:
        The LoweredGraph; ``captured`` is not modified.

    Raises:
        ValueError: a node has no strategy, tied parameters got different placements, or the
            number of output placements is wrong.
    """
    mesh_shape = tuple(int(m) for m in mesh_shape)
    num_axes = len(mesh_shape)
    graph = fx.Graph()
    val_map: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(captured.gm.graph, val_map))
    gm = fx.GraphModule(captured.gm, graph)
    strategies = _strategies_by_node(val_map, choices, num_axes)
    param_fqn, tied = _canonical_param_names(captured)
    inputs = _placeholder_layouts(captured, graph, strategies, param_fqn, mesh_shape)

    edges = _collect_edges(graph, strategies, _requires_grad_nodes(graph, set(param_fqn)))
    deferred = _deferred_param_axes(edges, param_fqn, num_axes)
    param_use_order = tuple(
        dict.fromkeys(
            param_fqn[e.producer.name]
            for e in edges
            if e.producer.op == "placeholder" and e.producer.name in param_fqn
        )
    )
    first_input_shape = {
        node: shape_of(node_inputs[0])
        for node in strategies
        if node.op == "call_function"
        and (node_inputs := input_nodes(node))
        and isinstance(node_inputs[0].meta.get("val"), torch.Tensor)
    }
    output_node = next(n for n in graph.nodes if n.op == "output")
    output_src = [
        _producer_placements(leaf, strategies) if leaf in strategies else replicated(num_axes)
        for leaf in tree_flatten(output_node.args[0])[0]
        if isinstance(leaf, fx.Node)
    ]

    _insert_conversions(graph, edges, deferred, param_fqn, mesh_shape, group_key)
    rewrite_local_ops(graph, strategies, first_input_shape, mesh_shape, group_key)
    if device is not None:
        for node in graph.nodes:
            if node.op == "call_function" and "device" in node.kwargs:
                node.update_kwarg("device", torch.device(device))
    out_placements = _convert_outputs(
        graph, output_node, output_src, output_placements, mesh_shape, group_key
    )

    for node, strategy in strategies.items():
        node.meta["autopar_placements"] = strategy.outputs
    graph.lint()
    gm.recompile()
    call_spec = captured.exported.call_spec
    return LoweredGraph(
        gm=gm,
        mesh_shape=mesh_shape,
        group_key=group_key,
        placeholders=inputs.placeholders,
        param_placements=inputs.param_placements,
        buffer_placements=inputs.buffer_placements,
        non_persistent_buffers=frozenset(
            str(spec.target)
            for spec in captured.exported.graph_signature.input_specs
            if spec.kind == torch.export.graph_signature.InputKind.BUFFER
            and spec.persistent is False
        ),
        param_grad_reduce_axes=deferred,
        tied_params=tied,
        param_use_order=param_use_order,
        input_names=tuple(captured.input_nodes),
        input_placements=inputs.input_placements,
        global_input_shapes=inputs.global_shapes,
        local_input_shapes=inputs.local_shapes,
        output_placements=out_placements,
        in_spec=call_spec.in_spec,
        out_spec=call_spec.out_spec,
    )


def _strategies_by_node(
    val_map: Mapping[fx.Node, fx.Node], choices: Mapping[str, Strategy], num_axes: int
) -> dict[fx.Node, Strategy]:
    """New node -> its Strategy; non-tensor placeholders and constants default to Replicate."""
    strategies: dict[fx.Node, Strategy] = {}
    missing: list[str] = []
    for old, new in val_map.items():
        if old.op == "call_function" and old.target in ASSERT_OPS:
            continue
        strategy = choices.get(old.name)
        if strategy is not None:
            strategies[new] = strategy
        elif old.op == "get_attr" or (
            old.op == "placeholder" and not isinstance(old.meta.get("val"), torch.Tensor)
        ):
            strategies[new] = Strategy(outputs=(replicated(num_axes),), inputs=())
        elif old.op in ("placeholder", "call_function"):
            missing.append(old.name)
    if missing:
        raise ValueError(
            f"no strategy chosen for {len(missing)} node(s): {', '.join(missing[:8])}"
            f"{' ...' if len(missing) > 8 else ''}; pass a choice for every placeholder and call_function node"
        )
    return strategies


def _canonical_param_names(captured: Any) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """(placeholder name -> canonical FQN, canonical FQN -> its tied aliases).

    The canonical FQN of a tied group is the first of its FQNs among the parameter placeholders.
    """
    param_fqn: dict[str, str] = {}
    canonical_of: dict[str, str] = {}
    tied: dict[str, tuple[str, ...]] = {}
    for name, fqn in captured.param_nodes.items():
        group = [fqn, *captured.tied_params.get(fqn, [])]
        canonical = next((canonical_of[f] for f in group if f in canonical_of), fqn)
        for f in group:
            canonical_of.setdefault(f, canonical)
        param_fqn[name] = canonical
        if canonical == fqn:
            tied[canonical] = tuple(f for f in group if f != fqn)
    return param_fqn, tied


@dataclass(frozen=True, kw_only=True, slots=True)
class _PlaceholderLayouts:
    placeholders: tuple[PlaceholderSource, ...]
    param_placements: dict[str, Placements]
    buffer_placements: dict[str, Placements]
    input_placements: tuple[Placements | None, ...]
    global_shapes: tuple[tuple[int, ...] | None, ...]
    local_shapes: tuple[tuple[int, ...] | None, ...]


def _placeholder_layouts(
    captured: Any,
    graph: fx.Graph,
    strategies: Mapping[fx.Node, Strategy],
    param_fqn: Mapping[str, str],
    mesh_shape: tuple[int, ...],
) -> _PlaceholderLayouts:
    placeholders: list[PlaceholderSource] = []
    param_placements: dict[str, Placements] = {}
    buffer_placements: dict[str, Placements] = {}
    input_index = {name: i for i, name in enumerate(captured.input_nodes)}
    num_inputs = len(captured.input_nodes)
    input_placements: list[Placements | None] = [None] * num_inputs
    global_shapes: list[tuple[int, ...] | None] = [None] * num_inputs
    local_shapes: list[tuple[int, ...] | None] = [None] * num_inputs
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        placements = tuple(strategies[node].outputs[0])
        if node.name in param_fqn:
            fqn = param_fqn[node.name]
            previous = param_placements.setdefault(fqn, placements)
            if previous != placements:
                raise ValueError(
                    f"tied parameter {fqn} got two placements ({format_placements(previous)} and "
                    f"{format_placements(placements)}); a shared parameter needs one placement"
                )
            placeholders.append(PlaceholderSource(kind="param", fqn=fqn))
        elif node.name in captured.buffer_nodes:
            fqn = captured.buffer_nodes[node.name]
            buffer_placements[fqn] = placements
            placeholders.append(PlaceholderSource(kind="buffer", fqn=fqn))
        else:
            index = input_index[node.name]
            placeholders.append(PlaceholderSource(kind="input", index=index))
            if isinstance(node.meta.get("val"), torch.Tensor):
                input_placements[index] = placements
                global_shapes[index] = shape_of(node)
                local_shapes[index] = local_shape(shape_of(node), placements, mesh_shape)
    return _PlaceholderLayouts(
        placeholders=tuple(placeholders),
        param_placements=param_placements,
        buffer_placements=buffer_placements,
        input_placements=tuple(input_placements),
        global_shapes=tuple(global_shapes),
        local_shapes=tuple(local_shapes),
    )


def _collect_edges(
    graph: fx.Graph, strategies: Mapping[fx.Node, Strategy], requires_grad: set[fx.Node]
) -> list[_Edge]:
    """Every (producer -> consumer input) edge with its layouts and partial-gradient axes."""
    edges: list[_Edge] = []
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
                src = _producer_placements(producer, strategies)
            assert src is not None, (node.name, producer.name)
            grads = strategy.input_grads[slot] if slot < len(strategy.input_grads) else None
            partial_axes: tuple[int, ...] = ()
            if grads is not None and producer in requires_grad:
                partial_axes = tuple(a for a, p in enumerate(grads) if p.is_partial())
            tensor = node if node.target is operator.getitem else producer
            edges.append(_Edge(node, slot, producer, tensor, tuple(src), tuple(dst), partial_axes))
    return edges


def _deferred_param_axes(
    edges: Sequence[_Edge], param_fqn: Mapping[str, str], num_axes: int
) -> dict[str, tuple[int, ...]]:
    """Axes over which the runtime may sum a parameter's gradient after backward: those on
    which EVERY use leaves a Partial gradient, for parameters no use converts."""
    uses: dict[str, list[_Edge]] = {}
    for edge in edges:
        if edge.producer.op == "placeholder" and edge.producer.name in param_fqn:
            uses.setdefault(param_fqn[edge.producer.name], []).append(edge)
    deferred: dict[str, tuple[int, ...]] = {}
    for fqn, param_edges in uses.items():
        if any(e.src != e.dst for e in param_edges):
            continue
        common = set(range(num_axes))
        for e in param_edges:
            common &= set(e.partial_axes)
        if common:
            deferred[fqn] = tuple(sorted(common))
    return deferred


def _insert_conversions(
    graph: fx.Graph,
    edges: Sequence[_Edge],
    deferred: Mapping[str, tuple[int, ...]],
    param_fqn: Mapping[str, str],
    mesh_shape: tuple[int, ...],
    group_key: str,
) -> None:
    converted: dict[tuple[fx.Node, Placements, tuple[int, ...]], fx.Node] = {}
    actual: dict[fx.Node, fx.Node] = {}  # getitem node -> the value holding its declared layout
    for edge in edges:
        node = edge.consumer
        axes = edge.partial_axes
        if edge.producer.op == "placeholder" and edge.producer.name in param_fqn:
            skip = deferred.get(param_fqn[edge.producer.name], ())
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


def _convert_outputs(
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
    edge: _Edge,
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
