"""Route prices as tables: [src, dst] seconds of every conversion of a node's placements.

:func:`price_table` prices the routes of :mod:`autopar.resharding.routes` (the same routes
:func:`autopar.resharding.steps.reshard_steps` returns) with a caller's per-step prices. One
route search per source serves a whole row, and the routes are cached as step counts, so a
table costs one matrix product per source once the shapes repeat (layers do).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from functools import lru_cache

import numpy as np

from autopar.placement import Placement, SectionShard, Shard, local_shape, shard_counts
from autopar.resharding.routes import (
    COLLECTIVE_KINDS,
    Code,
    RawStep,
    divisible_counts,
    encode,
    routes_from,
)
from autopar.resharding.sections import sections_of, without_sections
from autopar.resharding.steps import gradient_placements, normalize_placements

__all__ = ["price_table"]


def price_table(
    srcs: Sequence[Sequence[Placement]],
    dsts: Sequence[Sequence[Placement]],
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    step_s: Callable[[str, int, float], float],
    *,
    memo: dict | None = None,
    price_key: Hashable = None,
) -> tuple[np.ndarray, np.ndarray]:
    """[src, dst] seconds of converting each of ``srcs`` to each of ``dsts``, as (forward,
    backward) arrays: the sum of ``step_s(kind, axis, bytes per full-tensor byte)`` over the
    collective steps of :func:`reshard_steps`'s route (steps on axes of size 1 left out); 0
    where the placements are equal; inf where :func:`reshard_steps` raises. One route search
    per source serves the whole row, and each destination is encoded once.

    ``memo`` (a dict the caller keeps, initially empty) carries work across calls: each
    source's priced routes per ``price_key``, which must identify ``step_s`` (calls with equal
    keys and equal shapes must pass step_s functions giving equal prices), each step's price,
    and each source's destination rows per destination list. The tables are the same floats
    with or without it.

    A placement with a :class:`SectionShard` is priced as ``reshard_steps`` routes it: the
    gather_sections all-gather, the contiguous route with that axis Replicate, the local
    selection (:func:`_with_sections`). ``shape`` may be a divisibility pattern (gcd of each
    size with the device count, as the planner passes it): the section sizes are then checked
    for divisibility by the axis, not for their sum, which the strategy rules guarantee."""
    if any(isinstance(p, SectionShard) for pls in (*srcs, *dsts) for p in pls):
        return _with_sections(srcs, dsts, shape, mesh_shape, step_s, memo, price_key)
    shape_t = tuple(int(s) for s in shape)
    mesh_t = tuple(int(m) for m in mesh_shape)
    dst_codes = tuple(_placement_code(dst, shape_t, mesh_t) for dst in dsts)
    if memo is None:
        memo = {}
        price_key = None
    rows_of = memo.setdefault(("rows", shape_t, mesh_t, dst_codes), {})
    routes = memo.setdefault(("routes", shape_t, mesh_t, price_key), {})
    step_prices = memo.setdefault(("steps", mesh_t, price_key), {})
    same = {tuple(dst): j for j, dst in enumerate(dsts)}
    fwd_table = np.full((len(srcs), len(dsts)), math.inf)
    bwd_table = np.full((len(srcs), len(dsts)), math.inf)
    for i, src in enumerate(srcs):
        src_code = _placement_code(src, shape_t, mesh_t)
        routed = routes.get(src_code)
        if routed is None:
            routed = routes[src_code] = _route_table(src_code, shape_t, mesh_t, step_s, step_prices)
        index, fwd, bwd = routed
        if index:
            found_rows = rows_of.get(src_code)
            if found_rows is None:
                rows = np.array([index.get(c, -1) for c in dst_codes], dtype=np.intp)  # type: ignore
                found = rows >= 0
                found_rows = rows_of[src_code] = (rows[found], found)
            rows, found = found_rows
            fwd_table[i, found] = fwd[rows]
            bwd_table[i, found] = bwd[rows]
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
    step_prices: dict[tuple[str, int, int], float],
) -> tuple[dict[Code, int], np.ndarray, np.ndarray]:
    """Every placement reachable from ``src_code`` (:func:`_placement_code`) on its cheapest
    route: ``(code -> row, forward seconds, backward seconds)`` per row, priced by ``step_s``
    once per distinct (kind, axis, bytes) step (memoised in ``step_prices``). Empty for an
    invalid source."""
    if src_code is None:
        return {}, np.zeros(0), np.zeros(0)
    index, keys, fwd_counts, bwd_counts = _route_counts(
        src_code, len(shape), mesh_shape, divisible_counts(shape, mesh_shape)
    )
    unit_div = float(math.prod(mesh_shape) ** 2)
    prices = np.zeros(len(keys))
    for k, key in enumerate(keys):
        price = step_prices.get(key)
        if price is None:
            kind, axis, units = key
            price = step_prices[key] = step_s(kind, axis, units / unit_div)
        prices[k] = price
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
    collectives on axes of size > 1 are counted (the others cost nothing).

    Steps are numbered in the order they are first met walking each state's route from the
    source (states in search order), which fixes the column order of the counts and hence the
    summation order of ``counts @ prices``. The counts are then summed along parent links with
    numpy, one pass per route length."""
    came_from = routes_from(src, ndim, mesh_shape, divisible)
    states = [src, *came_from]
    index = {state: k for k, state in enumerate(states)}
    key_of: dict[tuple[str, int, int], int] = {}
    parent = np.zeros(len(states), dtype=np.intp)
    fwd_key = np.full(len(states), -1, dtype=np.intp)
    bwd_key = np.full(len(states), -1, dtype=np.intp)

    def priced(raw: RawStep | None) -> int:
        if raw is None or raw[0] not in COLLECTIVE_KINDS or mesh_shape[raw[1]] == 1:
            return -1
        return key_of.setdefault((raw[0], raw[1], raw[4]), len(key_of))

    done = {src}
    for state in states:
        chain: list[Code] = []
        while state not in done:
            chain.append(state)
            state = came_from[state][0]
        for node in reversed(chain):
            before, fwd, bwd = came_from[node]
            row = index[node]
            parent[row] = index[before]
            fwd_key[row] = priced(fwd)
            bwd_key[row] = priced(bwd)
            done.add(node)
    fwd_counts = _sum_along_routes(parent, fwd_key, len(key_of))
    bwd_counts = _sum_along_routes(parent, bwd_key, len(key_of))
    return index, tuple(key_of), fwd_counts, bwd_counts


