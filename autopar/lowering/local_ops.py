"""Per-node rewrites that make one op run on its local shard, and the graph calls of collectives.

* **Size arguments** (``view``, ``reshape``, ``expand``, ``new_zeros``, ``zeros``, ``full``,
  ``repeat``, ``unflatten``, ...) become the node's local output shape, computed from its global
  ``meta["val"]`` shape and its chosen output placement. ``arange`` with a sharded output is
  built whole and sliced locally. Absolute split/slice/select sizes on a sharded dim, and strided
  ops with a sharded output, have no local meaning and are refused (the rules never generate
  them).
* **Substitutions.** ``aten.embedding`` with a row-sharded (vocab-parallel) weight becomes
  :func:`autopar_vocab_parallel_embedding` (masked local lookup, Partial output);
  ``aten.cross_entropy_loss`` with class-sharded logits becomes
  ``autopar.lowering.vocab_parallel.autopar_vocab_parallel_cross_entropy`` (collectives on
  per-sample vectors inside the op, Replicate output);
  ``aten.squeeze`` squeezes only the dims that are size 1 globally (a shard may be size 1).
* **Dropout.** ``aten.dropout`` becomes :func:`autopar_dropout`, which draws the mask from a
  generator seeded by one draw of the global RNG (identical on every rank, since every rank
  seeds and consumes the global RNG alike) plus the rank's mixed-radix coordinate over the axes
  on which the output is SHARDED. Ranks that hold the same replicated block thus draw the same
  mask, ranks holding different blocks of a batch-sharded tensor different masks.

The ``autopar_*`` functions are module level so that fx codegen can name them in a graph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from autopar.capture.export import ASSERT_OPS
from autopar.comm import collectives
from autopar.comm.process_groups import lookup_axis_groups
from autopar.lowering.vocab_parallel import autopar_vocab_parallel_cross_entropy
from autopar.placement import (
    Placements,
    Shard,
    format_placements,
    local_shape,
    replicated,
    section_axis,
)
from autopar.resharding.steps import Step, reshard_steps
from autopar.strategies.embedding import vocab_parallel_embedding
from autopar.strategies.losses import class_axes
from autopar.strategies.registry import Strategy
from autopar.strategies.sections import SPLIT_OPS

aten = torch.ops.aten

__all__ = [
    "autopar_dropout",
    "autopar_scale_grad",
    "autopar_vocab_parallel_embedding",
    "emit_steps",
    "itemsize",
    "rewrite_local_ops",
    "shape_of",
]


# --------------------------------------------------------------------------------------------
# Runtime helpers called from the lowered graph (module level so fx codegen can name them)


def autopar_dropout(
    x: torch.Tensor, p: float, train: bool | None, group_key: str, sharded_axes: Sequence[int]
) -> torch.Tensor:
    """Dropout whose mask is shared by replicas and differs between shards (module docstring)."""
    if not train or p == 0.0:
        return x
    if p >= 1.0:
        return x * 0.0
    seed = int(torch.randint(0, 2**62, (1,)).item())
    if sharded_axes:
        groups = lookup_axis_groups(group_key)
        offset = 0
        for axis in sharded_axes:
            offset = offset * groups.mesh_shape[axis] + groups.coordinate[axis]
        seed += offset
    generator = torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(
        1.0 - p, generator=generator
    )
    return x * keep / (1.0 - p)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def autopar_scale_grad(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Identity forward; multiplies the gradient by ``factor`` in backward."""
    return _ScaleGrad.apply(x, factor)


def autopar_vocab_parallel_embedding(
    weight: torch.Tensor,
    indices: torch.Tensor,
    group_key: str,
    row_axes: Sequence[int],
    padding_idx: int = -1,
) -> torch.Tensor:
    """This rank's part of an embedding whose weight rows are split over ``row_axes``.

    The local rows start at (mixed-radix coordinate over ``row_axes``) x (local row count);
    tokens outside them give zero rows, so the parts sum to the full lookup (Partial output).
    """
    groups = lookup_axis_groups(group_key)
    index = 0
    for axis in row_axes:
        index = index * groups.mesh_shape[axis] + groups.coordinate[axis]
    return vocab_parallel_embedding(weight, indices, index * weight.shape[0], padding_idx)


# --------------------------------------------------------------------------------------------
# Size arguments

# op -> index of its size argument; the local output shape replaces it.
_SIZE_ARG: dict[Any, int] = {
    aten.view.default: 1,
    aten.reshape.default: 1,
    aten._unsafe_view.default: 1,
    aten.expand.default: 1,
    aten.new_zeros.default: 1,
    aten.new_ones.default: 1,
    aten.new_empty.default: 1,
    aten.new_full.default: 1,
    aten.zeros.default: 0,
    aten.ones.default: 0,
    aten.empty.memory_format: 0,
    aten.full.default: 0,
    aten.rand.default: 0,
    aten.randn.default: 0,
}

# op -> (index of the dim argument); refused when that dim of the input is sharded, unless the op
# keeps the whole dim (a full slice).
_DIM_ARG: dict[Any, int] = {
    aten.split.Tensor: 2,
    aten.split_with_sizes.default: 2,
    aten.slice.Tensor: 1,
    aten.narrow.default: 1,
    aten.select.int: 1,
    aten.index_select.default: 1,
    aten.unsafe_split.Tensor: 2,
}

