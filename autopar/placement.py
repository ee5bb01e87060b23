"""Placements per mesh axis, in the vocabulary of ``torch.distributed.tensor``.

A tensor's layout on an N-D mesh is a tuple of N placements, one per mesh axis:
``Shard(dim)``, ``Replicate()`` or ``Partial("sum")``. Compact notation: ``S0``, ``R``, ``P``,
joined by commas, e.g. ``"S0,R"`` for dim 0 split over axis 0 and replicated over axis 1.
A dim split over several axes is split in mesh-axis order (axis 0 outermost), as in DTensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]

__all__ = [
    "Partial",
    "Placement",
    "Placements",
    "Replicate",
    "Shard",
    "format_placement",
    "format_placements",
    "is_partial",
    "is_replicate",
    "is_shard",
    "local_shape",
    "parse_placements",
    "replicated",
    "shard_counts",
]

REPLICATE = Replicate()
PARTIAL = Partial("sum")


def is_shard(p: Placement, dim: int | None = None) -> bool:
    return isinstance(p, Shard) and (dim is None or p.dim == dim)


def is_replicate(p: Placement) -> bool:
    return isinstance(p, Replicate)


def is_partial(p: Placement) -> bool:
    return isinstance(p, Partial)


def replicated(num_axes: int) -> Placements:
    return (REPLICATE,) * num_axes


def format_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S{p.dim}"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "R"


def format_placements(placements: Sequence[Placement] | None) -> str:
    if placements is None:
        return "-"
    return ",".join(format_placement(p) for p in placements)


def parse_placements(text: str) -> Placements:
    """Inverse of :func:`format_placements` (``"S0,R,P"`` -> ``(Shard(0), Replicate(), Partial())``)."""
    out: list[Placement] = []
    for token in text.split(","):
        token = token.strip()
        if token == "R":
            out.append(REPLICATE)
        elif token == "P":
            out.append(PARTIAL)
        elif token.startswith("P(") and token.endswith(")"):
            out.append(Partial(token[2:-1]))
        elif token.startswith("S") and token[1:].lstrip("-").isdigit():
            out.append(Shard(int(token[1:])))
        else:
            raise ValueError(f"unknown placement {token!r} in {text!r}; use S<dim>, R or P")
    return tuple(out)


def shard_counts(placements: Sequence[Placement], mesh_shape: Sequence[int], ndim: int) -> list[int]:
    """How many ways each tensor dim is split (product of the sizes of the axes sharding it)."""
    counts = [1] * ndim
    for p, axis_size in zip(placements, mesh_shape, strict=True):
        if isinstance(p, Shard):
            counts[p.dim % ndim if ndim else 0] *= axis_size
    return counts


def local_shape(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Per-device shape of an evenly sharded tensor (Partial and Replicate keep the full size).

    Raises ValueError when a sharded dim is not divisible: autopar never pads.
    """
    shape = list(global_shape)
    counts = shard_counts(placements, mesh_shape, len(shape))
    for dim, n in enumerate(counts):
        if shape[dim] % n:
            raise ValueError(
                f"dim {dim} of size {shape[dim]} is not divisible by {n} "
                f"(placements {format_placements(placements)} on mesh {tuple(mesh_shape)})"
            )
        shape[dim] //= n
    return tuple(shape)


def divides(global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    counts = shard_counts(placements, mesh_shape, len(global_shape))
    return all(size % n == 0 for size, n in zip(global_shape, counts))


def num_local_elements(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> int:
    return math.prod(local_shape(global_shape, placements, mesh_shape))
