"""Placement A -> placement B as a list of collective steps: the contract of the package.

:func:`reshard_steps` decides both the forward steps and the backward steps of a conversion; the
cost model prices them (:mod:`autopar.resharding.pricing`) and the runtime
(``autopar.comm.collectives``) executes them, so a plan's predicted and executed communication
agree.

Every step acts on one mesh axis and moves the tensor between two valid layouts:

=============  ===========  =====================================  ===================
kind           transition   valid when (``axes(d)``: axes sharding  backward
                            dim d before the step)
=============  ===========  =====================================  ===================
all_gather     S(d) -> R    axis is the last of ``axes(d)``        slice
slice          R -> S(d)    every axis of ``axes(d)`` < axis       all_gather
all_reduce     P -> R       always                                 (identity)
reduce_scatter P -> S(d)    every axis of ``axes(d)`` < axis       all_gather
all_to_all     S(i) -> S(j) slice and gather conditions hold       all_to_all S(j)->S(i)
zero_out       R -> P       always                                 (identity)
=============  ===========  =====================================  ===================

A :class:`autopar.placement.SectionShard` axis converts through Replicate on that axis:
``gather_sections`` (SS -> R: all-gather along the dim, then the local reordering
:func:`autopar.resharding.sections.from_rank_major`; backward ``select_sections``) first, the
contiguous route between the two placements with that axis Replicate, then
``select_sections`` (R -> SS: a local selection; backward ``gather_sections``).

The conditions keep DTensor's chunk order for a dim sharded over several axes (axis 0 outermost):
only the innermost sharding axis of a dim can be gathered in place, and a new sharding axis must
become the innermost one. ``S -> P`` is never a single step (it goes through ``R``). The route
itself is the cheapest path of :mod:`autopar.resharding.routes`.

The gradient convention (DESIGN.md): a tensor's gradient has its placement, except that a
``Partial`` tensor's gradient is ``Replicate``. The backward steps are the reverse of the forward
steps, each mapped as in the table; they take the gradient of the destination layout to the
gradient of the source layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.placement import (
    Partial,
    Placement,
    Placements,
    Replicate,
    SectionShard,
    Shard,
    divides,
    format_placements,
    local_shape,
)
from autopar.resharding.routes import (
    COLLECTIVE_KINDS,
    RawStep,
    divisible_counts,
    encode,
    search_route,
)
from autopar.resharding.sections import sections_of, without_sections

__all__ = [
    "STEP_KINDS",
    "Step",
    "gradient_placements",
    "is_supported_pair",
    "normalize_placements",
    "reshard_steps",
]

STEP_KINDS = (
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "slice",
    "zero_out",
    "gather_sections",
    "select_sections",
)

_R = Replicate()
_P = Partial("sum")


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """One conversion on one mesh axis."""

    kind: str
    """One of :data:`STEP_KINDS`."""
    axis: int
    """The mesh axis whose group performs the step."""
    dim: int | None = None
    """Tensor dim gathered, scattered or sliced; for all_to_all the source dim (``Shard(dim)``)."""
    dst_dim: int | None = None
    """all_to_all only: the destination dim (``Shard(dst_dim)``)."""
    nbytes: float = 0.0
    """Bytes the cost model charges: the gathered (pre-scatter) local size for all_gather and
    reduce_scatter, the local size for all_reduce and all_to_all, 0 for slice and zero_out."""
    sections: tuple[int, ...] | None = None
    """gather_sections / select_sections only: the section sizes along ``dim``."""

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; use one of {STEP_KINDS}")

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS or self.kind == "gather_sections"

    @property
    def collective_kind(self) -> str | None:
        """The collective the step runs (for pricing), or None for a local step."""
        if self.kind == "gather_sections":
            return "all_gather"
        return self.kind if self.kind in COLLECTIVE_KINDS else None

    def __str__(self) -> str:
        if self.kind == "all_to_all":
            where = f"S{self.dim}->S{self.dst_dim}"
        elif self.dim is not None:
            where = f"dim {self.dim}"
        else:
            where = ""
        return f"{self.kind}(axis {self.axis}{', ' + where if where else ''}, {self.nbytes:g} B)"


def gradient_placements(placements: Sequence[Placement]) -> Placements:
    """The layout of a tensor's gradient: the tensor's own, with Partial replaced by Replicate."""
    return tuple(_R if isinstance(p, Partial) else p for p in placements)


def normalize_placements(
    placements: Sequence[Placement], ndim: int, mesh_shape: Sequence[int]
) -> Placements:
    """``placements`` with Shard dims made non-negative and Partial as ``Partial("sum")``.

    Raises:
        ValueError: a wrong number of placements, a non-sum Partial, or a dim out of range.
    """
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"placements {format_placements(placements)} have {len(placements)} entries "
            f"but the mesh {tuple(mesh_shape)} has {len(mesh_shape)} axes"
        )
    out: list[Placement] = []
    for p in placements:
        if isinstance(p, Partial):
            if p.reduce_op != "sum":
                raise ValueError(
                    f"Partial({p.reduce_op!r}) cannot be resharded: autopar supports only "
                    f"Partial('sum'); reduce the tensor first"
                )
            out.append(_P)
        elif isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"Shard({p.dim}) is out of range for a {ndim}-D tensor")
            out.append(Shard(p.dim % ndim))
        elif isinstance(p, SectionShard):
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"SectionShard({p.dim}) is out of range for a {ndim}-D tensor")
            out.append(SectionShard(p.dim % ndim, tuple(int(s) for s in p.sections)))
        elif isinstance(p, Replicate):
            out.append(_R)
        else:
            raise ValueError(
                f"unsupported placement {p!r}; use Shard, SectionShard, Replicate or Partial"
            )
    return tuple(out)


def is_supported_pair(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    shape: Sequence[int],
    mesh_shape: Sequence[int],
) -> bool:
    """Whether :func:`reshard_steps` can convert ``src`` to ``dst`` for this shape and mesh.

    False for non-sum Partials, out-of-range dims, wrong lengths and non-divisible shardings.
    """
    try:
        src_n = normalize_placements(src, len(shape), mesh_shape)
        dst_n = normalize_placements(dst, len(shape), mesh_shape)
    except ValueError:
        return False
    return divides(shape, src_n, mesh_shape) and divides(shape, dst_n, mesh_shape)


def reshard_steps(
    src: Sequence[Placement],
    dst: Sequence[Placement],
    shape: Sequence[int],
    itemsize: int,
    mesh_shape: Sequence[int],
) -> tuple[tuple[Step, ...], tuple[Step, ...]]:
    """The steps converting a tensor from ``src`` to ``dst`` placements, and their backward.

    Args:
        src, dst: one placement per mesh axis (Shard(dim), Replicate(), Partial("sum")).
        shape: the global shape of the tensor.
        itemsize: bytes per element (prices ``Step.nbytes``).
        mesh_shape: size of each mesh axis.

    Returns:
        ``(forward, backward)``: forward takes the ``src`` layout to ``dst``; backward takes the
        gradient of the ``dst`` layout to the gradient of the ``src`` layout (gradient convention:
        a Partial tensor's gradient is Replicate). Both empty when ``src == dst``; steps on
        axes of size 1 (identities) are left out.

    Raises:
        ValueError: a non-sum Partial, a dim out of range, a placement list of the wrong length,
            or a sharding that does not divide the shape (autopar never pads).
    """
    shape_t = tuple(int(s) for s in shape)
    mesh_t = tuple(int(m) for m in mesh_shape)
    src_n = normalize_placements(src, len(shape_t), mesh_t)
    dst_n = normalize_placements(dst, len(shape_t), mesh_t)
    local_shape(shape_t, src_n, mesh_t)  # raises with the dim and sizes when not divisible
    local_shape(shape_t, dst_n, mesh_t)
    if src_n == dst_n:
        return (), ()
    if sections_of(src_n) is not None or sections_of(dst_n) is not None:
        return _section_steps(src_n, dst_n, shape_t, int(itemsize), mesh_t)
    forward, backward = search_route(
        encode(src_n), encode(dst_n), len(shape_t), mesh_t, divisible_counts(shape_t, mesh_t)
    )
    total_bytes = math.prod(shape_t) * int(itemsize)
    unit_div = math.prod(mesh_t) ** 2

    def to_steps(raw: tuple[RawStep, ...]) -> tuple[Step, ...]:
        return tuple(
            Step(
                kind=kind,
                axis=axis,
                dim=dim,
                dst_dim=dst_dim,
                nbytes=float(total_bytes * units // unit_div),
            )
            for kind, axis, dim, dst_dim, units in raw
            # On an axis of size 1 every step is the identity: nothing to price or run.
            if mesh_t[axis] > 1
        )

    return to_steps(forward), to_steps(backward)


def _section_steps(
    src: Placements,
    dst: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> tuple[tuple[Step, ...], tuple[Step, ...]]:
    """A conversion with a SectionShard on either side: gather_sections, the contiguous route
    between the placements with that axis Replicate, select_sections (module docstring)."""
    src_r, dst_r = without_sections(src), without_sections(dst)
    mid_fwd, mid_bwd = reshard_steps(src_r, dst_r, shape, itemsize, mesh_shape)

    def gather(placements: Placements, replicated: Placements) -> tuple[Step, ...]:
        found = sections_of(placements)
        if found is None or mesh_shape[found[0]] == 1:
            return ()
        axis, p = found
        gathered_bytes = math.prod(local_shape(shape, replicated, mesh_shape)) * itemsize
        return (
            Step(
                kind="gather_sections",
                axis=axis,
                dim=p.dim,
                sections=p.sections,
                nbytes=float(gathered_bytes),
            ),
        )

    def select(placements: Placements) -> tuple[Step, ...]:
        found = sections_of(placements)
        if found is None or mesh_shape[found[0]] == 1:
            return ()
        axis, p = found
        return (Step(kind="select_sections", axis=axis, dim=p.dim, sections=p.sections),)

    forward = (*gather(src, src_r), *mid_fwd, *select(dst))
    dst_grad = gradient_placements(dst_r)
    backward = (*gather(dst, dst_grad), *mid_bwd, *select(src))
    return forward, backward
