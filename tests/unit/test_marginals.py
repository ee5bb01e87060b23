"""One-pass pruning bounds (solver/marginals.py) against exhaustive enumeration: every node's
bound is at most its true min-marginal, an optimal plan's strategies stay within the plan's
cost under the restriction, the bounds are exact where no split is needed, and the root's is
the pinned run's."""

from __future__ import annotations

import itertools
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from solver import Edge, Node, Problem
from solver.eliminate import SeriesMemo
from solver.marginals import OnePass
from solver.prune import _Base, _pinned_bound
from tests.unit.test_prune import cores, cores_with_tails

SETTINGS = settings(max_examples=80, deadline=None, derandomize=True)

_SLACK = 1e-9


def min_marginals(base: _Base) -> list[np.ndarray]:
    """M(i, s): the least cost of a plan with x_i = s (+inf where none is allowed)."""
    cost = base.graph.cost
    out = [np.full(len(c), np.inf) for c in cost]
    for plan in itertools.product(*(range(len(c)) for c in cost)):
        value = base.plan_cost(list(plan))
        for i, s in enumerate(plan):
            out[i][s] = min(out[i][s], value)
    return out


def one_pass(problem: Problem, root: int, limit: float = np.inf, plan: list[int] | None = None):
    base = _Base(problem)
    one = OnePass(base.fresh(), base.num, root, SeriesMemo())
    keep = one.root_bound <= limit
    plan = plan if plan is not None else one.plan
    keep[plan[root]] = True
    return base, one, one.bounds(keep, limit, plan)


@SETTINGS
@given(st.one_of(cores(), cores_with_tails()), st.data())
def test_every_bound_is_at_most_the_true_min_marginal(problem: Problem, data) -> None:
    """Without restriction (limit +inf), on cores with degree-3 nodes (splits, messages
    halved into two buckets): LB(i, s) <= the cost of every plan with x_i = s."""
    root = data.draw(st.integers(0, len(problem.nodes) - 1))
    base, one, bounds = one_pass(problem, root)
    truth = min_marginals(base)
    for i, (bound, exact) in enumerate(zip(bounds, truth, strict=True)):
        assert np.all(bound <= exact + _SLACK * np.maximum(1.0, np.abs(exact))), (i, one.num_copies)


@SETTINGS
@given(st.one_of(cores(), cores_with_tails()), st.data())
def test_restricted_bounds_keep_every_optimal_plan(problem: Problem, data) -> None:
    """With the limit at the optimum and an optimal plan forced, every optimal plan's
    strategies have bounds within the limit (the restriction made in the pass is exact)."""
    base = _Base(problem)
    plans = []
    for plan in itertools.product(*(range(len(c)) for c in base.graph.cost)):
        plans.append((base.plan_cost(list(plan)), plan))
    optimum = min(cost for cost, _ in plans)
    if not np.isfinite(optimum):
        return
    best = [plan for cost, plan in plans if cost <= optimum + _SLACK * max(1.0, abs(optimum))]
    root = data.draw(st.integers(0, len(problem.nodes) - 1))
    forced = list(data.draw(st.sampled_from(best)))
    limit = optimum + _SLACK * max(1.0, abs(optimum))
    _, _, bounds = one_pass(problem, root, limit, forced)
    for plan in best:
        for i, s in enumerate(plan):
            assert bounds[i][s] <= limit, (plan, i)


@st.composite
def cycles(draw: st.DrawFn) -> Problem:
    """A cycle of 3-7 nodes with a chord or two that keep it series-parallel (no node has to
    be split): elimination with a pinned node is exact there."""
    num = draw(st.integers(3, 7))
    number = st.integers(0, 6).map(float)
    sizes = [draw(st.integers(1, 4)) for _ in range(num)]
    nodes = tuple(
        Node(name=f"n{i}", cost_s=tuple(draw(number) for _ in range(k)), memory_bytes=(0.0,) * k)
        for i, k in enumerate(sizes)
    )
    pairs = [(i, (i + 1) % num) for i in range(num)]
    if num > 3 and draw(st.booleans()):
        pairs.append((0, 2))  # a chord across one node: still series-parallel
    edges = tuple(
        Edge(
            src=u,
            dst=v,
            cost_s=tuple(tuple(draw(number) for _ in range(sizes[v])) for _ in range(sizes[u])),
        )
        for u, v in pairs
    )
    return Problem(nodes=nodes, edges=edges)


