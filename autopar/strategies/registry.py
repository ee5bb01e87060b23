"""Strategy registry: per-op sharding rules keyed by ATen op overload.

A rule is written for ONE mesh axis: ``rule(call) -> list[AxisStrategy]``, where each
``AxisStrategy`` gives the placement of every tensor output and the placement the op requires of
every tensor input on that axis. :func:`expand` takes the cartesian product over the mesh axes,
drops combinations whose sharded dims are not divisible (autopar never pads), and derives the
gradient placements from DESIGN.md's gradient convention (see :func:`input_grad_placements`).

Inputs are numbered in the order of ``torch.utils._pytree.tree_flatten((node.args, node.kwargs))``
restricted to ``fx.Node`` leaves; outputs in the order of the node's value (a tensor, or a
tuple/list of tensors).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils._pytree import SUPPORTED_NODES, is_namedtuple_class, tree_flatten, tree_map

from autopar.placement import (
    PARTIAL,
    REPLICATE,
    Placement,
    Placements,
    SectionShard,
    Shard,
    divides,
    format_placements,
    replicated,
)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of a tensor in the captured graph (global, unsharded)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point or self.dtype.is_complex


@dataclass(frozen=True, slots=True)
class OpCall:
    """One op application with tensors replaced by their metadata.

    ``args``/``kwargs`` mirror the node's, with every fx.Node replaced by its TensorMeta (or a
    list of TensorMeta for a node producing a tuple, or its plain value for non-tensor nodes).
    ``inputs`` lists the input nodes' values in flatten order (what Strategy.inputs indexes);
    ``outputs`` the op's tensor outputs (None for a non-tensor output slot).
    """

    op: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    inputs: tuple[Any, ...]
    outputs: tuple[TensorMeta | None, ...]


@dataclass(frozen=True, slots=True)
class AxisStrategy:
    """What one strategy does on one mesh axis."""

    outputs: tuple[Placement, ...]
    inputs: tuple[Placement | None, ...]


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node on the whole mesh.

    ``outputs[i]`` / ``inputs[j]`` are per-axis placement tuples (None for a non-tensor slot);
    ``input_grads[j]`` is the placement of the gradient the op's backward produces for input j
    (None when the input does not get a gradient). A Partial there means the runtime must
    all-reduce that gradient over the axis (fused into the chunked reduction for parameters).
    """

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements | None, ...]
    input_grads: tuple[Placements | None, ...] = field(default=())

    def describe(self) -> str:
        ins = " ".join(format_placements(p) for p in self.inputs)
        outs = " ".join(format_placements(p) for p in self.outputs)
        return f"[{ins}] -> [{outs}]"


Rule = Callable[[OpCall], list[AxisStrategy]]

_RULES: dict[Any, Rule] = {}


def register(*ops: Any) -> Callable[[Rule], Rule]:
    """Register ``rule`` for each op (an OpOverload, an OpOverloadPacket, or a Python callable)."""

    def decorator(rule: Rule) -> Rule:
        for op in ops:
            _RULES[op] = rule
        return rule

    return decorator


def get_rule(op: Any) -> Rule | None:
    rule = _RULES.get(op)
    if rule is None and isinstance(op, torch._ops.OpOverload):
        rule = _RULES.get(op.overloadpacket)
    return rule


def registered_ops() -> list[Any]:
    return list(_RULES)


# A strategy whose op communicates inside itself (e.g. a vocab-parallel cross entropy) says so
# here, so the planner can price it: (kind, mesh axis, local bytes) per collective, forward and
# backward together, for one strategy on one mesh.
InOpCollectives = Callable[["OpCall", "Strategy", Sequence[int]], list[tuple[str, int, float]]]

_IN_OP: dict[Any, InOpCollectives] = {}


def register_in_op_collectives(*ops: Any) -> Callable[[InOpCollectives], InOpCollectives]:
    """Register the function that lists the collectives an op's strategies run inside the op."""

    def decorator(fn: InOpCollectives) -> InOpCollectives:
        for op in ops:
            _IN_OP[op] = fn
        return fn

    return decorator


