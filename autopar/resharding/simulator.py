"""In-process simulator: steps executed over a dict of per-rank tensors keyed by coordinate.

:func:`simulate_steps`, :func:`shard_full` and :func:`assemble` run the steps of
:func:`autopar.resharding.steps.reshard_steps` in one process; they are the test oracle for both
the steps and the runtime's collectives.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch

from autopar.placement import Partial, Placement, SectionShard, Shard, local_shape
from autopar.resharding.sections import from_rank_major, select_sections, to_rank_major
from autopar.resharding.steps import Step, normalize_placements

__all__ = ["Shards", "assemble", "shard_full", "simulate_steps"]

Shards = dict[tuple[int, ...], torch.Tensor]


def _axis_groups(mesh_shape: Sequence[int], axis: int) -> Iterator[list[tuple[int, ...]]]:
    """The coordinates of each group along ``axis``, each ordered by its coordinate on ``axis``."""
    others = [range(m) if a != axis else range(1) for a, m in enumerate(mesh_shape)]
    for base in itertools.product(*others):
        yield [base[:axis] + (k,) + base[axis + 1 :] for k in range(mesh_shape[axis])]


def simulate_steps(shards: Shards, steps: Sequence[Step], mesh_shape: Sequence[int]) -> Shards:
    """Execute ``steps`` over per-rank local tensors as the runtime does (sum for reductions,
    gathers and all_to_all concatenate in coordinate order along the axis)."""
    out = dict(shards)
    for step in steps:
        size = mesh_shape[step.axis]
        new: Shards = {}
        for group in _axis_groups(mesh_shape, step.axis):
            locals_ = [out[c] for c in group]
            if step.kind == "all_gather":
                full = torch.cat(locals_, dim=step.dim)
                new.update({c: full.clone() for c in group})
            elif step.kind == "all_reduce":
                total = torch.stack(locals_).sum(0)
                new.update({c: total.clone() for c in group})
            elif step.kind == "reduce_scatter":
                parts = torch.stack(locals_).sum(0).chunk(size, dim=step.dim)
                new.update({c: parts[k].clone() for k, c in enumerate(group)})
            elif step.kind == "all_to_all":
                assert step.dim is not None and step.dst_dim is not None
                sent = [t.chunk(size, dim=step.dst_dim) for t in locals_]
                for k, c in enumerate(group):
                    new[c] = torch.cat([sent[s][k] for s in range(size)], dim=step.dim)
            elif step.kind == "slice":
                for k, c in enumerate(group):
                    new[c] = locals_[k].chunk(size, dim=step.dim)[k].clone()
            elif step.kind == "gather_sections":
                assert step.sections is not None
                gathered = torch.cat(locals_, dim=step.dim)
                full = from_rank_major(gathered, step.dim, step.sections, size)
                new.update({c: full.clone() for c in group})
            elif step.kind == "select_sections":
                assert step.sections is not None
                for k, c in enumerate(group):
                    ordered = to_rank_major(locals_[k], step.dim, step.sections, size)
                    new[c] = ordered.chunk(size, dim=step.dim)[k].clone()
            else:  # zero_out
                for k, c in enumerate(group):
                    new[c] = locals_[k].clone() if k == 0 else torch.zeros_like(locals_[k])
        out = new
    return out


def shard_full(
    full: torch.Tensor,
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    *,
    seed: int = 0,
) -> Shards:
    """Per-rank local tensors of ``full`` laid out as ``placements``.

    A Partial axis splits its value into random small-integer summands (deterministic in
    ``seed``) so sums are exact in floating point.
    """
    placements = normalize_placements(placements, full.dim(), mesh_shape)
    local_shape(full.shape, placements, mesh_shape)  # raises when not divisible
    gen = torch.Generator().manual_seed(seed)
    level: Shards = {(): full}
    for axis, p in enumerate(placements):
        size = mesh_shape[axis]
        next_level: Shards = {}
        for prefix, value in level.items():
            if isinstance(p, Shard):
                parts = [c.clone() for c in value.chunk(size, dim=p.dim)]
            elif isinstance(p, SectionShard):
                parts = [select_sections(value, p.dim, p.sections, size, k) for k in range(size)]
            elif isinstance(p, Partial):
                parts = [
                    torch.randint(-4, 5, value.shape, generator=gen).to(value.dtype)
                    for _ in range(size - 1)
                ]
                parts.append(value - sum(parts, torch.zeros_like(value)))
            else:
                parts = [value.clone() for _ in range(size)]
            next_level.update({prefix + (k,): part for k, part in enumerate(parts)})
        level = next_level
    return level


def assemble(
    shards: Shards,
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    *,
    check_replicas: bool = True,
) -> torch.Tensor:
    """The full tensor that per-rank ``shards`` represent under ``placements``.

    With ``check_replicas``, raises ValueError when ranks that should hold equal values along a
    Replicate axis do not (up to float rounding).
    """
    ndim = next(iter(shards.values())).dim()
    placements = normalize_placements(placements, ndim, mesh_shape)
    level = dict(shards)
    for axis in reversed(range(len(mesh_shape))):
        p = placements[axis]
        next_level: Shards = {}
        for prefix in itertools.product(*(range(m) for m in mesh_shape[:axis])):
            parts = [level[prefix + (k,)] for k in range(mesh_shape[axis])]
            if isinstance(p, Shard):
                next_level[prefix] = torch.cat(parts, dim=p.dim)
            elif isinstance(p, SectionShard):
                gathered = torch.cat(parts, dim=p.dim)
                next_level[prefix] = from_rank_major(gathered, p.dim, p.sections, len(parts))
            elif isinstance(p, Partial):
                next_level[prefix] = torch.stack(parts).sum(0)
            else:
                if check_replicas:
                    for k, part in enumerate(parts[1:], start=1):
                        if part.shape != parts[0].shape or not torch.allclose(part, parts[0]):
                            raise ValueError(
                                f"replicas differ along axis {axis} (Replicate) between "
                                f"coordinates {prefix + (0,)} and {prefix + (k,)}"
                            )
                next_level[prefix] = parts[0]
        level = next_level
    return level[()]