@SETTINGS
@given(cycles(), st.data())
def test_bounds_are_the_exact_min_marginals_without_splits(problem: Problem, data) -> None:
    """Series-parallel graphs need no split: every bound equals the true min-marginal, and
    equals the pinned run's bound for that node (the relaxation is the problem itself)."""
    root = data.draw(st.integers(0, len(problem.nodes) - 1))
    base, one, bounds = one_pass(problem, root)
    assert one.num_copies == 0
    memo = SeriesMemo()
    for i, (bound, exact) in enumerate(zip(bounds, min_marginals(base), strict=True)):
        np.testing.assert_allclose(bound, exact, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(bound, _pinned_bound(base, i, memo)[0], rtol=1e-12, atol=1e-12)


@SETTINGS
@given(cores(), st.data())
def test_the_root_bound_and_plan_are_the_pinned_runs(problem: Problem, data) -> None:
    """The forward pass is the pinned run of the root, bit for bit, plan included."""
    root = data.draw(st.integers(0, len(problem.nodes) - 1))
    base = _Base(problem)
    one = OnePass(base.fresh(), base.num, root, SeriesMemo())
    bound, plan = _pinned_bound(base, root, SeriesMemo(), track=True)
    assert np.array_equal(one.root_bound, bound)
    assert one.plan == plan


def test_a_k5_is_split_and_its_bounds_stay_below_the_truth() -> None:
    """A complete graph of 5 nodes (splits, and messages halved into two buckets) with
    distinct random costs: the bounds are below the truth and not all -inf or trivial."""
    rng = np.random.default_rng(7)
    k = 3
    nodes = tuple(
        Node(name=f"n{i}", cost_s=tuple(rng.uniform(0, 5, k).tolist()), memory_bytes=(0.0,) * k)
        for i in range(5)
    )
    edges = tuple(
        Edge(src=u, dst=v, cost_s=tuple(tuple(rng.uniform(0, 3, k).tolist()) for _ in range(k)))
        for u, v in itertools.combinations(range(5), 2)
    )
    base, one, bounds = one_pass(Problem(nodes=nodes, edges=edges), 0)
    assert one.num_copies >= 2
    truth = min_marginals(base)
    for bound, exact in zip(bounds, truth, strict=True):
        assert np.all(bound <= exact + 1e-9)
        assert np.all(bound >= 0.5 * np.min(exact))  # the relaxation is not vacuous


def test_restricting_inside_the_pass_tightens_the_bounds() -> None:
    """A K5 of 3 strategies (integer costs, seeded): with each node restricted as soon as its
    bound is known, the pass drops a strategy that the same pass without restriction keeps;
    an optimal plan stays within the limit either way."""
    rng = random.Random(28)
    k = 3
    nodes = tuple(
        Node(
            name=f"n{i}",
            cost_s=tuple(float(rng.randint(0, 9)) for _ in range(k)),
            memory_bytes=(0.0,) * k,
        )
        for i in range(5)
    )
    edges = tuple(
        Edge(
            src=u,
            dst=v,
            cost_s=tuple(tuple(float(rng.randint(0, 9)) for _ in range(k)) for _ in range(k)),
        )
        for u, v in itertools.combinations(range(5), 2)
    )
    base = _Base(Problem(nodes=nodes, edges=edges))
    one = OnePass(base.fresh(), base.num, 0, SeriesMemo())
    plan = one.plan
    base.improve(plan)
    upper = base.plan_cost(plan)
    root_keep = one.root_bound <= upper
    root_keep[plan[0]] = True
    restricted = one.bounds(root_keep, upper, plan)
    unrestricted = one.bounds(root_keep, np.inf, plan)

    def kept(bounds: list[np.ndarray]) -> int:
        return sum(int(np.count_nonzero(b <= upper)) for b in bounds)

    assert kept(restricted) < kept(unrestricted)
    truth = min_marginals(base)
    optimum = min(float(np.min(m)) for m in truth)
    best = min(itertools.product(range(k), repeat=5), key=lambda p: base.plan_cost(list(p)))
    assert base.plan_cost(list(best)) == optimum
    for i, s in enumerate(best):
        assert restricted[i][s] <= upper and unrestricted[i][s] <= upper
