"""Placement A -> placement B as a list of collective steps, priced and executed alike.

One function, :func:`reshard_steps`, decides both the forward steps and the backward steps of a
conversion; the cost model prices them and the runtime (``autopar.comm.collectives``) executes
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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
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
    "price_table",
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


# ---------------------------------------------------------------------------------------------
# Route search. States are placements encoded per axis as ints (_R, _P, or the sharded dim) so
# the search is cheap; prices are integers in units of (full tensor bytes) / prod(mesh)**2,
# exact because every shard count divides prod(mesh).

_CODE_R = -1
_CODE_P = -2
_Code = tuple[int, ...]
# (kind, axis, dim, dst_dim, nbytes in units): one step of a route before it is priced in bytes.
_RawStep = tuple[str, int, int | None, int | None, int]


def _encode(placements: Placements) -> _Code:
    return tuple(
        p.dim if isinstance(p, Shard) else _CODE_P if isinstance(p, Partial) else _CODE_R
        for p in placements
    )


def _divisible_counts(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> tuple[frozenset[int], ...]:
    """Per dim, the shard counts (products of sets of axis sizes) that divide its size."""
    counts = {
        math.prod(c)
        for r in range(len(mesh_shape) + 1)
        for c in itertools.combinations(mesh_shape, r)
    }
    return tuple(frozenset(c for c in counts if size % c == 0) for size in shape)


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
    src_n = _normalize(src, len(shape_t), mesh_t)
    dst_n = _normalize(dst, len(shape_t), mesh_t)
    local_shape(shape_t, src_n, mesh_t)  # raises with the dim and sizes when not divisible
    local_shape(shape_t, dst_n, mesh_t)
    forward, backward = _search(
        _encode(src_n), _encode(dst_n), len(shape_t), mesh_t, _divisible_counts(shape_t, mesh_t)
    )
    total_bytes = math.prod(shape_t) * int(itemsize)
    unit_div = math.prod(mesh_t) ** 2

    def to_steps(raw: tuple[_RawStep, ...]) -> tuple[Step, ...]:
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


def price_table(
    srcs: Sequence[Sequence[Placement]],
    dsts: Sequence[Sequence[Placement]],
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    step_s: Callable[[str, int, float], float],
) -> tuple[np.ndarray, np.ndarray]:
    """[src, dst] seconds of converting each of ``srcs`` to each of ``dsts``, as (forward,
    backward) arrays: the sum of ``step_s(kind, axis, bytes per full-tensor byte)`` over the
    collective steps of :func:`reshard_steps`'s route (steps on axes of size 1 left out); 0
    where the placements are equal; inf where :func:`reshard_steps` raises. One route search
    per source serves the whole row, and each destination is encoded once."""
    shape_t = tuple(int(s) for s in shape)
    mesh_t = tuple(int(m) for m in mesh_shape)
    dst_codes = [_placement_code(dst, shape_t, mesh_t) for dst in dsts]
    same = {tuple(dst): j for j, dst in enumerate(dsts)}
    fwd_table = np.full((len(srcs), len(dsts)), math.inf)
    bwd_table = np.full((len(srcs), len(dsts)), math.inf)
    for i, src in enumerate(srcs):
        src_code = _placement_code(src, shape_t, mesh_t)
        index, fwd, bwd = _route_table(src_code, shape_t, mesh_t, step_s)
        if index:
            rows = np.array([index.get(c, -1) for c in dst_codes], dtype=np.intp)  # type: ignore
            found = rows >= 0
            fwd_table[i, found] = fwd[rows[found]]
            bwd_table[i, found] = bwd[rows[found]]
        j = same.get(tuple(src))
        if j is not None:
            fwd_table[i, j] = bwd_table[i, j] = 0.0
    return fwd_table, bwd_table


def _placement_code(
    placements: Sequence[Placement], shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> _Code | None:
    """The placements as :func:`_route_table` indexes them, or None where :func:`reshard_steps`
    would raise (non-sum Partial, bad dim or length, a sharding that does not divide)."""
    return _checked_code(tuple(placements), shape, mesh_shape)


def _route_table(
    src_code: _Code | None,
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    step_s: Callable[[str, int, float], float],
) -> tuple[dict[_Code, int], np.ndarray, np.ndarray]:
    """Every placement reachable from ``src_code`` (:func:`_placement_code`) on its cheapest
    route: ``(code -> row, forward seconds, backward seconds)`` per row, priced by ``step_s``
    once per distinct (kind, axis, bytes) step. Empty for an invalid source."""
    if src_code is None:
        return {}, np.zeros(0), np.zeros(0)
    index, keys, fwd_counts, bwd_counts = _route_counts(
        src_code, len(shape), mesh_shape, _divisible_counts(shape, mesh_shape)
    )
    unit_div = float(math.prod(mesh_shape) ** 2)
    prices = np.array([step_s(kind, axis, units / unit_div) for kind, axis, units in keys])
    if not keys:
        zeros = np.zeros(len(index))
        return index, zeros, zeros
    return index, fwd_counts @ prices, bwd_counts @ prices


@lru_cache(maxsize=8192)
def _route_counts(
    src: _Code,
    ndim: int,
    mesh_shape: tuple[int, ...],
    divisible: tuple[frozenset[int], ...],
) -> tuple[dict[_Code, int], tuple[tuple[str, int, int], ...], np.ndarray, np.ndarray]:
    """The cheapest routes from ``src`` as step counts: (state -> row, distinct priced steps
    (kind, axis, units), [row, step] forward counts, [row, step] backward counts). Only
    collectives on axes of size > 1 are counted (the others cost nothing)."""
    came_from = _routes_from(src, ndim, mesh_shape, divisible)
    states = [src, *came_from]
    index = {state: k for k, state in enumerate(states)}
    key_of: dict[tuple[str, int, int], int] = {}
    routes: dict[_Code, tuple[list[int], list[int]]] = {src: ([], [])}

    def priced(raw: _RawStep | None) -> list[int]:
        if raw is None or raw[0] not in _COLLECTIVE_KINDS or mesh_shape[raw[1]] == 1:
            return []
        return [key_of.setdefault((raw[0], raw[1], raw[4]), len(key_of))]

    def route(state: _Code) -> tuple[list[int], list[int]]:
        chain: list[_Code] = []
        while state not in routes:
            chain.append(state)
            state = came_from[state][0]
        for node in reversed(chain):
            parent, fwd, bwd = came_from[node]
            before = routes[parent]
            routes[node] = (before[0] + priced(fwd), before[1] + priced(bwd))
        return routes[chain[0]] if chain else routes[state]

    for state in states:
        route(state)
    fwd_counts = np.zeros((len(states), len(key_of)))
    bwd_counts = np.zeros((len(states), len(key_of)))
    for state, (fwd, bwd) in routes.items():
        for k in fwd:
            fwd_counts[index[state], k] += 1
        for k in bwd:
            bwd_counts[index[state], k] += 1
    return index, tuple(key_of), fwd_counts, bwd_counts


@lru_cache(maxsize=65536)
def _checked_code(
    placements: tuple[Placement, ...], shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> _Code | None:
    """The encoded, normalised placements, or None where :func:`reshard_steps` would raise
    (non-sum Partial, bad dim or length, a sharding that does not divide the shape)."""
    try:
        normal = _normalize(placements, len(shape), mesh_shape)
        local_shape(shape, normal, mesh_shape)
    except ValueError:
        return None
    return _encode(normal)


def _transitions(
    state: _Code, mesh_shape: tuple[int, ...], ndim: int, units: int
) -> Iterator[tuple[int, _RawStep, _RawStep | None, int]]:
    """Valid single-axis steps from ``state`` with local size ``units``: (new placement code,
    forward step, backward step or None for identity, price = units sent forward + backward)."""
    for axis, p in enumerate(state):
        size = mesh_shape[axis]
        inner = state[axis + 1 :]
        # A dim can gain this axis only if no inner axis already shards it (chunk order).
        addable = [dim for dim in range(ndim) if dim not in inner and dim != p]
        ring_local = (size - 1) * (units // size)  # (n-1)/n of the local size
        if p >= 0:
            if p in inner:
                continue  # gathering an outer axis of a dim would scramble its chunk order
            gathered = units * size
            yield (
                _CODE_R,
                ("all_gather", axis, p, None, gathered),
                ("slice", axis, p, None, 0),
                (size - 1) * units,
            )
            for dim in addable:
                yield (
                    dim,
                    ("all_to_all", axis, p, dim, units),
                    ("all_to_all", axis, dim, p, units),
                    2 * ring_local,
                )
        elif p == _CODE_P:
            yield _CODE_R, ("all_reduce", axis, None, None, units), None, 2 * ring_local
            for dim in addable:
                yield (
                    dim,
                    ("reduce_scatter", axis, dim, None, units),
                    ("all_gather", axis, dim, None, units),
                    2 * ring_local,
                )
        else:
            yield _CODE_P, ("zero_out", axis, None, None, 0), None, 0
            for dim in addable:
                yield (
                    dim,
                    ("slice", axis, dim, None, 0),
                    ("all_gather", axis, dim, None, units),
                    ring_local,
                )


_Tree = dict[_Code, tuple[_Code, _RawStep, _RawStep | None]]


@lru_cache(maxsize=256)
def _state_graph(
    ndim: int, mesh_shape: tuple[int, ...], divisible: tuple[frozenset[int], ...]
) -> dict[_Code, list[tuple[_Code, _RawStep, _RawStep | None, int, int]]]:
    """Every valid placement (each dim's shard count divides it) and its valid single-axis
    steps: (new placement, forward step, backward step, price, 1 if a collective), in
    :func:`_transitions`' order. Shared by every route search on this mesh and pattern."""
    full_units = math.prod(mesh_shape) ** 2
    units_of: dict[_Code, int | None] = {}

    def local_units(state: _Code) -> int | None:
        if state not in units_of:
            counts = [1] * ndim
            for axis, p in enumerate(state):
                if p >= 0:
                    counts[p] *= mesh_shape[axis]
            units = None
            if all(c in divisible[dim] for dim, c in enumerate(counts)):
                units = full_units // math.prod(counts)
            units_of[state] = units
        return units_of[state]

    codes = (_CODE_R, _CODE_P, *range(ndim))
    graph: dict[_Code, list[tuple[_Code, _RawStep, _RawStep | None, int, int]]] = {}
    for state in itertools.product(codes, repeat=len(mesh_shape)):
        units = local_units(state)
        if units is None:
            continue
        steps = []
        for new_p, fwd, bwd, price in _transitions(state, mesh_shape, ndim, units):
            new_state = state[: fwd[1]] + (new_p,) + state[fwd[1] + 1 :]
            if local_units(new_state) is not None:
                steps.append((new_state, fwd, bwd, price, int(fwd[0] in _COLLECTIVE_KINDS)))
        graph[state] = steps
    return graph


@lru_cache(maxsize=4096)
def _routes_from(
    src: _Code,
    ndim: int,
    mesh_shape: tuple[int, ...],
    divisible: tuple[frozenset[int], ...],
) -> _Tree:
    """Cheapest routes from ``src`` to every reachable placement (Dijkstra over valid
    single-axis steps): the predecessor of each state on its cheapest route.

    Cost, compared in order: bytes sent per device forward plus backward, number of
    collectives, number of steps. One search serves every destination, so pricing all pairs of
    a node's placements costs one search per source placement. Depends on the shape only
    through ``divisible``.
    """
    graph = _state_graph(ndim, mesh_shape, divisible)
    counter = itertools.count()
    best: dict[_Code, tuple[int, int, int]] = {src: (0, 0, 0)}
    came_from: _Tree = {}
    heap: list[tuple[tuple[int, int, int], int, _Code]] = [((0, 0, 0), next(counter), src)]
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best[state]:
            continue
        for new_state, fwd, bwd, price, collective in graph[state]:
            new_cost = (cost[0] + price, cost[1] + collective, cost[2] + 1)
            if new_state not in best or new_cost < best[new_state]:
                best[new_state] = new_cost
                came_from[new_state] = (state, fwd, bwd)
                heapq.heappush(heap, (new_cost, next(counter), new_state))
    return came_from


@lru_cache(maxsize=65536)
def _search(
    src: _Code,
    dst: _Code,
    ndim: int,
    mesh_shape: tuple[int, ...],
    divisible: tuple[frozenset[int], ...],
) -> tuple[tuple[_RawStep, ...], tuple[_RawStep, ...]]:
    """Cheapest route from ``src`` to ``dst``: (forward steps, backward steps)."""
    if src == dst:
        return (), ()
    came_from = _routes_from(src, ndim, mesh_shape, divisible)
    assert dst in came_from, f"no route {src} -> {dst}"
    forward: list[_RawStep] = []
    backward: list[_RawStep] = []  # collected from the last forward step: already reversed
    state = dst
    while state != src:
        state, fwd, bwd = came_from[state]
        forward.append(fwd)
        if bwd is not None:
            backward.append(bwd)
    forward.reverse()
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
