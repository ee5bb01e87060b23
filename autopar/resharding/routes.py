"""The route search: a cheapest path over the (small) graph of placements.

States are placements encoded per axis as ints (``Replicate``, ``Partial`` or the sharded dim), so
the search is cheap; there are ``(num_dims + 2) ** num_axes`` states, e.g. 216 for a 4-D tensor
on a 3-D mesh, and edges are the valid single-axis steps of the table in
:mod:`autopar.resharding.steps`. Prices are integers in units of (full tensor bytes) /
prod(mesh)**2, exact because every shard count divides prod(mesh).

A path's price is the bytes each device sends in forward and backward under ring algorithms
(all_gather and reduce_scatter ``(n-1)/n`` of the gathered size, all_reduce ``2(n-1)/n``,
all_to_all ``(n-1)/n`` of the local size), then the number of collectives, then the number of
steps. This picks the textbook routes (one all_to_all for ``S(i) -> S(j)``, reduce_scatter for
``P -> S``, all_reduce for ``P -> R``) and is correct by construction on any mesh, because every
step is one of the valid transitions.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator
from functools import lru_cache

from autopar.placement import Partial, Placements, Shard

__all__ = [
    "COLLECTIVE_KINDS",
    "Code",
    "RawStep",
    "divisible_counts",
    "encode",
    "routes_from",
    "search_route",
]

COLLECTIVE_KINDS = frozenset({"all_gather", "all_reduce", "reduce_scatter", "all_to_all"})

_CODE_R = -1
_CODE_P = -2
Code = tuple[int, ...]
# (kind, axis, dim, dst_dim, nbytes in units): one step of a route before it is priced in bytes.
RawStep = tuple[str, int, int | None, int | None, int]


def encode(placements: Placements) -> Code:
    """Normalised placements as a search state: the sharded dim, or -1 (R) / -2 (P) per axis."""
    return tuple(
        p.dim if isinstance(p, Shard) else _CODE_P if isinstance(p, Partial) else _CODE_R
        for p in placements
    )


def divisible_counts(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...]
) -> tuple[frozenset[int], ...]:
    """Per dim, the shard counts (products of sets of axis sizes) that divide its size."""
    counts = {
        math.prod(c)
        for r in range(len(mesh_shape) + 1)
        for c in itertools.combinations(mesh_shape, r)
    }
    return tuple(frozenset(c for c in counts if size % c == 0) for size in shape)


def _transitions(
    state: Code, mesh_shape: tuple[int, ...], ndim: int, units: int
) -> Iterator[tuple[int, RawStep, RawStep | None, int]]:
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


_Tree = dict[Code, tuple[Code, RawStep, RawStep | None]]


@lru_cache(maxsize=256)
def _state_graph(
    ndim: int, mesh_shape: tuple[int, ...], divisible: tuple[frozenset[int], ...]
) -> dict[Code, list[tuple[Code, RawStep, RawStep | None, int, int]]]:
    """Every valid placement (each dim's shard count divides it) and its valid single-axis
    steps: (new placement, forward step, backward step, price, 1 if a collective), in
    :func:`_transitions`' order. Shared by every route search on this mesh and pattern."""
    full_units = math.prod(mesh_shape) ** 2
    units_of: dict[Code, int | None] = {}

    def local_units(state: Code) -> int | None:
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
    graph: dict[Code, list[tuple[Code, RawStep, RawStep | None, int, int]]] = {}
    for state in itertools.product(codes, repeat=len(mesh_shape)):
        units = local_units(state)
        if units is None:
            continue
        steps = []
        for new_p, fwd, bwd, price in _transitions(state, mesh_shape, ndim, units):
            new_state = state[: fwd[1]] + (new_p,) + state[fwd[1] + 1 :]
            if local_units(new_state) is not None:
                steps.append((new_state, fwd, bwd, price, int(fwd[0] in COLLECTIVE_KINDS)))
        graph[state] = steps
    return graph


_PACK = 1 << 32
"""(bytes, collectives, steps) packed as ``(bytes * _PACK + collectives) * _PACK + steps``: one
int that orders as the tuple does, since a route has far fewer than 2**32 steps."""
_COUNTER_BITS = 40
"""Heap entries are one int, ``((cost << _COUNTER_BITS) | push number) << state bits | state``:
ordered by cost, then push order (unique), as ``(cost, push number, state)`` tuples are."""


@lru_cache(maxsize=256)
def _indexed_graph(
    ndim: int, mesh_shape: tuple[int, ...], divisible: tuple[frozenset[int], ...]
) -> tuple[list[Code], dict[Code, int], list[list[tuple[int, int, tuple]]]]:
    """:func:`_state_graph` over state numbers: (states, state -> number, per state its steps
    as (new state's number, packed cost (``_PACK``), (forward step, backward step)))."""
    graph = _state_graph(ndim, mesh_shape, divisible)
    states = list(graph)
    number = {state: k for k, state in enumerate(states)}
    steps = [
        [
            (number[new], (price * _PACK + collective) * _PACK + 1, (fwd, bwd))
            for new, fwd, bwd, price, collective in out
        ]
        for out in graph.values()
    ]
    return states, number, steps


@lru_cache(maxsize=4096)
def routes_from(
    src: Code,
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
    states, number, graph = _indexed_graph(ndim, mesh_shape, divisible)
    start = number[src]
    shift = max(len(states).bit_length(), 1)
    low = (1 << shift) - 1
    best: list[int | None] = [None] * len(states)
    best[start] = 0
    parent = [-1] * len(states)
    via: list[tuple | None] = [None] * len(states)
    found: list[int] = []  # in order of discovery (the tree's key order)
    pushes = 0
    heap = [start]
    while heap:
        key = heapq.heappop(heap)
        state = key & low
        cost = key >> (shift + _COUNTER_BITS)
        if cost > best[state]:  # type: ignore[operator]
            continue
        for new, step_cost, steps in graph[state]:
            new_cost = cost + step_cost
            known = best[new]
            if known is None or new_cost < known:
                if known is None:
                    found.append(new)
                best[new] = new_cost
                parent[new] = state
                via[new] = steps
                pushes += 1
                heapq.heappush(heap, (((new_cost << _COUNTER_BITS) | pushes) << shift) | new)
    return {states[k]: (states[parent[k]], *via[k]) for k in found}  # type: ignore[misc]


@lru_cache(maxsize=65536)
def search_route(
    src: Code,
    dst: Code,
    ndim: int,
    mesh_shape: tuple[int, ...],
    divisible: tuple[frozenset[int], ...],
) -> tuple[tuple[RawStep, ...], tuple[RawStep, ...]]:
    """Cheapest route from ``src`` to ``dst``: (forward steps, backward steps)."""
    if src == dst:
        return (), ()
    came_from = routes_from(src, ndim, mesh_shape, divisible)
    assert dst in came_from, f"no route {src} -> {dst}"
    forward: list[RawStep] = []
    backward: list[RawStep] = []  # collected from the last forward step: already reversed
    state = dst
    while state != src:
        state, fwd, bwd = came_from[state]
        forward.append(fwd)
        if bwd is not None:
            backward.append(bwd)
    forward.reverse()
    return tuple(forward), tuple(backward)
