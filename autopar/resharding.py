"""Placement A -> placement B as a list of collective steps, priced and executed alike.

One function, :func:`reshard_steps`, decides both the forward steps and the backward steps of a
conversion; the cost model prices them and the runtime (``autopar.runtime.collectives``) executes
them, so a plan's predicted and executed communication agree.

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

The conditions keep DTensor's chunk order for a dim sharded over several axes (axis 0 outermost):
only the innermost sharding axis of a dim can be gathered in place, and a new sharding axis must
become the innermost one. ``S -> P`` is never a single step (it goes through ``R``).

The route is a cheapest path over the (small) space of placements: ``(num_dims + 2) ** num_axes``
states, e.g. 216 for a 4-D tensor on a 3-D mesh. A path's price is the bytes each device sends in
forward and backward under ring algorithms (all_gather and reduce_scatter ``(n-1)/n`` of the
gathered size, all_reduce ``2(n-1)/n``, all_to_all ``(n-1)/n`` of the local size), then the number
of collectives, then the number of steps. This picks the textbook routes (one all_to_all for
``S(i) -> S(j)``, reduce_scatter for ``P -> S``, all_reduce for ``P -> R``) and is correct by
construction on any mesh, because every step is one of the valid transitions above.

The gradient convention (DESIGN.md): a tensor's gradient has its placement, except that a
``Partial`` tensor's gradient is ``Replicate``. The backward steps are the reverse of the forward
steps, each mapped as in the table; they take the gradient of the destination layout to the
gradient of the source layout.

The simulator (:func:`simulate_steps`, :func:`shard_full`, :func:`assemble`) runs steps over a dict
of per-rank tensors in one process; it is the test oracle for both this module and the runtime.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import torch

from autopar.placement import (
    Partial,
    Placement,
    Placements,
    Replicate,
    Shard,
    divides,
    format_placements,
    local_shape,
)

__all__ = [
    "STEP_KINDS",
    "Step",
    "assemble",
    "gradient_placements",
    "is_supported_pair",
    "reshard_steps",
    "shard_full",
    "simulate_steps",
]

STEP_KINDS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "slice", "zero_out")
_COLLECTIVE_KINDS = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})

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

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise ValueError(f"unknown step kind {self.kind!r}; use one of {STEP_KINDS}")

    @property
    def is_collective(self) -> bool:
        return self.kind in _COLLECTIVE_KINDS

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


def _normalize(placements: Sequence[Placement], ndim: int, mesh_shape: Sequence[int]) -> Placements:
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
        elif isinstance(p, Replicate):
            out.append(_R)
        else:
            raise ValueError(f"unsupported placement {p!r}; use Shard, Replicate or Partial")
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
        src_n = _normalize(src, len(shape), mesh_shape)
        dst_n = _normalize(dst, len(shape), mesh_shape)
    except ValueError:
        return False
    return divides(shape, src_n, mesh_shape) and divides(shape, dst_n, mesh_shape)


def _shard_axes(state: Placements, dim: int) -> list[int]:
    return [axis for axis, p in enumerate(state) if isinstance(p, Shard) and p.dim == dim]


def _transitions(state: Placements, ndim: int) -> Iterator[tuple[str, int, int | None, int | None, Placement]]:
    """Valid single-axis steps from ``state``: (kind, axis, dim, dst_dim, new placement)."""
    for axis, p in enumerate(state):

        def can_add(dim: int, axis: int = axis) -> bool:
            return all(other < axis for other in _shard_axes(state, dim))

        if isinstance(p, Shard):
            if max(_shard_axes(state, p.dim)) != axis:
                continue  # gathering an outer axis would scramble the chunk order
            yield "all_gather", axis, p.dim, None, _R
            for dim in range(ndim):
                if dim != p.dim and can_add(dim):
                    yield "all_to_all", axis, p.dim, dim, Shard(dim)
        elif isinstance(p, Partial):
            yield "all_reduce", axis, None, None, _R
            for dim in range(ndim):
                if can_add(dim):
                    yield "reduce_scatter", axis, dim, None, Shard(dim)
        else:
            yield "zero_out", axis, None, None, _P
            for dim in range(ndim):
                if can_add(dim):
                    yield "slice", axis, dim, None, Shard(dim)



def _edge(
    kind: str,
    axis: int,
    dim: int | None,
    dst_dim: int | None,
    state: Placements,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> tuple[Step, Step | None, Fraction]:
    """The forward step, its backward step (None for identity) and its price (bytes sent per
    device, forward plus backward, under ring algorithms)."""
    local_bytes = math.prod(local_shape(shape, state, mesh_shape)) * itemsize
    size = mesh_shape[axis]
    ring = Fraction(size - 1, size)
    if kind == "all_gather":
        gathered = local_bytes * size
        return (Step(kind=kind, axis=axis, dim=dim, nbytes=gathered),
                Step(kind="slice", axis=axis, dim=dim), ring * gathered)
    if kind == "slice":  # the backward gathers back to the size before the slice
        return (Step(kind=kind, axis=axis, dim=dim),
                Step(kind="all_gather", axis=axis, dim=dim, nbytes=local_bytes), ring * local_bytes)
    if kind == "reduce_scatter":
        return (Step(kind=kind, axis=axis, dim=dim, nbytes=local_bytes),
                Step(kind="all_gather", axis=axis, dim=dim, nbytes=local_bytes),
                2 * ring * local_bytes)
    if kind == "all_reduce":
        return Step(kind=kind, axis=axis, nbytes=local_bytes), None, 2 * ring * local_bytes
    if kind == "all_to_all":
        return (Step(kind=kind, axis=axis, dim=dim, dst_dim=dst_dim, nbytes=local_bytes),
                Step(kind=kind, axis=axis, dim=dst_dim, dst_dim=dim, nbytes=local_bytes),
                2 * ring * local_bytes)
    assert kind == "zero_out", kind
    return Step(kind=kind, axis=axis), None, Fraction(0)


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
        a Partial tensor's gradient is Replicate). Both empty when ``src == dst``.

    Raises:
        ValueError: a non-sum Partial, a dim out of range, a placement list of the wrong length,
            or a sharding that does not divide the shape (autopar never pads).
    """
    shape_t = tuple(int(s) for s in shape)
    mesh_t = tuple(int(m) for m in mesh_shape)
    src_n = _normalize(src, len(shape_t), mesh_t)
    dst_n = _normalize(dst, len(shape_t), mesh_t)
    for name, placements in (("source", src_n), ("destination", dst_n)):
        local_shape(shape_t, placements, mesh_t)  # raises with the dim and sizes when not divisible
    return _search(src_n, dst_n, shape_t, int(itemsize), mesh_t)


