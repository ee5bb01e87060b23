"""Route prices as tables: [src, dst] seconds of every conversion of a node's placements.

:func:`price_table` prices the routes of :mod:`autopar.resharding.routes` (the same routes
:func:`autopar.resharding.steps.reshard_steps` returns) with a caller's per-step prices. One
route search per source serves a whole row, and the routes are cached as step counts, so a
table costs one matrix product per source once the shapes repeat (layers do).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np

from autopar.placement import Placement, local_shape
from autopar.resharding.routes import (
    COLLECTIVE_KINDS,
    Code,
    RawStep,
    divisible_counts,
    encode,
    routes_from,
)
from autopar.resharding.steps import normalize_placements

__all__ = ["price_table"]


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
) -> Code | None:
    """The placements as :func:`_route_table` indexes them, or None where :func:`reshard_steps`
    would raise (non-sum Partial, bad dim or length, a sharding that does not divide)."""
    return _checked_code(tuple(placements), shape, mesh_shape)


def _route_table(
    src_code: Code | None,
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    step_s: Callable[[str, int, float], float],
) -> tuple[dict[Code, int], np.ndarray, np.ndarray]:
    """Every placement reachable from ``src_code`` (:func:`_placement_code`) on its cheapest
    route: ``(code -> row, forward seconds, backward seconds)`` per row, priced by ``step_s``
    once per distinct (kind, axis, bytes) step. Empty for an invalid source."""
    if src_code is None:
        return {}, np.zeros(0), np.zeros(0)
    index, keys, fwd_counts, bwd_counts = _route_counts(
        src_code, len(shape), mesh_shape, divisible_counts(shape, mesh_shape)
    )
    unit_div = float(math.prod(mesh_shape) ** 2)
    prices = np.array([step_s(kind, axis, units / unit_div) for kind, axis, units in keys])
    if not keys:
        zeros = np.zeros(len(index))
        return index, zeros, zeros
    return index, fwd_counts @ prices, bwd_counts @ prices


@lru_cache(maxsize=8192)
def _route_counts(
    src: Code,
    ndim: int,
    mesh_shape: tuple[int, ...],
    divisible: tuple[frozenset[int], ...],
) -> tuple[dict[Code, int], tuple[tuple[str, int, int], ...], np.ndarray, np.ndarray]:
    """The cheapest routes from ``src`` as step counts: (state -> row, distinct priced steps
    (kind, axis, units), [row, step] forward counts, [row, step] backward counts). Only
    collectives on axes of size > 1 are counted (the others cost nothing)."""
    came_from = routes_from(src, ndim, mesh_shape, divisible)
    states = [src, *came_from]
    index = {state: k for k, state in enumerate(states)}
    key_of: dict[tuple[str, int, int], int] = {}
    routes: dict[Code, tuple[list[int], list[int]]] = {src: ([], [])}

    def priced(raw: RawStep | None) -> list[int]:
        if raw is None or raw[0] not in COLLECTIVE_KINDS or mesh_shape[raw[1]] == 1:
            return []
        return [key_of.setdefault((raw[0], raw[1], raw[4]), len(key_of))]

    def route(state: Code) -> tuple[list[int], list[int]]:
        chain: list[Code] = []
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
) -> Code | None:
    """The encoded, normalised placements, or None where :func:`reshard_steps` would raise
    (non-sum Partial, bad dim or length, a sharding that does not divide the shape)."""
    try:
        normal = normalize_placements(placements, len(shape), mesh_shape)
        local_shape(shape, normal, mesh_shape)
    except ValueError:
        return None
    return encode(normal)