def in_op_collectives(
    call: OpCall, strategy: Strategy, mesh_shape: Sequence[int]
) -> list[tuple[str, int, float]]:
    """(kind, mesh axis, local bytes) of each collective ``strategy`` runs inside the op."""
    fn = _IN_OP.get(call.op)
    return fn(call, strategy, mesh_shape) if fn is not None else []


# --------------------------------------------------------------------------------------------
# From fx nodes to OpCall


def tensor_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(int(s) for s in value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return [tensor_meta(v) for v in value]
    return value


_FLAT_SEQUENCES = (tuple, list, immutable_list)
_FLAT_MAPPINGS = (dict, immutable_dict)


def _collect_nodes(arg: Any, out: list[fx.Node]) -> None:
    """Append the fx nodes among ``arg``'s pytree leaves to ``out``, in ``tree_flatten``'s
    order; the plain containers fx argument lists hold are walked here (the hot path), any
    other registered pytree type through ``tree_flatten``."""
    if isinstance(arg, fx.Node):
        out.append(arg)
        return
    kind = type(arg)
    if kind in _FLAT_SEQUENCES:
        for item in arg:
            _collect_nodes(item, out)
    elif kind in _FLAT_MAPPINGS:
        for item in arg.values():
            _collect_nodes(item, out)
    elif kind in SUPPORTED_NODES or is_namedtuple_class(kind):
        leaves, _ = tree_flatten(arg)
        out.extend(leaf for leaf in leaves if isinstance(leaf, fx.Node))


def input_nodes(node: fx.Node) -> list[fx.Node]:
    """The node's input nodes in the order Strategy.inputs uses (``tree_flatten`` order of
    ``(args, kwargs)``, repeats kept). Not memoised: a memo keyed by the node but holding its
    inputs kept every graph it saw, fake tensors and all, alive for the whole process."""
    found: list[fx.Node] = []
    _collect_nodes(node.args, found)
    _collect_nodes(node.kwargs, found)
    return found


def output_metas(value: Any) -> tuple[TensorMeta | None, ...]:
    if isinstance(value, torch.Tensor):
        return (tensor_meta(value),)
    if isinstance(value, (tuple, list)):
        return tuple(tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in value)
    return (None,)


def op_call(node: fx.Node) -> OpCall:
    def meta_of(arg: Any) -> Any:
        return tensor_meta(arg.meta.get("val")) if isinstance(arg, fx.Node) else arg

    args = tree_map(meta_of, node.args)
    kwargs = tree_map(meta_of, node.kwargs)
    inputs = tuple(meta_of(n) for n in input_nodes(node))
    return OpCall(
        node.target, tuple(args), dict(kwargs), inputs, output_metas(node.meta.get("val"))
    )


# --------------------------------------------------------------------------------------------
# Expansion over mesh axes


def _slot_shape(meta: Any) -> tuple[int, ...] | None:
    return meta.shape if isinstance(meta, TensorMeta) else None


def input_grad_placements(
    call: OpCall, inputs: Sequence[Placements | None], outputs: Sequence[Placements | None]
) -> tuple[Placements | None, ...]:
    """Gradient placement of each input under the gradient convention.

    Per axis: a Shard input gets a Shard gradient, a Partial input a Replicate one (every rank
    differentiates the same replicated scalar), and a Replicate input gets a Partial gradient
    exactly when the op's work is split over that axis (some input or output is sharded there,
    or the output is Partial), because each rank then contributes a different part of it.
    """
    num_axes = len(next(p for p in (*inputs, *outputs) if p is not None))
    split = [False] * num_axes
    for placements in (*inputs, *outputs):
        if placements is None:
            continue
        for axis, p in enumerate(placements):
            if isinstance(p, (Shard, SectionShard)):
                split[axis] = True
    for placements in outputs:
        if placements is None:
            continue
        for axis, p in enumerate(placements):
            if p.is_partial():
                split[axis] = True
    grads: list[Placements | None] = []
    for meta, placements in zip(call.inputs, inputs):
        if placements is None or not isinstance(meta, TensorMeta) or not meta.is_float:
            grads.append(None)
            continue
        per_axis: list[Placement] = []
        for axis, p in enumerate(placements):
            if p.is_partial():
                per_axis.append(REPLICATE)
            elif p.is_replicate() and split[axis]:
                per_axis.append(PARTIAL)
            else:
                per_axis.append(p)
        grads.append(tuple(per_axis))
    return tuple(grads)


def expand(
    call: OpCall, per_axis: Iterable[AxisStrategy], mesh_shape: Sequence[int]
) -> list[Strategy]:
    """Cartesian product of per-axis strategies over the mesh, divisible ones only, deduplicated.

    On an axis of size 1 only the fully replicated per-axis strategy is used (if the rule gives
    one), since sharding over one device is the same layout.
    """
    options = list(dict.fromkeys(per_axis))
    plain = [
        s for s in options if all(p is None or p.is_replicate() for p in (*s.inputs, *s.outputs))
    ]
    axis_options = [plain if size == 1 and plain else options for size in mesh_shape]
    strategies: dict[Strategy, None] = {}
    for combo in itertools.product(*axis_options):
        outputs = tuple(
            None if call.outputs[i] is None else tuple(c.outputs[i] for c in combo)
            for i in range(len(call.outputs))
        )
        inputs = tuple(
            None if combo[0].inputs[j] is None else tuple(c.inputs[j] for c in combo)
            for j in range(len(call.inputs))
        )
        if not _all_divisible(call, inputs, outputs, mesh_shape):
            continue
        grads = input_grad_placements(call, inputs, outputs)
        strategies[Strategy(outputs, inputs, grads)] = None
    return list(strategies)


def _all_divisible(call: OpCall, inputs, outputs, mesh_shape) -> bool:
    for meta, placements in (*zip(call.inputs, inputs), *zip(call.outputs, outputs)):
        shape = _slot_shape(meta)
        if placements is None or shape is None:
            continue
        if any(isinstance(p, Shard) and not (0 <= p.dim < len(shape)) for p in placements):
            return False
        if not divides(shape, placements, mesh_shape):
            return False
    return True


def replicate_all(call: OpCall, num_axes: int) -> Strategy:
    """The always-correct fallback: every tensor input and output replicated on every axis."""
    inputs = tuple(replicated(num_axes) if isinstance(m, TensorMeta) else None for m in call.inputs)
    outputs = tuple(None if m is None else replicated(num_axes) for m in call.outputs)
    return Strategy(outputs, inputs, input_grad_placements(call, inputs, outputs))


def strategies_for(node: fx.Node, mesh_shape: Sequence[int]) -> tuple[list[Strategy], str | None]:
    """All strategies of ``node`` on the mesh, and a warning when the op has no rule."""
    call = op_call(node)
    rule = get_rule(node.target)
    if rule is None:
        return [replicate_all(call, len(mesh_shape))], (
            f"no sharding rule for {node.target} (node {node.name}); it runs replicated"
        )
    strategies = expand(call, rule(call), mesh_shape)
    if not strategies:
        strategies = [replicate_all(call, len(mesh_shape))]
    return strategies, None


# --------------------------------------------------------------------------------------------
# Built-in rule for tuple indexing (``operator.getitem`` nodes after split, SDPA, ...)


def all_axis_placements(meta: TensorMeta, *, partial: bool = True) -> list[Placement]:
    """R, S(d) for every dim, and optionally P: every placement of one tensor on one axis."""
    options: list[Placement] = [REPLICATE, *(Shard(d) for d in range(meta.ndim))]
    if partial:
        options.append(PARTIAL)
    return options


@register(operator.getitem)
def getitem_rule(call: OpCall) -> list[AxisStrategy]:
    # The input is a tuple-producing node; the element keeps its layout (the edge from the
    # producer prices any conversion). Non-tensor elements produce no strategy choice.
    out = call.outputs[0]
    if out is None:
        return [AxisStrategy(outputs=(REPLICATE,), inputs=(REPLICATE,))]
    return [AxisStrategy(outputs=(p,), inputs=(p,)) for p in all_axis_placements(out)]
