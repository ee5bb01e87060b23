"""Chunk-size search for ZeRO: the planner records the chunk size, the runtime packs by it (torch-free).

Parameters are packed in order of first use into flat chunks (:func:`pack_chunks`); a chunk's
buffer is its content rounded up to a multiple of its shard count (:func:`chunk_numels`);
:func:`choose_chunk_bytes` picks the capacity that minimises padding waste.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "MIN_CHUNKS",
    "choose_chunk_bytes",
    "chunk_numels",
    "pack_chunks",
    "round_up",
]

DEFAULT_MAX_CHUNK_BYTES = 32 * 2**20
"""Upper end of the chunk-size search (the largest parameter raises it)."""

MIN_CHUNKS = 8
"""The chunk-size search stops at 1/8 of the parameters (or the largest parameter): stage 3
gathers about two chunks at a time (the one in use and the prefetched one), not the model, and
in every stage a chunk's gradients are reduced while backward goes on, with one chunk of
flattened gradients in flight rather than the whole model's."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_chunks(numels: Sequence[int], chunk_numel: int) -> list[list[int]]:
    """Indices of ``numels`` per chunk: in order, a new chunk when the next one does not fit.

    A parameter larger than ``chunk_numel`` gets a chunk of its own (of its size).
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(numels):
        if current and used + n > chunk_numel:
            chunks.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        chunks.append(current)
    return chunks


def chunk_numels(
    numels: Sequence[int], chunks: Sequence[Sequence[int]], chunk_numel: int, shards: int
) -> list[int]:
    """Buffer size of each chunk: ``chunk_numel`` (fixed-size chunks) or its content if larger,
    the last one trimmed to its content; all rounded up to a multiple of ``shards``."""
    sizes = []
    for k, members in enumerate(chunks):
        used = sum(numels[i] for i in members)
        size = used if k == len(chunks) - 1 else max(chunk_numel, used)
        sizes.append(round_up(max(size, 1), shards))
    return sizes


def choose_chunk_bytes(
    param_local_numels: Sequence[int],
    zero_shards: int,
    *,
    itemsize: int = 4,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    num_candidates: int = 512,
    min_chunks: int = 1,
) -> tuple[int, float]:
    """The chunk size (bytes) that minimises padding waste, and that waste as a fraction.

    Candidates run from the largest parameter (a parameter never spans chunks) to
    ``max_chunk_bytes``, in about ``num_candidates`` steps that are multiples of the shard count.
    Waste is measured for fixed-size buffers of the chosen size (a pool of equal buffers, as in
    ColossalAI's Gemini): the unused tail of every chunk plus the padding of the last one to a
    multiple of ``zero_shards``, over the total buffer size. Ties go to the larger chunk (fewer
    collectives). The size is the capacity the runtime packs parameters up to; it allocates each
    chunk at its content rounded up to the shard count (balanced shards, under ``zero_shards``
    elements of padding per chunk), so the returned fraction bounds its padding from above.

    Args:
        param_local_numels: elements of each parameter's local (tensor-parallel) block, in order
            of first use.
        zero_shards: number of shards of a chunk (product of the ZeRO axes' sizes).
        min_chunks: cap the size at ``1/min_chunks`` of the total (never below the largest
            parameter); the runtime and the planner pass :data:`MIN_CHUNKS`.
    """
    if zero_shards < 1:
        raise ValueError(f"zero_shards must be >= 1, got {zero_shards}")
    numels = [int(n) for n in param_local_numels if n > 0]
    if not numels:
        return round_up(max_chunk_bytes // itemsize, zero_shards) * itemsize, 0.0
    total = sum(numels)
    lo = round_up(max(numels), zero_shards)
    cap = min(max_chunk_bytes // itemsize, total, -(-total // max(1, min_chunks)))
    hi = max(lo, round_up(cap, zero_shards))
    step = max(zero_shards, round_up(max(1, (hi - lo) // num_candidates), zero_shards))
    candidates = list(range(lo, hi + 1, step))
    if candidates[-1] != hi:
        candidates.append(hi)
    best_numel, best_waste = lo, math.inf
    for chunk_numel in candidates:
        capacity = sum(
            chunk_numels(numels, pack_chunks(numels, chunk_numel), chunk_numel, zero_shards)
        )
        waste = (capacity - total) / capacity
        if waste <= best_waste:
            best_numel, best_waste = chunk_numel, waste
    return best_numel * itemsize, float(best_waste)
