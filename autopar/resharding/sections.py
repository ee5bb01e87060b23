"""Section-sharded layouts (:class:`autopar.placement.SectionShard`): the local tensor math.

Under ``SectionShard(dim, sections)`` on an axis of ``num`` ranks, rank ``r`` holds piece ``r`` of
every section (each section cut into ``num`` equal pieces), concatenated in section order. So the
rank-order concatenation of the local tensors (what an all-gather along ``dim`` returns) is the
full tensor in *rank-major* order, and :func:`from_rank_major` puts it back in section order;
:func:`to_rank_major` is its inverse, after which rank ``r``'s local tensor is the ``r``-th
contiguous chunk. Conversions to and from other layouts go through these two reorderings (see
``reshard_steps``: ``gather_sections`` = all-gather then :func:`from_rank_major`,
``select_sections`` = :func:`to_rank_major` then the contiguous local slice), so every other
conversion is the existing contiguous machinery.

All functions are plain differentiable torch ops (split and cat).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.placement import Placement, Placements, Replicate, SectionShard, section_axis

__all__ = ["from_rank_major", "select_sections", "to_rank_major", "without_sections"]


def _piece_sizes(sections: Sequence[int], num: int) -> list[int]:
    return [size // num for size in sections]


def to_rank_major(full: torch.Tensor, dim: int, sections: Sequence[int], num: int) -> torch.Tensor:
    """``full`` (section order) reordered so that rank ``r``'s pieces form its ``r``-th chunk."""
    if num == 1 or len(sections) == 1:
        return full
    pieces = _piece_sizes(sections, num)
    parts = full.split([p for p in pieces for _ in range(num)], dim=dim)  # (section, rank)
    return torch.cat(
        [parts[s * num + r] for r in range(num) for s in range(len(sections))], dim=dim
    )


def from_rank_major(
    gathered: torch.Tensor, dim: int, sections: Sequence[int], num: int
) -> torch.Tensor:
    """Inverse of :func:`to_rank_major`: the rank-order concatenation of the local tensors of a
    section-sharded tensor, put back in section order."""
    if num == 1 or len(sections) == 1:
        return gathered
    pieces = _piece_sizes(sections, num)
    count = len(sections)
    parts = gathered.split([p for _ in range(num) for p in pieces], dim=dim)  # (rank, section)
    return torch.cat([parts[r * count + s] for s in range(count) for r in range(num)], dim=dim)


def select_sections(
    full: torch.Tensor, dim: int, sections: Sequence[int], num: int, index: int
) -> torch.Tensor:
    """Rank ``index``'s local tensor of ``full`` under ``SectionShard(dim, sections)`` over
    ``num`` ranks (a new tensor)."""
    pieces = _piece_sizes(sections, num)
    starts = [sum(sections[:s]) + index * pieces[s] for s in range(len(sections))]
    return torch.cat(
        [full.narrow(dim, start, size) for start, size in zip(starts, pieces)], dim=dim
    )


def without_sections(placements: Sequence[Placement]) -> Placements:
    """``placements`` with the :class:`SectionShard` axis (if any) made Replicate."""
    axis = section_axis(placements)
    if axis is None:
        return tuple(placements)
    return tuple(Replicate() if a == axis else p for a, p in enumerate(placements))


def sections_of(placements: Sequence[Placement]) -> tuple[int, SectionShard] | None:
    """(axis, placement) of the :class:`SectionShard` in ``placements``, or None."""
    axis = section_axis(placements)
    if axis is None:
        return None
    p = placements[axis]
    assert isinstance(p, SectionShard)
    return axis, p
