"""Whether two ExportedPrograms are the same graph, names included (``program_difference``).

``autopar.capture.layer_replication`` checks its splice with it, and the tests compare a replicated
capture with a full export.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map


def program_difference(
    a: torch.export.ExportedProgram, b: torch.export.ExportedProgram
) -> str | None:
    """The first difference between two exported programs, or None when they are the same
    graph: node names, ops, targets, arguments, module paths, shapes, strides and dtypes in
    order, the signature, the state dict's keys and the module call graph."""
    if a.graph_signature.input_specs != b.graph_signature.input_specs:
        return "input specs"
    if a.graph_signature.output_specs != b.graph_signature.output_specs:
        return "output specs"
    if list(a.state_dict) != list(b.state_dict) or list(a.constants) != list(b.constants):
        return "state dict or constants"
    if [e.fqn for e in a.module_call_graph] != [e.fqn for e in b.module_call_graph]:
        return "module call graph"
    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    if len(nodes_a) != len(nodes_b):
        return f"{len(nodes_a)} vs {len(nodes_b)} nodes"
    for x, y in zip(nodes_a, nodes_b):
        if _node_record(x) != _node_record(y):
            return f"node {x.name} vs {y.name}"
    return None


def _node_record(node: fx.Node) -> tuple[Any, ...]:
    def name_of(value: Any) -> Any:
        return value.name if isinstance(value, fx.Node) else value

    stack = node.meta.get("nn_module_stack") or {}
    return (
        node.name,
        node.op,
        str(node.target),
        repr(tree_map(name_of, node.args)),
        repr(tree_map(name_of, node.kwargs)),
        [(key, str(p), str(cls)) for key, (p, cls) in stack.items()],
        [_tensor_record(v) for v in tree_flatten(node.meta.get("val"))[0]],
    )


def _tensor_record(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (
            type(value).__name__,
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
            value.requires_grad,
            value.device.type,
        )
    return repr(value)