@lru_cache(maxsize=65536)
def _search(
    src: Placements, dst: Placements, shape: tuple[int, ...], itemsize: int, mesh_shape: tuple[int, ...]
) -> tuple[tuple[Step, ...], tuple[Step, ...]]:
    """Cheapest path from ``src`` to ``dst`` over valid single-axis steps (Dijkstra)."""
    if src == dst:
        return (), ()
    ndim = len(shape)
    counter = itertools.count()
    zero = (Fraction(0), 0, 0)
    best: dict[Placements, tuple[Fraction, int, int]] = {src: zero}
    came_from: dict[Placements, tuple[Placements, Step, Step | None]] = {}
    heap: list[tuple[tuple[Fraction, int, int], int, Placements]] = [(zero, next(counter), src)]
    while heap:
        cost, _, state = heapq.heappop(heap)
        if state == dst:
            break
        if cost > best[state]:
            continue
        for kind, axis, dim, dst_dim, new_p in _transitions(state, ndim):
            new_state = state[:axis] + (new_p,) + state[axis + 1 :]
            if not divides(shape, new_state, mesh_shape):
                continue
            fwd, bwd, price = _edge(kind, axis, dim, dst_dim, state, shape, itemsize, mesh_shape)
            new_cost = (cost[0] + price, cost[1] + fwd.is_collective, cost[2] + 1)
            if new_state not in best or new_cost < best[new_state]:
                best[new_state] = new_cost
                came_from[new_state] = (state, fwd, bwd)
                heapq.heappush(heap, (new_cost, next(counter), new_state))
    assert dst in came_from, f"no route {format_placements(src)} -> {format_placements(dst)}"
    forward: list[Step] = []
    backward: list[Step] = []  # built from the last forward step to the first: already reversed
    state = dst
    while state != src:
        state, fwd, bwd = came_from[state]
        forward.append(fwd)
        if bwd is not None:
            backward.insert(0, bwd)
    forward.reverse()
    backward.reverse()
    return tuple(forward), tuple(backward)


# ---------------------------------------------------------------------------------------------
# In-process simulator: per-rank local tensors keyed by mesh coordinate.

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
    placements = _normalize(placements, full.dim(), mesh_shape)
    local_shape(full.shape, placements, mesh_shape)  # raises when not divisible
    gen = torch.Generator().manual_seed(seed)
    level: Shards = {(): full}
    for axis, p in enumerate(placements):
        size = mesh_shape[axis]
        next_level: Shards = {}
        for prefix, value in level.items():
            if isinstance(p, Shard):
                parts = [c.clone() for c in value.chunk(size, dim=p.dim)]
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
    placements = _normalize(placements, ndim, mesh_shape)
    level = dict(shards)
    for axis in reversed(range(len(mesh_shape))):
        p = placements[axis]
        next_level: Shards = {}
        for prefix in itertools.product(*(range(m) for m in mesh_shape[:axis])):
            parts = [level[prefix + (k,)] for k in range(mesh_shape[axis])]
            if isinstance(p, Shard):
                next_level[prefix] = torch.cat(parts, dim=p.dim)
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