def _sum_along_routes(parent: np.ndarray, key: np.ndarray, num_keys: int) -> np.ndarray:
    """[row, key] how many steps of each key lie on the route to each row (row 0, the source,
    is every route's root; ``key`` -1 where a row's last step is not counted)."""
    counts = np.zeros((len(parent), num_keys))
    rows = np.arange(len(parent))
    at = rows.copy()
    while True:
        live = at != 0
        if not live.any():
            return counts
        rows, at = rows[live], at[live]
        keys = key[at]
        counted = keys >= 0
        counts[rows[counted], keys[counted]] += 1.0  # rows are distinct within a pass
        at = parent[at]


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


def _with_sections(srcs, dsts, shape, mesh_shape, step_s, memo, price_key):
    """:func:`price_table` where some placements carry a SectionShard (see there)."""
    fwd, bwd = price_table(
        [without_sections(p) for p in srcs],
        [without_sections(p) for p in dsts],
        shape,
        mesh_shape,
        step_s,
        memo=memo,
        price_key=price_key,
    )
    fwd, bwd = fwd.copy(), bwd.copy()

    def gather_s(placements: Sequence[Placement], replicated: Sequence[Placement]) -> float:
        found = sections_of(placements)
        if found is None or mesh_shape[found[0]] == 1:
            return 0.0
        axis, p = found
        ndim = len(shape)
        if not -ndim <= p.dim < ndim or any(size % mesh_shape[axis] for size in p.sections):
            return math.inf
        sharding = [q for q in placements if isinstance(q, (Shard, SectionShard))]
        if sum(1 for q in sharding if q.dim % ndim == p.dim % ndim) > 1:
            return math.inf  # the dim is also Shard on another axis
        fraction = 1.0 / math.prod(shard_counts(replicated, mesh_shape, ndim))
        return step_s("all_gather", axis, fraction)

    for i, src in enumerate(srcs):
        fwd[i, :] += gather_s(src, without_sections(src))
    for j, dst in enumerate(dsts):
        bwd[:, j] += gather_s(dst, gradient_placements(without_sections(dst)))
    for i, src in enumerate(srcs):
        if math.isfinite(gather_s(src, without_sections(src))):
            for j, dst in enumerate(dsts):
                if tuple(dst) == tuple(src):
                    fwd[i, j] = bwd[i, j] = 0.0
    return fwd, bwd
