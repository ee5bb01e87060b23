"""What an op node's strategies and costs depend on (``autopar.planner.space``): nodes of
repeated layers with equal signatures share one priced ``NodeSpace``."""

from __future__ import annotations

import torch
import torch.fx as fx

from autopar.strategies import input_nodes
from autopar.strategies.registry import TensorMeta, op_call
from autopar.strategies.sections import section_hints


def _freeze(value):
    """A hashable stand-in for an OpCall's args (lists, dicts, TensorMeta, constants)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_freeze(v) for v in value))
    if isinstance(value, dict):
        return (
            "dict",
            tuple(
                (str(k), _freeze(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
            ),
        )
    if isinstance(value, float):
        return ("float", float.hex(value))
    if isinstance(value, (TensorMeta, bool, int, str, torch.dtype)) or value is None:
        return value
    return (type(value).__name__, str(value))


def op_signature(node: fx.Node, needs_grad: set[str]) -> tuple:
    """Everything an op node's strategies and costs depend on: op, argument structure with
    tensors as (shape, dtype), outputs, and which inputs carry gradients (and are placeholders)."""
    call = op_call(node)
    inputs = input_nodes(node)
    return (
        node.target,
        _freeze(call.args),
        _freeze(call.kwargs),
        _freeze(call.outputs),
        node.name in needs_grad,
        tuple((inp.name in needs_grad, inp.op == "placeholder") for inp in inputs),
        section_hints(node),
    )
