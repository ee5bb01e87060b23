"""Section-sharded strategies: a fused projection whose output a split cuts into sections.

A column-parallel fused qkv ``linear(x, w[3D, D])`` under a contiguous ``Shard(2)`` cannot be split
into q, k and v locally (rank 0 would hold q and half of k). Under
``SectionShard(2, (D, D, D))`` (:mod:`autopar.placement`) rank ``r`` holds piece ``r`` of each of
q, k and v, so the ``split`` runs locally and gives each of them as a plain ``Shard(2)``; the
weight (and bias) is section-sharded the same way along dim 0. Sections may differ in size
(grouped-query attention's q, k, v), and the split may be ``split``, ``split_with_sizes`` or
``chunk``.

Which sections a projection's output has depends on its consumers, so the producer's options
come from :func:`section_hints` (the splits among the node's users). These strategies are
listed by :func:`section_strategies`, apart from the registry's rules (the planner adds them
to a node's strategies, and :func:`fused_param_sections` to its parameters' layouts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from autopar.placement import REPLICATE, SectionShard, Shard, section_axis
from autopar.strategies.registry import (
    AxisStrategy,
    OpCall,
    Strategy,
    TensorMeta,
    expand,
    get_rule,
    input_nodes,
    op_call,
)
from autopar.strategies.views import normalize_dim

aten = torch.ops.aten

__all__ = [
    "SPLIT_OPS",
    "fused_param_sections",
    "section_hints",
    "section_strategies",
    "split_sections",
]

SPLIT_OPS = frozenset(
    {
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.split_with_sizes_copy.default,
        aten.split_copy.Tensor,
        aten.chunk.default,
    }
)
"""Splits whose pieces are sections (``tensor_split`` and ``unbind`` are not offered)."""

Hint = tuple[int, tuple[int, ...]]
"""(dim, section sizes) of a tensor that a consumer splits."""


def split_sections(
    op: object, args: Sequence[object], kwargs: dict, shape: Sequence[int]
) -> Hint | None:
    """(dim, piece sizes) of a split op applied to a tensor of ``shape``, or None for another op."""
    if op not in SPLIT_OPS or not shape:
        return None
    dim = normalize_dim(args[2] if len(args) > 2 else kwargs.get("dim", 0), len(shape))
    size = shape[dim]
    arg = args[1] if len(args) > 1 else kwargs.get("split_size", kwargs.get("split_sizes"))
    if op is aten.chunk.default:
        # Only equal pieces: then each rank's chunk() of its local tensor gives its pieces.
        chunks = int(arg)  # type: ignore[arg-type]
        if size % chunks:
            return None
        sizes = [size // chunks] * chunks
    elif isinstance(arg, int):
        sizes = [arg] * (size // arg) + ([size % arg] if size % arg else [])
    else:
        sizes = [int(s) for s in arg]  # type: ignore[union-attr]
    if len(sizes) < 2 or sum(sizes) != size or any(s <= 0 for s in sizes):
        return None
    return dim, tuple(sizes)


def section_hints(node: fx.Node) -> tuple[Hint, ...]:
    """The (dim, sections) of every split among ``node``'s users, deduplicated, in user order."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        return ()
    hints: dict[Hint, None] = {}
    for user in node.users:
        if user.args and user.args[0] is node:
            hint = split_sections(user.target, user.args, dict(user.kwargs), tuple(value.shape))
            if hint is not None:
                hints[hint] = None
    return tuple(hints)


def _linear_options(call: OpCall, hints: Sequence[Hint]) -> list[AxisStrategy]:
    """linear(x[..., k], w[n, k], b[n]): the output's last dim section-sharded, x Replicate,
    w (and b) section-sharded along n (a column-parallel fused projection)."""
    out = call.outputs[0]
    options = []
    for dim, sections in hints:
        if out is None or dim != out.ndim - 1:
            continue
        weight = SectionShard(0, sections)
        inputs = (REPLICATE, weight, weight) if len(call.inputs) > 2 else (REPLICATE, weight)
        options.append(AxisStrategy(outputs=(SectionShard(dim, sections),), inputs=inputs))
    return options


def _split_options(call: OpCall) -> list[AxisStrategy]:
    """A split at the section boundaries: the section-sharded input gives plain Shard pieces."""
    inp = call.inputs[0]
    if not isinstance(inp, TensorMeta):
        return []
    hint = split_sections(call.op, call.args, call.kwargs, inp.shape)
    if hint is None:
        return []
    dim, sizes = hint
    return [
        AxisStrategy(
            outputs=tuple(Shard(dim) for _ in call.outputs),
            inputs=(SectionShard(dim, sizes),),
        )
    ]


def section_strategies(node: fx.Node, mesh_shape: Sequence[int]) -> list[Strategy]:
    """The strategies of ``node`` that section-shard a tensor on some axis (empty for other ops):
    the registry rule's per-axis options plus the section options, expanded over the mesh,
    keeping the combinations with a SectionShard."""
    call = op_call(node)
    if node.target is aten.linear.default:
        extra = _linear_options(call, section_hints(node))
    elif node.target in SPLIT_OPS:
        extra = _split_options(call)
    else:
        return []
    rule = get_rule(node.target)
    if not extra or rule is None:
        return []
    return [
        s
        for s in expand(call, [*rule(call), *extra], mesh_shape)
        if any(p is not None and section_axis(p) is not None for p in (*s.inputs, *s.outputs))
    ]


def fused_param_sections(gm: fx.GraphModule) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Placeholder -> the sections of every fused projection (``linear``) whose weight or bias
    it is and whose output a split cuts into sections along the last dim."""
    found: dict[str, dict[tuple[int, ...], None]] = {}
    for node in gm.graph.nodes:
        if node.target is not aten.linear.default:
            continue
        ndim = node.meta["val"].dim()
        sections = [s for dim, s in section_hints(node) if dim == ndim - 1]
        for inp in input_nodes(node)[1:3] if sections else ():
            if inp.op == "placeholder":
                found.setdefault(inp.name, {}).update(dict.fromkeys(sections))
    return {name: tuple(s) for name, s in found.items()}