# Ops with absolute sizes AND strides: no local equivalent when their output is sharded.
_STRIDED = frozenset(
    {aten.as_strided.default, aten.empty_strided.default, aten.new_empty_strided.default}
)

_DIM_DEFAULT = {aten.split.Tensor: 0, aten.split_with_sizes.default: 0, aten.slice.Tensor: 0}

_SQUEEZE = frozenset({aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims})
_ARANGE = frozenset({aten.arange.default, aten.arange.start, aten.arange.start_step})
_DROPOUT = frozenset({aten.dropout.default})


def shape_of(node: fx.Node) -> tuple[int, ...]:
    """Global shape of a node's value (from ``meta["val"]``)."""
    val = node.meta["val"]
    return tuple(int(s) for s in val.shape)


def _localize_sizes(
    node: fx.Node, strategy: Strategy, in_shape: tuple[int, ...] | None, mesh_shape: tuple[int, ...]
) -> None:
    """Rewrite size arguments of ``node`` to local sizes (see module docstring).

    ``in_shape`` is the global shape of the node's first input (its args may already point at
    inserted conversions, which carry no shape metadata).
    """
    target = node.target
    out_placements = strategy.outputs[0] if strategy.outputs else None
    if target in _SIZE_ARG and out_placements is not None:
        index = _SIZE_ARG[target]
        node.update_arg(index, list(local_shape(shape_of(node), out_placements, mesh_shape)))
    elif target is aten.repeat.default and out_placements is not None:
        assert in_shape is not None and strategy.inputs[0] is not None
        in_local = local_shape(in_shape, strategy.inputs[0], mesh_shape)
        out_local = local_shape(shape_of(node), out_placements, mesh_shape)
        lead = len(out_local) - len(in_local)
        repeats = list(out_local[:lead]) + [o // i for o, i in zip(out_local[lead:], in_local)]
        node.update_arg(1, repeats)
    elif target is aten.unflatten.int and out_placements is not None:
        assert in_shape is not None
        dim = int(node.args[1]) % len(in_shape)
        out_local = local_shape(shape_of(node), out_placements, mesh_shape)
        node.update_arg(2, list(out_local[dim : dim + len(node.args[2])]))
    elif (
        target in SPLIT_OPS and strategy.inputs[0] and section_axis(strategy.inputs[0]) is not None
    ):
        _localize_section_split(node, strategy, mesh_shape)
    elif target in _DIM_ARG:
        assert in_shape is not None
        _check_dim_not_sharded(node, strategy, in_shape)
    elif target in _STRIDED and out_placements is not None:
        if any(isinstance(p, Shard) for p in out_placements):
            raise AssertionError(
                f"node {node.name} ({target}) has absolute sizes and strides but its chosen "
                f"output placement {format_placements(out_placements)} is sharded; rules must "
                f"keep strided ops replicated"
            )


def _localize_section_split(node: fx.Node, strategy: Strategy, mesh_shape: tuple[int, ...]) -> None:
    """A split of a section-sharded tensor at its sections: each piece's size becomes its local
    size (``chunk`` of equal pieces keeps its count)."""
    placements = strategy.inputs[0]
    assert placements is not None
    axis = section_axis(placements)
    assert axis is not None
    num = mesh_shape[axis]
    if node.target is aten.chunk.default:
        return
    size = node.args[1]
    local = size // num if isinstance(size, int) else [s // num for s in size]
    node.update_arg(1, local)


def _check_dim_not_sharded(node: fx.Node, strategy: Strategy, shape: tuple[int, ...]) -> None:
    in_placements = strategy.inputs[0]
    if in_placements is None:
        return
    index = _DIM_ARG[node.target]
    if len(node.args) > index:
        dim = int(node.args[index])
    else:
        dim = int(node.kwargs.get("dim", _DIM_DEFAULT.get(node.target, 0)))
    dim %= len(shape)
    if not any(isinstance(p, Shard) and p.dim % len(shape) == dim for p in in_placements):
        return
    if node.target is aten.slice.Tensor:
        start = node.args[2] if len(node.args) > 2 else 0
        end = node.args[3] if len(node.args) > 3 else None
        step = node.args[4] if len(node.args) > 4 else 1
        if (start in (None, 0)) and (end is None or end >= shape[dim]) and step == 1:
            return
    raise AssertionError(
        f"node {node.name} ({node.target}) takes absolute sizes along dim {dim}, which its chosen "
        f"input placement {format_placements(in_placements)} shards; a strategy rule generated "
        f"a layout the lowering cannot make local (rules must not shard the dim argument)"
    )


# --------------------------------------------------------------------------------------------
# Collectives as graph calls


def emit_steps(graph: fx.Graph, value: fx.Node, steps: Sequence[Step], group_key: str) -> fx.Node:
    """Insert one collective call per step at the graph's current insertion point."""
    for step in steps:
        if step.kind == "all_gather":
            call = (collectives.autopar_all_gather, (value, group_key, step.axis, step.dim))
        elif step.kind == "all_reduce":
            call = (collectives.autopar_all_reduce, (value, group_key, step.axis))
        elif step.kind == "reduce_scatter":
            call = (collectives.autopar_reduce_scatter, (value, group_key, step.axis, step.dim))
        elif step.kind == "all_to_all":
            call = (
                collectives.autopar_all_to_all,
                (value, group_key, step.axis, step.dim, step.dst_dim),
            )
        elif step.kind == "slice":
            call = (collectives.autopar_slice, (value, group_key, step.axis, step.dim))
        elif step.kind in ("gather_sections", "select_sections"):
            fn = (
                collectives.autopar_gather_sections
                if step.kind == "gather_sections"
                else collectives.autopar_select_sections
            )
            call = (fn, (value, group_key, step.axis, step.dim, step.sections))
        else:
            assert step.kind == "zero_out", step.kind
            call = (collectives.autopar_zero_out, (value, group_key, step.axis))
        value = graph.call_function(*call)
    return value


def itemsize(node: fx.Node) -> int:
    """Bytes per element of a node's value."""
    return node.meta["val"].dtype.itemsize


def rewrite_local_ops(
    graph: fx.Graph,
    strategies: Mapping[fx.Node, Strategy],
    first_input_shape: Mapping[fx.Node, tuple[int, ...]],
    mesh_shape: tuple[int, ...],
    group_key: str,
) -> None:
    """Make every op of ``graph`` run on its local shard (module docstring); erase assert nodes.

    Args:
        graph: the graph being lowered (conversions already inserted).
        strategies: the chosen strategy of each node.
        first_input_shape: global shape of each node's first input, taken before conversions
            were inserted (inserted collective nodes carry no shape metadata).
        mesh_shape: size of each mesh axis.
        group_key: registry key of the mesh's process groups.
    """
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in ASSERT_OPS:
            if not node.users:
                graph.erase_node(node)
            continue
        strategy = strategies.get(node)
        if strategy is None:
            continue
        if node.target in _DROPOUT:
            placements = strategy.outputs[0]
            assert placements is not None
            sharded = tuple(a for a, p in enumerate(placements) if p.is_shard())
            x = node.args[0]
            p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
            train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
            node.target = autopar_dropout
            node.args = (x, p, train, group_key, sharded)
            node.kwargs = {}
        elif node.target is aten.embedding.default and _row_axes(strategy.inputs[0]):
            # Vocab-parallel: each rank looks up only its rows (masked), the output is Partial.
            padding_idx = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx", -1)
            node.target = autopar_vocab_parallel_embedding
            node.args = (
                node.args[0],
                node.args[1],
                group_key,
                _row_axes(strategy.inputs[0]),
                padding_idx,
            )
            node.kwargs = {}
        elif node.target is aten.cross_entropy_loss.default and class_axes(strategy):
            _vocab_parallel_cross_entropy(node, strategy, first_input_shape[node], group_key)
        elif node.target in _SQUEEZE:
            # A shard may have size 1 where the global dim does not: squeeze only the dims that
            # are size 1 globally.
            in_shape = first_input_shape[node]
            if node.target is aten.squeeze.default:
                dims = range(len(in_shape))
            elif node.target is aten.squeeze.dim:
                dims = [node.args[1]]
            else:
                dims = node.args[1]
            keep = (
                [d % len(in_shape) for d in dims if in_shape[d % len(in_shape)] == 1]
                if in_shape
                else []
            )
            node.target = aten.squeeze.dims
            node.args = (node.args[0], keep)
            node.kwargs = {}
        elif node.target in _ARANGE:
            # Positions depend on the rank: build the whole range and keep this rank's block.
            placements = strategy.outputs[0]
            assert placements is not None
            if any(not p.is_replicate() for p in placements):
                fwd, _ = reshard_steps(
                    replicated(len(mesh_shape)),
                    placements,
                    shape_of(node),
                    itemsize(node),
                    mesh_shape,
                )
                users = list(node.users)
                with graph.inserting_before(node.next):
                    value = emit_steps(graph, node, fwd, group_key)
                for user in users:
                    user.replace_input_with(node, value)
        else:
            _localize_sizes(node, strategy, first_input_shape.get(node), mesh_shape)


def _vocab_parallel_cross_entropy(
    node: fx.Node, strategy: Strategy, logits_shape: tuple[int, ...], group_key: str
) -> None:
    """Logits stay sharded on the class dim; the op all-reduces [N] vectors inside itself."""

    def arg(index: int, name: str, default: Any) -> Any:
        return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)

    node.target = autopar_vocab_parallel_cross_entropy
    node.args = (
        node.args[0],
        node.args[1],
        group_key,
        class_axes(strategy),
        logits_shape[1],
        arg(3, "reduction", 1),
        arg(4, "ignore_index", -100),
        arg(5, "label_smoothing", 0.0),
    )
    node.kwargs = {}


def _row_axes(placements: Placements | None) -> tuple[int, ...]:
    """Mesh axes that split dim 0 (the rows) of an embedding weight."""
    if placements is None:
        return ()
    return tuple(a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0)
