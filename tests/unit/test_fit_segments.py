"""The fastest recomputation of a fixed plan (solver/checkpointing.py fit_segments, used by the
Lagrangian relaxation's fit_recompute): repeated groups of segments merged into counts give
the brute-force optimum over the original segments."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import InfeasibleError, Node, Problem
from solver.brute_force import brute_force_recompute
from solver.checkpointing import fit_segments, merge_alike, recompute_terms
from solver.problem import Segment

SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)

# Footprints of one layer's segments, as autopar proposes them (block > attention, MLP; a
# selective block) or other overlap patterns (a chain, disjoint pieces).
PATTERNS = (
    ((0, 1, 2, 3), (0, 1, 2, 3), (0, 1), (2, 3)),
    ((0, 1), (1, 2), (2, 3)),
    ((0,), (1,)),
    ((0, 1, 2),),
)


@st.composite
def fixed_plans(draw) -> Problem:
    """One node (a plan's fixed seconds and bytes) and 1-4 layers of one segment pattern with
    small integer values (ties are common), the layers alike except maybe the last, with copies
    and minimum copies sometimes, and a budget between tight and loose."""
    pattern = draw(st.sampled_from(PATTERNS))
    small = st.integers(0, 4).map(float)
    values = [(draw(small), draw(small)) for _ in pattern]
    copies = draw(st.sampled_from([1, 1, 2]))
    # brute force enumerates (copies + 1) ** segments vectors: at most 4,096
    most = max(n for n in range(1, 5) if (copies + 1) ** (len(pattern) * n) <= 4096)
    layers = draw(st.integers(1, most))
    segments = []
    for layer in range(layers):
        odd = layer == layers - 1 and draw(st.booleans())
        for j, footprint in enumerate(pattern):
            freed, again = (draw(small), draw(small)) if odd else values[j]
            segments.append(
                Segment(
                    name=f"l{layer}.{j}",
                    nodes=(0,),
                    freed_bytes=((freed,),),
                    recompute_s=((again,),),
                    copies=copies,
                    min_copies=draw(st.integers(0, copies)) if draw(st.integers(0, 4)) == 0 else 0,
                    footprint=tuple(10 * layer + n for n in footprint),
                )
            )
    resident = draw(st.integers(5, 30))
    node = Node(name="plan", cost_s=(1.0,), memory_bytes=(float(resident),), transient_bytes=(2.0,))
    budget = float(draw(st.integers(resident - 10, resident + 6)))
    return Problem(nodes=(node,), memory_budget_bytes=budget, segments=tuple(segments))


@SETTINGS
@given(fixed_plans())
def test_merged_recomputation_is_the_brute_force_optimum(problem: Problem) -> None:
    try:
        _, optimum, _ = brute_force_recompute(problem)
    except InfeasibleError:
        assert fit_segments(problem) is None
        return
    recomputed = fit_segments(problem)
    assert recomputed is not None
    seconds, freed, again = recompute_terms(problem, (0,), recomputed)
    peak = problem.nodes[0].memory_bytes[0] + problem.nodes[0].transient_bytes[0] - freed + again
    assert peak <= problem.memory_budget_bytes + 1e-9
    assert 1.0 + seconds == pytest.approx(optimum, abs=1e-9)


def test_alike_layers_merge_into_counts() -> None:
    """Three alike layers of block / attention / MLP become three segments of three copies
    whose overlaps are the layer's."""
    segments = tuple(
        Segment(
            name=f"l{layer}.{j}",
            nodes=(0,),
            freed_bytes=((float(j + 1),),),
            recompute_s=((1.0,),),
            footprint=tuple(10 * layer + n for n in footprint),
        )
        for layer in range(3)
        for j, footprint in enumerate(((0, 1, 2, 3), (0, 1), (2, 3)))
    )
    merged, groups = merge_alike(segments)
    assert [s.copies for s in merged] == [3, 3, 3]
    assert groups == ((0, 3, 6), (1, 4, 7), (2, 5, 8))
    prints = [set(s.footprint) for s in merged]
    assert prints[0] & prints[1] and prints[0] & prints[2] and not prints[1] & prints[2]
    assert not math.isnan(merged[0].freed_bytes[0][0])
