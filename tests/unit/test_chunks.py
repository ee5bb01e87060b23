"""ZeRO chunk packing and the chunk-size search (no process group)."""

from __future__ import annotations

import pytest

from autopar.runtime.zero import choose_chunk_bytes, chunk_numels, pack_chunks


def test_packing_keeps_order_and_never_splits_a_parameter() -> None:
    numels = [4, 4, 6, 2, 10, 1]
    chunks = pack_chunks(numels, 8)
    assert chunks == [[0, 1], [2, 3], [4], [5]]
    assert [i for c in chunks for i in c] == list(range(len(numels)))
    # A parameter larger than the chunk gets a chunk of its own size.
    assert chunk_numels(numels, chunks, 8, 1) == [8, 8, 10, 1]


def test_chunk_sizes_are_padded_to_the_shard_count() -> None:
    numels = [3, 3, 5]
    chunks = pack_chunks(numels, 6)
    assert chunks == [[0, 1], [2]]
    assert chunk_numels(numels, chunks, 6, 4) == [8, 8]  # 6 -> 8, last trimmed 5 -> 8


def test_search_finds_a_zero_waste_size_when_one_exists() -> None:
    # Layers of 96 + 32 elements pack exactly into chunks of 128.
    numels = [96, 32] * 8
    chunk_bytes, waste = choose_chunk_bytes(numels, 2, itemsize=4, max_chunk_bytes=160 * 4)
    assert chunk_bytes % (2 * 4) == 0
    assert waste == 0.0


def test_search_minimises_waste_over_candidates() -> None:
    numels = [100, 60, 100, 60, 100, 60, 7]
    chunk_bytes, waste = choose_chunk_bytes(numels, 4, itemsize=4, max_chunk_bytes=400 * 4)
    size = chunk_bytes // 4
    assert size % 4 == 0 and size >= 100
    brute = min(
        sum(chunk_numels(numels, pack_chunks(numels, c), c, 4)) - sum(numels)
        for c in range(100, 401, 4)
    )
    got = sum(chunk_numels(numels, pack_chunks(numels, size), size, 4)) - sum(numels)
    assert got == brute
    assert waste == pytest.approx(got / (got + sum(numels)))


def test_search_edge_cases() -> None:
    assert choose_chunk_bytes([], 2)[1] == 0.0
    with pytest.raises(ValueError, match="zero_shards"):
        choose_chunk_bytes([4], 0)
    chunk_bytes, _ = choose_chunk_bytes([10**6], 8)
    assert chunk_bytes >= 10**6 * 4  # the largest parameter sets the lower end
