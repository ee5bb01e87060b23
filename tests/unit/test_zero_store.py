"""The ZeRO chunk store's layout on every coordinate of a mesh (no process group: building the
chunks communicates nothing)."""

from __future__ import annotations

import itertools

import pytest
import torch

from autopar.runtime.zero_layout import ZeroMesh
from autopar.runtime.zero_store import ChunkStore


def _no_group(axis: int) -> None:
    raise AssertionError(f"building chunks must not use a process group (axis {axis})")


def _stores(stages: tuple[int, int], mixed: bool) -> list[tuple[ChunkStore, list]]:
    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (4, 4), (1,), (9, 2)]
    params = [
        (f"p{i}", torch.randn(shape), (0, 1), (0, 1) if i % 2 else (1,))
        for i, shape in enumerate(shapes)
    ]
    out = []
    for coords in itertools.product(range(2), range(2)):
        store = ChunkStore(
            params,
            stages=stages,
            mesh=ZeroMesh((2, 2), coords, _no_group),
            chunk_bytes=4 * 24,
            compute_dtype=torch.bfloat16 if mixed else None,
            read_flat=None,
            device=None,
        )
        out.append((store, params))
    return out


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stages", [(3, 3), (3, 1), (2, 1), (1, 1), (1, 3), (1, 2)])
def test_every_element_lies_in_exactly_one_shard_and_holds_its_value(
    stages: tuple[int, int], mixed: bool
) -> None:
    stores = _stores(stages, mixed)
    for fqn, value, _, _ in stores[0][1]:
        seen = torch.zeros(value.numel(), dtype=torch.int64)
        for store, _ in stores:
            shard = store.shard_params[fqn]
            lo = store.slot_of(shard)[1].param_lo
            seen[lo : lo + shard.numel()] += 1
            assert torch.equal(shard.detach(), store.piece_of(shard, value))
            assert store.zero_axes_of(shard) == tuple(sorted((0, 1), key=lambda a: -stages[a]))
        assert seen.tolist() == [1] * value.numel(), fqn


@pytest.mark.parametrize("stages", [(3, 3), (3, 1), (2, 1), (1, 3)])
def test_chunks_follow_first_use_and_the_kept_buffer_covers_the_shard(
    stages: tuple[int, int],
) -> None:
    for store, params in _stores(stages, mixed=False):
        first_use = {fqn: i for i, (fqn, _, _, _) in enumerate(params)}
        firsts = [first_use[c.slots[0].fqn] for c in store.chunks]
        assert firsts == sorted(firsts)
        for chunk in store.chunks:
            assert chunk.kept is not None and chunk.shard is not None
            assert chunk.kept.numel() == chunk.kept_numel
            assert chunk.kept_numel * 2**chunk.num_param_axes == chunk.numel
            assert chunk.shard.data_ptr() == chunk.kept[chunk.shard_in_kept :].data_ptr()
        assert 0.0 <= store.padding_fraction < 0.5


def test_a_half_precision_parameter_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="build the model in fp32"):
        ChunkStore(
            [("w", torch.zeros(4, dtype=torch.float16), (0,), (0,))],
            stages=(1,),
            mesh=ZeroMesh((2,), (0,), _no_group),
            chunk_bytes=64,
            compute_dtype=None,
            read_flat=None,
            device=None,
        )
