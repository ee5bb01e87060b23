"""The meshes and microbatch counts the stage planner weighs (``planner.pipeline``)."""

from __future__ import annotations

from dataclasses import dataclass

from cost_models import LinkSpec

MAX_MICROBATCH_FACTOR = 8
"""Microbatch counts up to this many times the stage count are weighed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshShape:
    """A ``pp x dp x tp`` mesh and the links of its axes."""

    pp: int
    dp: int
    tp: int
    pp_link: LinkSpec
    dp_link: LinkSpec
    tp_link: LinkSpec

    @property
    def label(self) -> str:
        return f"{self.pp}x{self.dp}x{self.tp}"


def mesh_shapes(
    devices: int, per_node: int, num_blocks: int, *, intra: LinkSpec, inter: LinkSpec
) -> list[MeshShape]:
    """Every ``pp x dp x tp = devices`` with ``tp`` dividing the node size and ``pp`` at most the
    number of blocks; an axis is on the intra-node link when it and the axes inside it fit in a
    node."""
    if devices < 1 or per_node < 1:
        raise ValueError(f"devices and per_node must be positive, got {devices} and {per_node}")
    if devices % per_node and devices > per_node:
        raise ValueError(
            f"{devices} devices do not fill whole nodes of {per_node}: give a multiple of "
            f"--per-node"
        )
    out = []
    for tp in _divisors(min(per_node, devices)):
        if devices % tp:
            continue
        for pp in _divisors(devices // tp):
            if pp > num_blocks:
                continue
            dp = devices // (tp * pp)
            out.append(
                MeshShape(
                    pp=pp,
                    dp=dp,
                    tp=tp,
                    pp_link=intra if devices <= per_node else inter,
                    dp_link=intra if dp * tp <= per_node else inter,
                    tp_link=intra,
                )
            )
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_counts(batch: int, dp: int, pp: int) -> list[int]:
    """``m`` dividing the batch with the microbatch dividing over ``dp``, at most
    ``MAX_MICROBATCH_FACTOR * pp`` (without stages, microbatches are gradient accumulation:
    ``m`` forward and backward passes of ``batch / m`` per optimizer step)."""
    limit = MAX_MICROBATCH_FACTOR * pp
    return [m for m in _divisors(batch) if m <= limit and (batch // m) % dp == 0]
