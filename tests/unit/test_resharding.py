"""reshard_steps: forward and backward steps are correct on any mesh, and cheap where they can be.

The judge is the in-process simulator: shard a full tensor as ``src``, run the forward steps,
assemble as ``dst``; shard the full gradient as the gradient of ``dst``, run the backward steps,
assemble as the gradient of ``src``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.placement import (
    Partial,
    Placement,
    Replicate,
    SectionShard,
    Shard,
    parse_placements,
)
from autopar.resharding.pricing import price_table
from autopar.resharding.simulator import assemble, shard_full, simulate_steps
from autopar.resharding.steps import Step, gradient_placements, is_supported_pair, reshard_steps

MESHES = [(1,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (1, 2), (2, 2, 2), (2, 1, 3), (3, 2, 2)]
DIM_SIZES = [1, 2, 3, 4, 6, 8, 12]


@st.composite
def placements_for(
    draw: st.DrawFn, shape: tuple[int, ...], mesh: tuple[int, ...]
) -> tuple[Placement, ...]:
    """Random S(d)/R/P per axis, and at most one SectionShard (sections drawn so each divides
    by the axis); a shard the shape cannot divide becomes Replicate."""
    choices: list[Placement] = [Replicate(), Partial()] + [Shard(d) for d in range(len(shape))]
    choices += [SectionShard(d, (shape[d],)) for d in range(len(shape))]  # sections drawn below
    counts = [1] * len(shape)
    section_dim = None
    sharded: set[int] = set()
    out: list[Placement] = []
    for axis_size in mesh:
        p = draw(st.sampled_from(choices))
        if isinstance(p, SectionShard):
            pieces = shape[p.dim] // axis_size
            if section_dim is not None or p.dim in sharded or shape[p.dim] % axis_size:
                p = Replicate()
            else:
                # Up to 3 sections whose sizes are multiples of the axis size, summing to the dim.
                cuts = sorted(draw(st.sets(st.integers(1, max(pieces - 1, 1)), max_size=2)))
                cuts = [c for c in cuts if c < pieces]
                bounds = [0, *cuts, pieces]
                sizes = tuple((b - a) * axis_size for a, b in zip(bounds, bounds[1:]))
                p = SectionShard(p.dim, sizes)
                section_dim = p.dim
        elif isinstance(p, Shard):
            if shape[p.dim] % (counts[p.dim] * axis_size) or p.dim == section_dim:
                p = Replicate()
            else:
                counts[p.dim] *= axis_size
                sharded.add(p.dim)
        out.append(p)
    return tuple(out)


@st.composite
def reshard_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple, tuple]:
    mesh = draw(st.sampled_from(MESHES))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from(DIM_SIZES)) for _ in range(ndim))
    src = draw(placements_for(shape, mesh))
    dst = draw(placements_for(shape, mesh))
    return mesh, shape, src, dst


def check_pair(mesh: tuple[int, ...], shape: tuple[int, ...], src: tuple, dst: tuple) -> None:
    forward, backward = reshard_steps(src, dst, shape, 8, mesh)
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) - 7.0
    out = simulate_steps(shard_full(full, src, mesh, seed=1), forward, mesh)
    torch.testing.assert_close(assemble(out, dst, mesh), full, rtol=0, atol=0)

    grad = torch.randint(-9, 10, shape, generator=torch.Generator().manual_seed(2)).double()
    grad_in = simulate_steps(shard_full(grad, gradient_placements(dst), mesh), backward, mesh)
    torch.testing.assert_close(
        assemble(grad_in, gradient_placements(src), mesh), grad, rtol=0, atol=0
    )

    # Gradients are never Partial, so the backward never needs a zero_out or an all_reduce.
    assert all(s.kind not in ("zero_out", "all_reduce") for s in backward)


@settings(max_examples=400, deadline=None)
@given(reshard_cases())
def test_forward_and_backward_steps_preserve_the_tensor_on_random_meshes(case) -> None:
    check_pair(*case)


@pytest.mark.parametrize("mesh", [(2, 2), (2, 3), pytest.param((2, 2, 2), marks=pytest.mark.slow)])
def test_every_pair_of_placements_on_small_meshes(mesh: tuple[int, ...]) -> None:
    shape = (12, 8) if len(mesh) < 3 else (8, 4)
    choices = ["R", "P", "S0", "S1"]
    for src_t in itertools.product(choices, repeat=len(mesh)):
        for dst_t in itertools.product(choices, repeat=len(mesh)):
            src = parse_placements(",".join(src_t))
            dst = parse_placements(",".join(dst_t))
            if is_supported_pair(src, dst, shape, mesh):
                check_pair(mesh, shape, src, dst)


def kinds(steps: tuple[Step, ...]) -> list[str]:
    return [s.kind for s in steps]


def test_equal_placements_need_no_steps() -> None:
    for text, mesh in [("S0", (4,)), ("P", (2,)), ("S0,S1", (2, 2)), ("P,S0,R", (2, 2, 2))]:
        p = parse_placements(text)
        assert reshard_steps(p, p, (8, 8), 4, mesh) == ((), ())


def test_shard_to_shard_on_one_axis_is_one_all_to_all() -> None:
    forward, backward = reshard_steps(
        parse_placements("S0"), parse_placements("S1"), (8, 16), 4, (4,)
    )
    assert forward == (Step(kind="all_to_all", axis=0, dim=0, dst_dim=1, nbytes=2 * 16 * 4),)
    assert backward == (Step(kind="all_to_all", axis=0, dim=1, dst_dim=0, nbytes=2 * 16 * 4),)
    # Same on the inner axis of a 2-D mesh when no other axis shards either dim.
    forward, _ = reshard_steps(
        parse_placements("R,S0"), parse_placements("R,S1"), (8, 16), 4, (2, 4)
    )
    assert kinds(forward) == ["all_to_all"] and forward[0].axis == 1


def test_partial_to_shard_is_reduce_scatter_with_all_gather_backward() -> None:
    forward, backward = reshard_steps(
        parse_placements("P"), parse_placements("S0"), (8, 16), 4, (4,)
    )
    assert forward == (Step(kind="reduce_scatter", axis=0, dim=0, nbytes=8 * 16 * 4),)
    assert backward == (Step(kind="all_gather", axis=0, dim=0, nbytes=8 * 16 * 4),)


def test_partial_to_replicate_is_all_reduce_with_identity_backward() -> None:
    forward, backward = reshard_steps(
        parse_placements("R,P"), parse_placements("R,R"), (8, 16), 2, (2, 4)
    )
    assert forward == (Step(kind="all_reduce", axis=1, nbytes=8 * 16 * 2),)
    assert backward == ()


def test_gather_and_slice_bytes_are_the_gathered_local_size() -> None:
    # dim 0 split over both axes of a 2x4 mesh: local (1, 16); gathering axis 1 gives (4, 16).
    forward, backward = reshard_steps(
        parse_placements("S0,S0"), parse_placements("S0,R"), (8, 16), 4, (2, 4)
    )
    assert forward == (Step(kind="all_gather", axis=1, dim=0, nbytes=4 * 16 * 4),)
    assert backward == (Step(kind="slice", axis=1, dim=0),)
    forward, backward = reshard_steps(
        parse_placements("R"), parse_placements("S1"), (8, 16), 4, (4,)
    )
    assert forward == (Step(kind="slice", axis=0, dim=1),)
    assert backward == (Step(kind="all_gather", axis=0, dim=1, nbytes=8 * 16 * 4),)


def test_axes_of_size_one_need_no_steps() -> None:
    forward, backward = reshard_steps(
        parse_placements("S0,P"), parse_placements("P,S1"), (8, 16), 4, (1, 4)
    )
    assert kinds(forward) == ["reduce_scatter"] and kinds(backward) == ["all_gather"]
    assert forward[0].axis == 1 and forward[0].dim == 1


def test_shard_to_partial_goes_through_replicate() -> None:
    forward, backward = reshard_steps(
        parse_placements("S0"), parse_placements("P"), (8, 16), 4, (2,)
    )
    assert kinds(forward) == ["all_gather", "zero_out"]
    assert kinds(backward) == ["slice"]


def test_non_sum_partial_and_non_divisible_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="Partial"):
        reshard_steps((Partial("max"),), (Replicate(),), (8,), 4, (2,))
    with pytest.raises(ValueError, match="not divisible"):
        reshard_steps((Shard(0),), (Replicate(),), (6,), 4, (4,))
    with pytest.raises(ValueError, match="axes"):
        reshard_steps((Shard(0),), (Replicate(), Replicate()), (8,), 4, (2,))
    assert not is_supported_pair((Partial("max"),), (Replicate(),), (8,), (2,))
    assert not is_supported_pair((Shard(0),), (Replicate(),), (6,), (4,))
    assert is_supported_pair((Shard(-1),), (Partial(),), (6, 4), (4,))


def test_assemble_detects_differing_replicas() -> None:
    shards = {(0,): torch.zeros(2), (1,): torch.ones(2)}
    with pytest.raises(ValueError, match="replicas differ"):
        assemble(shards, (Replicate(),), (2,))


def test_shard_full_follows_dtensor_chunk_order_for_a_dim_over_two_axes() -> None:
    full = torch.arange(8.0)
    shards = shard_full(full, parse_placements("S0,S0"), (2, 2))
    # Axis 0 is outermost: coordinate (i, j) holds chunk 2 * i + j.
    assert [shards[(i, j)].tolist() for i in range(2) for j in range(2)] == [
        [0.0, 1.0],
        [2.0, 3.0],
        [4.0, 5.0],
        [6.0, 7.0],
    ]


@given(reshard_cases())
@settings(max_examples=150, deadline=None)
def test_price_table_prices_reshard_steps_routes(case) -> None:
    """One search per source prices every destination as reshard_steps' own route does."""
    mesh, shape, src, dst = case

    def step_s(kind: str, axis: int, fraction: float) -> float:
        # Distinct weight per kind and axis so a wrong route or a dropped step shows.
        return fraction * (1 + STEP_WEIGHT[kind]) * (axis + 1) ** 2

    dsts = [dst, src, tuple(Partial("max") for _ in mesh)]
    fwd_t, bwd_t = price_table([src], dsts, shape, mesh, step_s)
    (fwd_s, same_f, bad_f), (bwd_s, same_b, bad_b) = fwd_t[0], bwd_t[0]
    fwd, bwd = reshard_steps(src, dst, shape, 1, mesh)
    total = math.prod(shape)
    want_f = sum(
        step_s(s.collective_kind, s.axis, s.nbytes / total) for s in fwd if s.is_collective
    )
    want_b = sum(
        step_s(s.collective_kind, s.axis, s.nbytes / total) for s in bwd if s.is_collective
    )
    assert fwd_s == pytest.approx(want_f, rel=1e-12, abs=1e-15)
    assert bwd_s == pytest.approx(want_b, rel=1e-12, abs=1e-15)
    assert (same_f, same_b) == (0.0, 0.0)
    assert math.isinf(bad_f) and math.isinf(bad_b)  # reshard_steps refuses non-sum Partial


STEP_WEIGHT = {"all_gather": 1, "all_reduce": 2, "reduce_scatter": 3, "all_to_all": 4}


def test_price_table_refuses_what_reshard_steps_refuses() -> None:
    """A source the shape cannot divide prices every other destination inf (equal placements
    cost nothing, as the planner prices them)."""
    dsts = [(Replicate(),), (Partial(),), (Shard(0),)]
    fwd, bwd = price_table([(Shard(0),)], dsts, (3,), (2,), lambda *a: 1.0)
    assert math.isinf(fwd[0, 0]) and math.isinf(bwd[0, 0])
    assert math.isinf(fwd[0, 1]) and math.isinf(bwd[0, 1])
    assert fwd[0, 2] == bwd[0, 2] == 0.0
