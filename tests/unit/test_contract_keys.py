"""checkpointing.contract_segments keys segment edges by table identity (the first equal
table's), not by content: the same contraction as content keying, with equal-but-distinct
tables, shared ones, and tables that differ in one entry."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from solver import Node, Problem
from solver.checkpointing import contract_segments
from solver.problem import Segment, SegmentEdge


def _by_content(problem: Problem, node_map) -> tuple[tuple, tuple]:
    """The contraction keyed by the segments' whole content (tables as nested tuples)."""
    keys: dict[tuple, int] = {}
    merged: list[Segment] = []
    groups: list[list[int]] = []
    for k, seg in enumerate(problem.segments):
        rows: dict[int, tuple[list[float], list[float]]] = {}
        for n, freed, again in zip(seg.nodes, seg.freed_bytes, seg.recompute_s, strict=True):
            entry = rows.setdefault(node_map[n], ([0.0] * len(freed), [0.0] * len(again)))
            entry[0][:] = [a + b for a, b in zip(entry[0], freed, strict=True)]
            entry[1][:] = [a + b for a, b in zip(entry[1], again, strict=True)]
        edges = tuple(
            SegmentEdge(src=node_map[e.src], dst=node_map[e.dst], cost_s=e.cost_s)
            for e in seg.edges
        )
        key = (
            tuple(rows),
            tuple(tuple(f) for f, _ in rows.values()),
            tuple(tuple(t) for _, t in rows.values()),
            tuple((e.src, e.dst, e.cost_s) for e in edges),
        )
        if key in keys:
            g = keys[key]
            groups[g].append(k)
            old = merged[g]
            merged[g] = Segment(
                name=old.name,
                nodes=old.nodes,
                freed_bytes=old.freed_bytes,
                recompute_s=old.recompute_s,
                edges=old.edges,
                copies=old.copies + seg.copies,
                min_copies=old.min_copies + seg.min_copies,
                footprint=old.footprint + (seg.footprint or seg.nodes),
            )
        else:
            keys[key] = len(merged)
            groups.append([k])
            merged.append(
                Segment(
                    name=seg.name,
                    nodes=key[0],
                    freed_bytes=key[1],
                    recompute_s=key[2],
                    edges=edges,
                    copies=seg.copies,
                    min_copies=seg.min_copies,
                    footprint=seg.footprint or seg.nodes,
                )
            )
    return tuple(merged), tuple(tuple(g) for g in groups)


@st.composite
def segmented(draw) -> tuple[Problem, list[int]]:
    """Two layers of 3 nodes of 2 strategies, node i contracted onto i % 3; segments drawn as
    copies of a few templates placed on either layer or both (rows summed; zeros of both
    signs), each edge's table the template's very object, a fresh equal copy, or a copy with
    one entry changed (a shared nan object among the entries keeps equal copies equal)."""
    node_map = [i % 3 for i in range(6)]
    values = st.sampled_from([0.0, -0.0, 0.5, 1.0])
    entries = st.sampled_from([0.0, 1.0, math.nan])
    originals = [
        tuple(tuple(draw(entries) for _ in range(2)) for _ in range(2))
        for _ in range(draw(st.integers(1, 3)))
    ]
    row = st.tuples(values, values)
    templates = []
    for _ in range(draw(st.integers(1, 3))):
        nodes = tuple(sorted(draw(st.sets(st.integers(0, 2), min_size=1, max_size=3))))
        templates.append(
            (
                nodes,
                tuple(draw(row) for _ in nodes),
                tuple(draw(row) for _ in nodes),
                [
                    (
                        draw(st.integers(0, 2)),
                        draw(st.integers(0, 2)),
                        draw(st.sampled_from(originals)),
                    )
                    for _ in range(draw(st.integers(0, 3)))
                ],
            )
        )

    def table(source: tuple) -> tuple:
        how = draw(st.sampled_from(["same", "copy", "changed"]))
        if how == "same":
            return source
        rows = [list(r) for r in source]
        if how == "changed":
            rows[draw(st.integers(0, 1))][draw(st.integers(0, 1))] = 3.0
        return tuple(tuple(r) for r in rows)

    segments = []
    for k in range(draw(st.integers(1, 8))):
        nodes, freed, again, edges = draw(st.sampled_from(templates))
        shift = 3 * draw(st.integers(0, 1))
        placed = tuple(n + shift for n in nodes)
        if draw(st.booleans()):  # spanning both layers: two rows land on each node
            placed, freed, again = (
                placed + tuple(n + 3 - shift for n in nodes),
                freed + tuple(draw(row) for _ in nodes),
                again + tuple(draw(row) for _ in nodes),
            )
        segments.append(
            Segment(
                name=f"s{k}",
                nodes=placed,
                freed_bytes=freed,
                recompute_s=again,
                edges=tuple(
                    SegmentEdge(src=a + shift, dst=b + shift, cost_s=table(t)) for a, b, t in edges
                ),
                copies=draw(st.integers(1, 3)),
            )
        )
    nodes = tuple(Node(name=f"n{i}", cost_s=(0.0, 0.0), memory_bytes=(0.0, 0.0)) for i in range(6))
    return Problem(nodes=nodes, segments=tuple(segments)), node_map


@settings(max_examples=60, deadline=None)
@given(segmented())
def test_identity_keys_contract_as_content_keys(case) -> None:
    problem, node_map = case
    merged, groups = contract_segments(problem, node_map)
    want_merged, want_groups = _by_content(problem, node_map)
    assert groups == want_groups
    assert merged == want_merged
    # the rows' floats bit for bit (== holds 0.0 and -0.0 equal)
    assert [(repr(s.freed_bytes), repr(s.recompute_s)) for s in merged] == [
        (repr(s.freed_bytes), repr(s.recompute_s)) for s in want_merged
    ]
    for seg, want in zip(merged, want_merged, strict=True):  # the first member's tables
        assert all(a.cost_s is b.cost_s for a, b in zip(seg.edges, want.edges, strict=True))


@settings(max_examples=40, deadline=None)
@given(segmented(), st.permutations(range(6)))
def test_a_kept_contraction_is_the_one_made_again(case, other_map) -> None:
    """contract_segments keeps its answer for the very same segments object and an equal node
    map (the ZeRO configurations of one search, whose node costs differ): what it returns for
    each (segments, map) is what contracting them anew gives, and another map, or an equal
    but distinct segments object, is contracted anew."""
    import dataclasses

    problem, node_map = case
    first = contract_segments(problem, node_map)
    costs = tuple(dataclasses.replace(n, cost_s=(1.0, 2.0)) for n in problem.nodes)
    same_segments = dataclasses.replace(problem, nodes=costs)
    assert contract_segments(same_segments, list(node_map)) is first
    remapped = [other_map[n] for n in node_map]
    for p, m in ((problem, remapped), (problem, node_map)):
        assert contract_segments(p, m) == _by_content(p, m)
    copied = dataclasses.replace(problem, segments=tuple(list(problem.segments)))
    again = contract_segments(copied, node_map)
    assert again == first and (again is not first or not problem.segments)
