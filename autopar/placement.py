"""Placements per mesh axis, in the vocabulary of ``torch.distributed.tensor``.

A tensor's layout on an N-D mesh is a tuple of N placements, one per mesh axis:
``Shard(dim)``, ``Replicate()`` or ``Partial("sum")``. Compact notation: ``S0``, ``R``, ``P``,
joined by commas, e.g. ``"S0,R"`` for dim 0 split over axis 0 and replicated over axis 1.
A dim split over several axes is split in mesh-axis order (axis 0 outermost), as in DTensor.

``SectionShard(dim, sections)`` (``S2[256:256:256]``) is autopar's own: ``dim`` is cut into
consecutive sections of the given sizes (a fused qkv projection's q, k and v) and EACH section is
split evenly over the axis, so rank ``r`` holds the ``r``-th piece of every section, concatenated
in section order (Megatron's per-rank order of a fused qkv). A ``split`` at the section
boundaries then runs locally and gives plain ``Shard(dim)`` pieces. At most one axis of a
placement tuple carries it, and no other axis shards that dim.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]

__all__ = [
    "Partial",
    "Placement",
    "Placements",
    "Replicate",
    "SectionShard",
    "Shard",
    "section_axis",
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

_SECTIONS = re.compile(r"S(-?\d+)\[(\d+(?::\d+)*)\]")

REPLICATE = Replicate()
PARTIAL = Partial("sum")


@dataclass(frozen=True, slots=True)
class SectionShard:
    """``dim`` cut into ``sections`` (sizes, in order), each section split evenly over the axis.

    Not a ``torch.distributed.tensor`` placement (DTensor's ``_StridedShard`` cannot express
    unequal sections): ``is_shard()`` is False so code written for contiguous shards never takes
    it for one; use :func:`section_axis` to find it.
    """

    dim: int
    sections: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.sections) < 1 or any(int(s) <= 0 for s in self.sections):
            raise ValueError(f"SectionShard sections must be positive sizes, got {self.sections}")

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


def section_axis(placements: Sequence[Placement]) -> int | None:
    """The mesh axis carrying a :class:`SectionShard`, or None."""
    for axis, p in enumerate(placements):
        if isinstance(p, SectionShard):
            return axis
    return None


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
    if isinstance(p, SectionShard):
        return f"S{p.dim}[{':'.join(str(s) for s in p.sections)}]"
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
        elif (match := _SECTIONS.fullmatch(token)) is not None:
            sizes = tuple(int(s) for s in match.group(2).split(":"))
            out.append(SectionShard(int(match.group(1)), sizes))
        else:
            raise ValueError(
                f"unknown placement {token!r} in {text!r}; use S<dim>, S<dim>[a:b:..], R or P"
            )
    return tuple(out)


def shard_counts(
    placements: Sequence[Placement], mesh_shape: Sequence[int], ndim: int
) -> list[int]:
    """How many ways each tensor dim is split (product of the sizes of the axes sharding it)."""
    counts = [1] * ndim
    for p, axis_size in zip(placements, mesh_shape, strict=True):
        if isinstance(p, (Shard, SectionShard)):
            counts[p.dim % ndim if ndim else 0] *= axis_size
    return counts


def _sections_error(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> str | None:
    """Why a SectionShard in ``placements`` is not valid for the shape, or None."""
    axis = section_axis(placements)
    if axis is None:
        return None
    p = placements[axis]
    assert isinstance(p, SectionShard)
    where = f"(placements {format_placements(placements)} on mesh {tuple(mesh_shape)})"
    ndim = len(global_shape)
    if not -ndim <= p.dim < ndim:
        return f"SectionShard({p.dim}) is out of range for a {ndim}-D tensor {where}"
    dim = p.dim % ndim
    if sum(1 for q in placements if isinstance(q, SectionShard)) > 1:
        return f"at most one mesh axis may carry a SectionShard {where}"
    if any(isinstance(q, Shard) and q.dim % ndim == dim for q in placements):
        return f"dim {dim} is both section-sharded and sharded {where}"
    if sum(p.sections) != global_shape[dim]:
        return (
            f"sections {p.sections} do not add up to dim {dim} of size {global_shape[dim]} {where}"
        )
    if any(size % mesh_shape[axis] for size in p.sections):
        return f"sections {p.sections} of dim {dim} are not divisible by {mesh_shape[axis]} {where}"
    return None


def local_shape(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> tuple[int, ...]:
    """Per-device shape of an evenly sharded tensor (Partial and Replicate keep the full size).

    Raises ValueError when a sharded dim is not divisible: autopar never pads.
    """
    error = _sections_error(global_shape, placements, mesh_shape)
    if error is not None:
        raise ValueError(error)
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


def divides(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> bool:
    if _sections_error(global_shape, placements, mesh_shape) is not None:
        return False
    ndim = len(global_shape)
    if any(isinstance(p, Shard) and not -ndim <= p.dim < ndim for p in placements):
        return False  # e.g. Shard(1) of a 1-D bias: no such dim to split
    counts = shard_counts(placements, mesh_shape, len(global_shape))
    return all(size % n == 0 for size, n in zip(global_shape, counts))


def num_local_elements(
    global_shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> int:
    return math.prod(local_shape(global_shape, placements, mesh_shape))
