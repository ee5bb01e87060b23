"""SectionShard: the placement of a fused projection whose sections are each split over an axis.

Its layout math (rank r holds piece r of every section), its notation, the errors for layouts it
cannot take, and its conversions (priced as executed). The conversions themselves are checked
by the resharding property tests (tests/unit/test_resharding.py draws SectionShards too) and on
gloo ranks (tests/distributed/test_collectives.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from autopar.placement import (
    Partial,
    Replicate,
    SectionShard,
    Shard,
    divides,
    format_placements,
    local_shape,
    parse_placements,
)
from autopar.resharding.pricing import price_table
from autopar.resharding.sections import from_rank_major, select_sections, to_rank_major
from autopar.resharding.simulator import assemble, shard_full
from autopar.resharding.steps import reshard_steps


def test_rank_r_holds_piece_r_of_every_section_in_section_order() -> None:
    # Unequal sections (grouped-query attention: q of 4, k and v of 2 each) on 2 ranks.
    full = torch.arange(8)
    locals_ = shard_full(full, (SectionShard(0, (4, 2, 2)),), (2,))
    assert locals_[(0,)].tolist() == [0, 1, 4, 6]
    assert locals_[(1,)].tolist() == [2, 3, 5, 7]
    assert torch.equal(assemble(locals_, (SectionShard(0, (4, 2, 2)),), (2,)), full)
    assert select_sections(full, 0, (4, 2, 2), 2, 1).tolist() == [2, 3, 5, 7]
    rank_major = to_rank_major(full, 0, (4, 2, 2), 2)
    assert rank_major.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert torch.equal(from_rank_major(rank_major, 0, (4, 2, 2), 2), full)


def test_notation_round_trips_and_local_shapes() -> None:
    placements = (Shard(0), SectionShard(2, (8, 8, 8)))
    assert format_placements(placements) == "S0,S2[8:8:8]"
    assert parse_placements("S0,S2[8:8:8]") == placements
    assert local_shape((4, 3, 24), placements, (2, 4)) == (2, 3, 6)


@pytest.mark.parametrize(
    ("placements", "shape", "message"),
    [
        ((SectionShard(0, (4, 2)),), (8,), "do not add up to dim 0 of size 8"),
        ((SectionShard(0, (3, 3)),), (6,), "not divisible by 2"),
        ((SectionShard(1, (2, 2)), Shard(1)), (2, 4), "both section-sharded and sharded"),
        ((SectionShard(0, (2, 2)), SectionShard(0, (2, 2))), (4,), "at most one mesh axis"),
        ((SectionShard(3, (2, 2)),), (4,), "out of range"),
    ],
)
def test_invalid_section_layouts_are_refused_in_one_line(placements, shape, message) -> None:
    mesh = (2,) * len(placements)
    assert not divides(shape, placements, mesh)
    with pytest.raises(ValueError, match=message) as error:
        local_shape(shape, placements, mesh)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError):
        parse_placements("S0[4:]")


def test_conversion_is_one_all_gather_plus_local_reorderings() -> None:
    src = (Replicate(), SectionShard(1, (8, 4, 4)))
    fwd, bwd = reshard_steps(src, (Replicate(), Replicate()), (2, 16), 4, (2, 2))
    assert [(s.kind, s.axis, s.nbytes) for s in fwd] == [("gather_sections", 1, 2 * 16 * 4)]
    assert [s.kind for s in bwd] == ["select_sections"]
    # To a contiguous shard of the same dim: gather then slice (no all_to_all).
    fwd, bwd = reshard_steps(src, (Replicate(), Shard(1)), (2, 16), 4, (2, 2))
    assert [s.kind for s in fwd] == ["gather_sections", "slice"]
    assert [s.kind for s in bwd] == ["all_gather", "select_sections"]
    # From a Partial: all-reduce, then the local selection.
    fwd, _ = reshard_steps((Partial(), Replicate()), src, (2, 16), 4, (2, 2))
    assert [s.kind for s in fwd] == ["all_reduce", "select_sections"]


def test_price_table_prices_section_conversions_as_their_steps() -> None:
    src = (Shard(0), SectionShard(1, (8, 4, 4)))
    dsts = [(Replicate(), Replicate()), (Shard(0), Shard(1)), src, (Partial(), Replicate())]

    def step_s(kind: str, axis: int, fraction: float) -> float:
        return fraction * {"all_gather": 1, "all_reduce": 3, "all_to_all": 7}[kind] * (axis + 2)

    fwd, bwd = price_table([src], dsts, (4, 16), (2, 2), step_s)
    for j, dst in enumerate(dsts):
        steps = reshard_steps(src, dst, (4, 16), 1, (2, 2))
        for table, direction in zip((fwd, bwd), steps):
            want = sum(
                step_s(s.collective_kind, s.axis, s.nbytes / 64)
                for s in direction
                if s.is_collective
            )
            assert math.isclose(table[0, j], want, rel_tol=1e-12, abs_tol=1e-15), (dst, direction)
    assert fwd[0, 2] == bwd[0, 2] == 0.0


def test_a_shard_dim_beyond_the_tensor_does_not_divide_it() -> None:
    """Only -ndim <= dim < ndim splits a tensor: Shard(1) of a 1-D bias is no layout."""
    assert not divides((8,), (Shard(1),), (2,))
    assert not divides((8,), (Shard(-2),), (2,))
    assert not divides((), (Shard(0),), (2,))
    assert divides((8,), (Shard(-1),), (2,))
    assert divides((8, 4), (Shard(1), Replicate()), (2, 2))
