"""Section-sharded tensors in the sharded (DCP) state dict: their contiguous form.

``torch.distributed.checkpoint`` needs each rank's shard to be one block of the full tensor (it
refuses ``_StridedShard``'s overlapping chunks), and a :class:`~autopar.placement.SectionShard`
block is not one. So the sharded form of a section-sharded tensor is the contiguous ``Shard`` of
its dim: :func:`convert_sections` converts a local value to it for saving (gather_sections then
a local slice) and back for loading (all-gather then the local selection), one collective over
the section axis per tensor, in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from autopar.comm.collectives import run_steps
from autopar.comm.process_groups import AxisGroups
from autopar.placement import Placement, SectionShard, Shard, section_axis
from autopar.resharding.steps import reshard_steps

__all__ = ["contiguous_sections", "convert_sections"]


def contiguous_sections(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    """``placements`` with a SectionShard replaced by the Shard of its dim."""
    return tuple(Shard(p.dim) if isinstance(p, SectionShard) else p for p in placements)


def convert_sections(
    placements: Sequence[Placement],
    local: torch.Tensor,
    groups: AxisGroups,
    *,
    to_contiguous: bool = True,
) -> torch.Tensor:
    """This rank's ``local`` value of a tensor laid out as ``placements``, converted to (or,
    with ``to_contiguous=False``, from) :func:`contiguous_sections`; unchanged without a
    SectionShard. A collective over the section axis."""
    axis = section_axis(placements)
    if axis is None:
        return local
    contiguous = contiguous_sections(placements)
    shape = list(local.shape)
    for a, p in enumerate(placements):
        if isinstance(p, (Shard, SectionShard)):
            shape[p.dim] *= groups.mesh_shape[a]
    src, dst = (placements, contiguous) if to_contiguous else (contiguous, placements)
    steps, _ = reshard_steps(src, dst, shape, local.element_size(), groups.mesh_shape)
    with torch.no_grad():
        return run_steps(local, steps, groups)
