"""Which all-reduced values may share one flat buffer (``autopar_all_reduce_many``).

One rule for the lowering, which fuses back-to-back all-reduces
(:mod:`autopar.lowering.fused_reductions`), and the planner, which prices what it issues
(:mod:`autopar.planner.fused_pricing`): members share one float dtype (the most common one
among them); an integer joins only when it is a count -- ``sum`` of a bool tensor -- whose
global bound (the bool tensor's element count) the buffer's dtype represents exactly, so its sum
and the conversion back are exact; at most :data:`MAX_FUSED_NUMEL` elements in all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.fx as fx

__all__ = ["MAX_FUSED_NUMEL", "buffer_members", "count_bound", "tensor_value"]

aten = torch.ops.aten

MAX_FUSED_NUMEL = 65536
"""Largest number of elements of one fused buffer (256 KiB in float32)."""

_EXACT_INTEGER_BOUND = {
    torch.float64: 2**53,
    torch.float32: 2**24,
    torch.bfloat16: 2**8,
    torch.float16: 2**11,
}
"""Largest integer up to which every integer is exactly representable in the dtype."""

_COUNT_SUMS = (aten.sum.default, aten.sum.dim_IntList)


def tensor_value(node: object) -> torch.Tensor | None:
    """``node.meta["val"]`` when ``node`` is an fx node holding one tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def count_bound(node: object) -> int | None:
    """The global bound of a count (``sum`` of a bool tensor): its input's element count."""
    if not isinstance(node, fx.Node) or node.target not in _COUNT_SUMS or not node.args:
        return None
    counted = tensor_value(node.args[0])
    if counted is None or counted.dtype is not torch.bool:
        return None
    return math.prod(counted.shape)


def buffer_members(values: Sequence[object]) -> tuple[torch.dtype, list[int]] | None:
    """The buffer's dtype and the positions of ``values`` (fx nodes, in issue order) that may
    share it (module docstring), or None when fewer than two may."""
    tensors = [tensor_value(v) for v in values]
    floats = [t.dtype for t in tensors if t is not None and t.is_floating_point()]
    if not floats:
        return None
    dtype = max(set(floats), key=floats.count)
    members: list[int] = []
    numel = 0
    for k, (value, tensor) in enumerate(zip(values, tensors, strict=True)):
        if tensor is None:
            continue
        if tensor.dtype != dtype:
            bound = count_bound(value) if not tensor.is_floating_point() else None
            if bound is None or bound > _EXACT_INTEGER_BOUND.get(dtype, 0):
                continue
        if numel + tensor.numel() > MAX_FUSED_NUMEL:
            continue
        members.append(k)
        numel += tensor.numel()
    return (dtype, members) if len(members) > 1 else None
