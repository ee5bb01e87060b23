"""Checkpoint segments in the ILP: known optima, exhaustive search, tied layers (torch-free)."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from unittest import mock

import pulp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solver import Edge, InfeasibleBudgetError, Node, Problem, brute_force, highs_direct, ilp, solve
from solver.brute_force import brute_force_recompute
from solver.checkpointing import conflict_cliques, counts_allowed, recompute_terms
from solver.presolve import plan_objective_s, reduce_problem
from solver.problem import Segment, SegmentEdge

ACT = 100.0
"""Activation bytes of one layer."""
RECOMPUTE_S = 0.25


def homogeneous_chain(num_layers: int, *, budget: float | None, tied: bool) -> Problem:
    """One node per layer (compute 1 s, ACT bytes saved) and one segment per layer."""
    nodes = tuple(
        Node(name=f"l{i}", cost_s=(1.0,), memory_bytes=(ACT,), transient_bytes=(0.0,))
        for i in range(num_layers)
    )
    edges = tuple(Edge(src=i, dst=i + 1, cost_s=((0.0,),)) for i in range(num_layers - 1))
    segments = tuple(
        Segment(name=f"l{i}", nodes=(i,), freed_bytes=((ACT,),), recompute_s=((RECOMPUTE_S,),))
        for i in range(num_layers)
    )
    return Problem(
        nodes=nodes,
        edges=edges,
        memory_budget_bytes=budget,
        segments=segments,
        tied=(tuple(range(num_layers)),) if tied else (),
    )


def fewest_layers_that_fit(num_layers: int, budget: float) -> int:
    for k in range(num_layers + 1):
        if num_layers * ACT - k * ACT + (ACT if k else 0.0) <= budget:
            return k
    raise AssertionError("does not fit")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("num_layers,budget", [(8, 800.0), (8, 650.0), (8, 200.0), (13, 555.0)])
def test_homogeneous_chain_recomputes_the_fewest_layers_that_fit(
    num_layers: int, budget: float, tied: bool
) -> None:
    problem = homogeneous_chain(num_layers, budget=budget, tied=tied)
    sol = solve(problem)
    k = fewest_layers_that_fit(num_layers, budget)
    assert sum(sol.recomputed) == k
    assert math.isclose(sol.objective_s, num_layers * 1.0 + k * RECOMPUTE_S)
    assert sol.peak_memory_bytes <= budget
    assert counts_allowed(problem.segments, sol.recomputed)


def test_too_small_budget_reports_the_smallest_that_fits_with_recompute() -> None:
    # Recomputing every layer frees all, but one layer is alive again during its backward.
    with pytest.raises(InfeasibleBudgetError) as err:
        solve(homogeneous_chain(8, budget=50.0, tied=True))
    assert err.value.min_budget_bytes == pytest.approx(ACT)


def test_without_a_budget_nothing_is_recomputed_unless_forced() -> None:
    free = solve(homogeneous_chain(6, budget=None, tied=False))
    assert free.recomputed == (0,) * 6
    problem = homogeneous_chain(6, budget=None, tied=True)
    forced = Problem(
        nodes=problem.nodes,
        edges=problem.edges,
        tied=problem.tied,
        segments=tuple(
            Segment(
                name=s.name,
                nodes=s.nodes,
                freed_bytes=s.freed_bytes,
                recompute_s=s.recompute_s,
                min_copies=1,
            )
            for s in problem.segments
        ),
    )
    sol = solve(forced)
    assert sol.recomputed == (1,) * 6
    assert math.isclose(sol.objective_s, 6 + 6 * RECOMPUTE_S)


def nested_layers(num_layers: int, *, budget: float | None) -> Problem:
    """Per layer two nodes (attention, MLP) with two strategies each (fast and big, slow and
    small); segments: the whole layer, and each sub-block. Every layer is tied."""
    nodes = []
    segments = []
    for i in range(num_layers):
        a, m = 2 * i, 2 * i + 1
        nodes.append(Node(name=f"attn{i}", cost_s=(1.0, 1.6), memory_bytes=(60.0, 30.0)))
        nodes.append(Node(name=f"mlp{i}", cost_s=(1.0, 1.3), memory_bytes=(80.0, 40.0)))
        segments += [
            Segment(
                name=f"layer{i}",
                nodes=(a, m),
                freed_bytes=((50.0, 25.0), (70.0, 35.0)),
                recompute_s=((0.4, 0.5), (0.3, 0.4)),
                edges=(SegmentEdge(src=a, dst=m, cost_s=((0.0, 0.05), (0.05, 0.0))),),
            ),
            Segment(
                name=f"attn{i}",
                nodes=(a,),
                freed_bytes=((50.0, 25.0),),
                recompute_s=((0.45, 0.55),),
            ),
            Segment(
                name=f"mlp{i}", nodes=(m,), freed_bytes=((70.0, 35.0),), recompute_s=((0.35, 0.45),)
            ),
        ]
    edges = [
        Edge(src=2 * i, dst=2 * i + 1, cost_s=((0.0, 0.1), (0.1, 0.0))) for i in range(num_layers)
    ]
    edges += [
        Edge(src=2 * i + 1, dst=2 * i + 2, cost_s=((0.0, 0.1), (0.1, 0.0)))
        for i in range(num_layers - 1)
    ]
    return Problem(
        nodes=tuple(nodes),
        edges=tuple(edges),
        memory_budget_bytes=budget,
        segments=tuple(segments),
        tied=(tuple(range(0, 2 * num_layers, 2)), tuple(range(1, 2 * num_layers, 2))),
    )


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_overlapping_segments_are_never_both_recomputed(backend: str) -> None:
    problem = nested_layers(3, budget=330.0)
    sol = solve(problem, backend=backend)
    assert counts_allowed(problem.segments, sol.recomputed)
    for clique in conflict_cliques(problem.segments):
        assert sum(sol.recomputed[k] for k in clique) <= 1
    choices, objective, recomputed = brute_force_recompute(problem)
    assert math.isclose(sol.objective_s, objective, rel_tol=1e-9)
    assert sol.peak_memory_bytes <= 330.0


def test_tighter_budget_recomputes_more() -> None:
    freed = []
    for budget in (420.0, 360.0, 300.0, 240.0):
        problem = nested_layers(3, budget=budget)
        sol = solve(problem)
        freed.append(recompute_terms(problem, sol.choices, sol.recomputed)[1])
        assert sol.peak_memory_bytes <= budget
    assert freed == sorted(freed) and freed[-1] > freed[0]


def test_tied_layers_decide_a_count_whose_variables_do_not_grow_with_depth() -> None:
    counts = {}
    for num_layers in (4, 16, 64):
        sol = solve(nested_layers(num_layers, budget=60.0 * num_layers + 120.0))
        assert sol.peak_memory_bytes <= 60.0 * num_layers + 120.0
        assert sum(sol.recomputed) > 0
        counts[num_layers] = sol.num_variables
    # One integer per segment class, in binary: 3 classes x 3 variables per extra bit.
    assert counts[16] - counts[4] <= 3 * 3 * ((16).bit_length() - (4).bit_length())
    assert counts[64] - counts[16] <= 3 * 3 * ((64).bit_length() - (16).bit_length())


@st.composite
def chains(draw: st.DrawFn) -> Problem:
    """Small heterogeneous chains with segments over random ranges, some overlapping."""
    num_nodes = draw(st.integers(2, 4))
    sizes = [draw(st.integers(1, 3)) for _ in range(num_nodes)]
    money = st.integers(0, 8).map(float)
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(draw(money) for _ in range(k)),
            memory_bytes=tuple(draw(st.integers(1, 8)) * 10.0 for _ in range(k)),
        )
        for i, k in enumerate(sizes)
    )
    edges = tuple(
        Edge(
            src=i,
            dst=i + 1,
            cost_s=tuple(
                tuple(draw(money) / 2 for _ in range(sizes[i + 1])) for _ in range(sizes[i])
            ),
        )
        for i in range(num_nodes - 1)
    )
    segments = []
    # Single nodes (disjoint, so that several can be recomputed) and up to two random ranges
    # (overlapping them).
    ranges = [(i, i + 1) for i in range(num_nodes) if draw(st.booleans())]
    for _ in range(draw(st.integers(0 if ranges else 1, 2))):
        start = draw(st.integers(0, num_nodes - 1))
        ranges.append((start, draw(st.integers(start + 1, num_nodes))))
    for k, (start, stop) in enumerate(ranges):
        members = tuple(range(start, stop))
        seg_edges = tuple(
            SegmentEdge(
                src=e.src, dst=e.dst, cost_s=tuple(tuple(c / 4 for c in row) for row in e.cost_s)
            )
            for e in edges
            if e.dst in members and e.src in members and draw(st.booleans())
        )
        segments.append(
            Segment(
                name=f"s{k}",
                nodes=members,
                # at most the node's own bytes: a segment frees only what the node saved
                freed_bytes=tuple(
                    tuple(
                        b * draw(st.sampled_from([0.0, 0.5, 1.0, 1.0]))
                        for b in nodes[n].memory_bytes
                    )
                    for n in members
                ),
                recompute_s=tuple(tuple(draw(money) / 2 for _ in range(sizes[n])) for n in members),
                edges=seg_edges,
            )
        )
    # A budget between the smallest peak with recompute and the smallest without (where
    # recompute decides), or a little above (where it may not be needed).
    smallest = []
    for segs in (tuple(segments), ()):
        try:
            brute_force_recompute(
                Problem(nodes=nodes, edges=edges, segments=segs, memory_budget_bytes=-1.0)
            )
        except InfeasibleBudgetError as e:
            smallest.append(e.min_budget_bytes)
    budget = draw(st.floats(min_value=smallest[0], max_value=smallest[1] + 5.0))
    return Problem(nodes=nodes, edges=edges, segments=tuple(segments), memory_budget_bytes=budget)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_heterogeneous_chains_match_exhaustive_search(problem: Problem) -> None:
    sol = solve(problem)
    _, objective, _ = brute_force_recompute(problem)
    assert math.isclose(sol.objective_s, objective, rel_tol=1e-6, abs_tol=1e-9)
    assert sol.peak_memory_bytes <= problem.memory_budget_bytes * (1 + 1e-9) + 1e-6
    assert counts_allowed(problem.segments, sol.recomputed)
    assert brute_force(problem)[1] == objective


def test_segments_spanning_tied_layers_add_their_rows() -> None:
    # Chen-style segments of two tied layers each: contracted, each lands twice on a node.
    base = nested_layers(4, budget=None)
    pairs = tuple(
        Segment(
            name=f"layers{i}-{i + 1}",
            nodes=(2 * i, 2 * i + 1, 2 * i + 2, 2 * i + 3),
            freed_bytes=((50.0, 25.0), (70.0, 35.0), (50.0, 25.0), (70.0, 35.0)),
            recompute_s=((0.4, 0.5), (0.3, 0.4), (0.4, 0.5), (0.3, 0.4)),
        )
        for i in (0, 2)
    )
    recomputed = []
    for budget in (400.0, 270.0, 240.0):
        problem = Problem(
            nodes=base.nodes,
            edges=base.edges,
            tied=base.tied,
            segments=pairs,
            memory_budget_bytes=budget,
        )
        sol = solve(problem)
        _, objective, _ = brute_force_recompute(problem)
        assert math.isclose(sol.objective_s, objective, rel_tol=1e-9)
        assert sol.peak_memory_bytes <= budget
        recomputed.append(sum(sol.recomputed))
    assert recomputed[0] == 0 and recomputed[-1] > 0


def test_presolve_keeps_strategies_that_only_segments_tell_apart() -> None:
    # Strategies 0 and 1 of each node look alike to the sharding model (same seconds, bytes
    # and edges); only strategy 1 can be freed by recompute. Dominance pruning or elimination
    # that ignored the segments would keep strategy 0 and find no plan within the budget.
    nodes = tuple(
        Node(name=f"n{i}", cost_s=(1.0, 1.0), memory_bytes=(100.0, 100.0)) for i in range(3)
    )
    edges = tuple(Edge(src=i, dst=i + 1, cost_s=((0.0, 0.0), (0.0, 0.0))) for i in range(2))
    segments = tuple(
        Segment(name=f"s{i}", nodes=(i,), freed_bytes=((0.0, 100.0),), recompute_s=((0.5, 0.5),))
        for i in range(3)
    )
    problem = Problem(nodes=nodes, edges=edges, segments=segments, memory_budget_bytes=200.0)
    sol = solve(problem)
    assert sol.peak_memory_bytes <= 200.0
    assert sum(sol.recomputed) >= 2
    assert all(sol.choices[seg.nodes[0]] == 1 for seg, r in zip(segments, sol.recomputed) if r)
    assert math.isclose(sol.objective_s, brute_force_recompute(problem)[1])
    # Without a budget the same problem recomputes nothing (elimination may run).
    free = solve(Problem(nodes=nodes, edges=edges, segments=segments))
    assert free.recomputed == (0, 0, 0) and free.objective_s == 3.0


@contextlib.contextmanager
def pulp_model() -> Iterator[None]:
    """Build every model through pulp (the only path for segments before highs_direct had
    them)."""
    with mock.patch.object(highs_direct, "supports", lambda problem: False):
        yield


@st.composite
def layered(draw: st.DrawFn) -> Problem:
    """1-3 layers of 1-2 nodes in a chain, a segment per layer (and per node of a two-node
    layer, overlapping it) whose edges re-price the reshards consumed inside it, the incoming
    one from the previous layer included: at a third of the model's cost (the model's pair
    columns express them) or independent costs (the z rows). Sometimes transients, layer 0
    forced, nodes presolve fixes (one strategy), or every layer tied (counts in binary)."""
    num_layers = draw(st.integers(1, 3))
    width = draw(st.integers(1, 2))
    tied = num_layers > 1 and draw(st.booleans())
    most = 3 if num_layers * width < 4 else 2
    sizes = [draw(st.integers(1, most)) for _ in range(width)]
    money = st.integers(0, 8).map(float)
    transients = draw(st.booleans())

    def node(name: str, k: int) -> Node:
        return Node(
            name=name,
            cost_s=tuple(draw(money) for _ in range(k)),
            memory_bytes=tuple(draw(st.integers(1, 8)) * 10.0 for _ in range(k)),
            transient_bytes=tuple(draw(st.integers(0, 4)) * 10.0 for _ in range(k))
            if transients
            else (),
        )

    first = [node(f"p{j}", k) for j, k in enumerate(sizes)]
    nodes = tuple(
        dataclasses.replace(first[j], name=f"l{i}p{j}") if tied or i == 0 else node(f"l{i}p{j}", k)
        for i in range(num_layers)
        for j, k in enumerate(sizes)
    )
    num = len(nodes)
    # One matrix per position, shared by every layer (as autopar shares an edge's matrix);
    # a flat one is folded away by presolve, so only z rows can price its segment edge.
    flat = [draw(st.booleans()) for _ in range(width)]
    matrices = [
        tuple(
            tuple(0.5 if flat[j] else draw(money) / 2 for _ in range(sizes[(j + 1) % width]))
            for _ in range(sizes[j])
        )
        for j in range(width)
    ]
    edges = tuple(Edge(src=i, dst=i + 1, cost_s=matrices[i % width]) for i in range(num - 1))
    independent = draw(st.booleans())
    forward = [
        tuple(tuple(draw(money) / 4 if independent else c / 3 for c in row) for row in m)
        for m in matrices
    ]
    freed_share = [
        tuple(draw(st.sampled_from([0.0, 0.5, 1.0, 1.0])) for _ in range(k)) for k in sizes
    ]
    again = [tuple(draw(money) / 2 for _ in range(k)) for k in sizes]
    forced = draw(st.integers(0, 3)) == 0
    segments = []
    for i in range(num_layers):
        layer = tuple(range(i * width, (i + 1) * width))
        for span in [layer, *([(n,) for n in layer] if width > 1 else [])]:
            segments.append(
                Segment(
                    name=f"l{i}{span}",
                    nodes=span,
                    freed_bytes=tuple(
                        tuple(b * f for b, f in zip(nodes[n].memory_bytes, freed_share[n % width]))
                        for n in span
                    ),
                    recompute_s=tuple(again[n % width] for n in span),
                    edges=tuple(
                        SegmentEdge(src=e.src, dst=e.dst, cost_s=forward[e.src % width])
                        for e in edges
                        if e.dst in span
                    ),
                    min_copies=int(forced and i == 0 and span == layer),
                )
            )
    ties = tuple(tuple(range(j, num, width)) for j in range(width)) if tied else ()
    smallest = []
    for segs in (tuple(segments), ()):
        try:
            brute_force_recompute(
                Problem(
                    nodes=nodes, edges=edges, segments=segs, memory_budget_bytes=-1.0, tied=ties
                )
            )
        except InfeasibleBudgetError as e:
            smallest.append(e.min_budget_bytes)
    budget = draw(st.floats(min_value=smallest[0], max_value=max(smallest) + 5.0))
    return Problem(
        nodes=nodes, edges=edges, segments=tuple(segments), memory_budget_bytes=budget, tied=ties
    )


def _same_plan_value(problem: Problem, sol, objective: float) -> None:
    assert math.isclose(sol.objective_s, objective, rel_tol=1e-6, abs_tol=1e-9)
    assert sol.peak_memory_bytes <= problem.memory_budget_bytes * (1 + 1e-9) + 1e-6
    assert counts_allowed(problem.segments, sol.recomputed)
    assert all(r >= s.min_copies for s, r in zip(problem.segments, sol.recomputed))
    assert math.isclose(
        plan_objective_s(problem, sol.choices, sol.recomputed), sol.objective_s, rel_tol=1e-12
    )


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(layered(), chains()))
def test_direct_highs_model_has_the_optimum_of_pulp_cbc_and_brute_force(problem: Problem) -> None:
    _, objective, _ = brute_force_recompute(problem)
    direct = solve(problem)
    with pulp_model():
        through_pulp = solve(problem)
    cbc = solve(problem, backend="cbc")
    if _mixed_segment_copies(problem):
        # Tied layers whose segments did not all merge (solver/checkpointing.py's docstring): the
        # overlap rows are conservative there, so the plan fits and is valid but may recompute
        # a costlier mix than brute force finds. All three backends still agree.
        for sol in (direct, through_pulp, cbc):
            assert sol.objective_s >= objective * (1 - 1e-6) - 1e-9
            _same_plan_value(problem, sol, direct.objective_s)
    else:
        for sol in (direct, through_pulp, cbc):
            _same_plan_value(problem, sol, objective)
    assert direct.num_variables == through_pulp.num_variables
    assert direct.num_constraints == through_pulp.num_constraints


def _mixed_segment_copies(problem: Problem) -> bool:
    """Tied layers where some contracted segments merged copies and an overlapping one stayed
    apart (the case solver/checkpointing.py's overlap rows treat conservatively)."""
    if not problem.tied or not problem.segments:
        return False
    from solver.checkpointing import contract_segments
    from solver.tying import contract

    _, groups = contract_segments(problem, contract(problem).node_map)
    footprint = [
        set().union(*(problem.segments[k].footprint or problem.segments[k].nodes for k in g))
        for g in groups
    ]
    for a, ga in enumerate(groups):
        for b in range(a + 1, len(groups)):
            if len(ga) != len(groups[b]) and footprint[a] & footprint[b]:
                return True
    return False


def test_direct_model_is_pulps_model_row_for_row() -> None:
    # Same columns and rows, and the same LP relaxation, on a problem with every kind of
    # segment edge: fixed end, the model's pair columns, and z rows.
    problem = nested_layers(2, budget=300.0)
    problem = dataclasses.replace(
        problem,
        segments=(
            *problem.segments,
            Segment(
                name="cross",
                nodes=(1, 2),
                freed_bytes=((70.0, 35.0), (50.0, 25.0)),
                recompute_s=((0.3, 0.4), (0.4, 0.5)),
                edges=(SegmentEdge(src=1, dst=2, cost_s=((0.2, 0.0), (0.07, 0.01))),),
            ),
        ),
        tied=(),
    )
    red = reduce_problem(problem)
    direct = highs_direct.build(problem, red, minimise_peak=False)
    model = ilp._build(problem, red, minimise_peak=False)
    assert direct.num_variables == model.num_variables
    assert direct.num_constraints == len(model.lp.constraints)
    h = direct.highs
    h.setOptionValue("solve_relaxation", True)
    h.run()
    relaxed = h.getInfo().objective_function_value * direct.objective_scale
    for v in model.lp.variables():
        v.cat = "Continuous"
    model.lp.solve(pulp.HiGHS(msg=False))
    assert math.isclose(
        relaxed, pulp.value(model.lp.objective) * model.objective_scale, rel_tol=1e-9
    )


def test_segment_problems_are_built_directly() -> None:
    problem = nested_layers(3, budget=330.0)
    with mock.patch.object(ilp, "_build", side_effect=AssertionError("pulp model built")):
        sol = solve(problem)
    assert sum(sol.recomputed) > 0
    assert math.isclose(sol.objective_s, brute_force_recompute(problem)[1], rel_tol=1e-9)
