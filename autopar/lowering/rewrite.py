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
* **Fused reductions** (:mod:`autopar.lowering.fused_reductions`): back-to-back all-reduces
  on one axis (a mean loss's sum and token count) become one all-reduce of a flat buffer.
* **Outputs** are converted to ``output_placements`` (Replicate by default, so every rank
  returns the single-process value, e.g. the global mean loss). An output the user asks to be
  sharded over ``N`` devices gets DDP's convention (DESIGN.md): the user computes a loss on the
  local block, and the gradient entering the graph is scaled by ``1/N``, so parameter gradients
  are the mean over the shards of the local losses' gradients.

The result's ``gm.print_readable()`` shows collectives as calls such as
``autopar_runtime_collectives_autopar_all_gather(x, 'mesh0', 1, 0)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from autopar.capture.export import ASSERT_OPS
from autopar.lowering.conversions import (
    collect_edges,
    convert_outputs,
    deferred_param_axes,
    insert_conversions,
    producer_placements,
    requires_grad_nodes,
)
from autopar.lowering.fused_reductions import fuse_all_reduces
from autopar.lowering.local_ops import rewrite_local_ops, shape_of
from autopar.lowering.param_chains import param_chains
from autopar.placement import Placements, format_placements, local_shape, replicated
from autopar.strategies.registry import Strategy, input_nodes

__all__ = ["LoweredGraph", "PlaceholderSource", "drop_capture_meta", "lower"]


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

    edges = collect_edges(graph, strategies, requires_grad_nodes(graph, set(param_fqn)))
    chains = param_chains(
        gm, edges, strategies, set(param_fqn), set(captured.buffer_nodes), mesh_shape
    )
    deferred = deferred_param_axes(edges, param_fqn, num_axes, chains)
    param_use_order = tuple(
        dict.fromkeys(
            param_fqn[e.producer.name]
            for e in edges
            if e.producer.op == "placeholder" and e.producer.name in param_fqn
        )
    )
    first_input_shape = _first_input_shapes(strategies)
    output_node = next(n for n in graph.nodes if n.op == "output")
    output_src = [
        producer_placements(leaf, strategies) if leaf in strategies else replicated(num_axes)
        for leaf in tree_flatten(output_node.args[0])[0]
        if isinstance(leaf, fx.Node)
    ]

    insert_conversions(graph, edges, deferred, param_fqn, mesh_shape, group_key, chains)
    rewrite_local_ops(graph, strategies, first_input_shape, mesh_shape, group_key)
    if device is not None:
        for node in graph.nodes:
            if node.op == "call_function" and "device" in node.kwargs:
                node.update_kwarg("device", torch.device(device))
    out_placements = convert_outputs(
        graph, output_node, output_src, output_placements, mesh_shape, group_key
    )
    fuse_all_reduces(graph)

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
        non_persistent_buffers=_non_persistent_buffers(captured),
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


def drop_capture_meta(lowered: LoweredGraph) -> LoweredGraph:
    """``lowered`` with its graph's capture-time node metadata dropped, for running only.

    ``torch.export`` leaves on every node its fake tensor (``val``, with ``tensor_meta``), the
    user's stack trace, module stack and provenance; the lowering reads them, the generated
    code does not. Kept after lowering they hold, per node, a fake tensor (and through it the
    capture's FakeTensorMode and ShapeEnv) and a few KiB of strings and dicts, in every copy of
    the graph (the runtime's ZeRO rewrite copies the node metadata). autopar's own entries
    (``autopar_*``: placements, module paths, checkpoint segments) stay. Call it last: the
    recomputation pass reads ``val``. Returns ``lowered`` (its graph changed in place)."""
    for node in lowered.gm.graph.nodes:
        kept = {key: value for key, value in node.meta.items() if key.startswith("autopar_")}
        node.meta.clear()
        node.meta.update(kept)
    return lowered


def _first_input_shapes(strategies: Mapping[fx.Node, Strategy]) -> dict[fx.Node, tuple[int, ...]]:
    """Call node -> the global shape of its first input, where that input is a tensor (what
    ``rewrite_local_ops`` turns into local size arguments)."""
    return {
        node: shape_of(node_inputs[0])
        for node in strategies
        if node.op == "call_function"
        and (node_inputs := input_nodes(node))
        and isinstance(node_inputs[0].meta.get("val"), torch.Tensor)
    }


def _non_persistent_buffers(captured: Any) -> frozenset[str]:
    """FQNs of the buffers that are not part of the model's state dict."""
    return frozenset(
        str(spec.target)
        for spec in captured.exported.graph_signature.input_specs
        if spec.kind == torch.export.graph_signature.InputKind.BUFFER and spec.persistent is False
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
