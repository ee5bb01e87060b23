"""The fast route tables are the same floats as the plain ones (issue 16: strategy-space time).

``routes_from`` (one-int heap keys over numbered states), ``_route_counts`` (counts summed along
parent links with numpy) and ``price_table``'s memo across calls replaced a plain Dijkstra over
tuple costs, a per-state route walk and a per-call pricing. The plain versions are kept here as
the reference: the same trees in the same order, the same step columns, the same count and
price arrays bit for bit, and the same strategy space of a GPT-2 block on a 3-D mesh.
"""

from __future__ import annotations

import functools
import heapq
import itertools

import numpy as np
import pytest

import autopar.planner.pricing as planner_pricing
import autopar.resharding.pricing as pricing
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.resharding import routes
from autopar.resharding.routes import COLLECTIVE_KINDS, divisible_counts


def reference_routes_from(src, ndim, mesh_shape, divisible):
    """The plain search: Dijkstra over (bytes, collectives, steps) tuples."""
    graph = routes._state_graph(ndim, mesh_shape, divisible)
    counter = itertools.count()
    best = {src: (0, 0, 0)}
    came_from = {}
    heap = [((0, 0, 0), next(counter), src)]
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best[state]:
            continue
        for new_state, fwd, bwd, price, collective in graph[state]:
            new_cost = (cost[0] + price, cost[1] + collective, cost[2] + 1)
            if new_state not in best or new_cost < best[new_state]:
                best[new_state] = new_cost
                came_from[new_state] = (state, fwd, bwd)
                heapq.heappush(heap, (new_cost, next(counter), new_state))
    return came_from


def reference_route_counts(src, ndim, mesh_shape, divisible):
    """The plain counts: each state's route as step lists, then counted one by one."""
    came_from = reference_routes_from(src, ndim, mesh_shape, divisible)
    states = [src, *came_from]
    index = {state: k for k, state in enumerate(states)}
    key_of = {}
    done = {src: ([], [])}

    def priced(raw):
        if raw is None or raw[0] not in COLLECTIVE_KINDS or mesh_shape[raw[1]] == 1:
            return []
        return [key_of.setdefault((raw[0], raw[1], raw[4]), len(key_of))]

    for state in states:
        chain = []
        while state not in done:
            chain.append(state)
            state = came_from[state][0]
        for node in reversed(chain):
            parent, fwd, bwd = came_from[node]
            done[node] = (done[parent][0] + priced(fwd), done[parent][1] + priced(bwd))
    fwd_counts = np.zeros((len(states), len(key_of)))
    bwd_counts = np.zeros((len(states), len(key_of)))
    for state, (fwd, bwd) in done.items():
        for k in fwd:
            fwd_counts[index[state], k] += 1
        for k in bwd:
            bwd_counts[index[state], k] += 1
    return index, tuple(key_of), fwd_counts, bwd_counts


CASES = [((8, 16, 8), (256, 8192, 64, 128)), ((2, 1, 3), (4, 6, 12)), ((4, 2), (8, 6, 1, 2))]


@pytest.mark.parametrize(("mesh", "shape"), CASES)
def test_routes_and_counts_match_the_plain_search(mesh, shape) -> None:
    divisible = divisible_counts(shape, mesh)
    states = list(routes._state_graph(len(shape), mesh, divisible))
    for src in states[:: max(1, len(states) // 40)]:
        want = reference_route_counts(src, len(shape), mesh, divisible)
        tree = routes.routes_from(src, len(shape), mesh, divisible)
        assert list(tree.items()) == list(
            reference_routes_from(src, len(shape), mesh, divisible).items()
        )
        got = pricing._route_counts(src, len(shape), mesh, divisible)
        assert list(got[0].items()) == list(want[0].items()) and got[1] == want[1]
        assert got[2].tobytes() == want[2].tobytes() and got[3].tobytes() == want[3].tobytes()


def test_price_table_memo_gives_the_same_floats() -> None:
    """One memo across calls with repeated and different price keys and destination lists."""
    mesh, shape = (2, 1, 3), (4, 6, 12)
    states = list(routes._state_graph(3, mesh, divisible_counts(shape, mesh)))
    decode = {-1: "R", -2: "P"}
    pls = [routes_placements(code, decode) for code in states[::5]]
    memo: dict = {}
    for scale, dsts in [(1.0, pls), (3.0, pls[::2]), (1.0, pls[1::3]), (3.0, pls)]:

        def step_s(kind, axis, fraction, scale=scale):
            return fraction * scale * (1 + len(kind)) / (axis + 0.7)

        plain = pricing.price_table(pls, dsts, shape, mesh, step_s)
        memoised = pricing.price_table(pls, dsts, shape, mesh, step_s, memo=memo, price_key=scale)
        for a, b in zip(plain, memoised, strict=True):
            assert a.tobytes() == b.tobytes()
        assert np.isfinite(plain[0]).any() and (plain[0] > 0).any()


def routes_placements(code, decode):
    from autopar.placement import parse_placements

    return parse_placements(",".join(decode.get(c, f"S{c}") for c in code))


def test_gpt2_block_space_is_bitwise_the_plain_one(monkeypatch) -> None:
    """The whole strategy space of a GPT-2 block on 2x2x2, fast path against the plain one
    (memoised per source as the plain ``_route_counts`` was)."""
    from autopar.capture.export import capture
    from autopar.planner.space import build_space
    from autopar.presets import build_preset

    model, args, kwargs = build_preset("gpt2-small-1l", batch=8, seq=64)
    captured = capture(model, args, kwargs)
    mesh = Mesh.parse("2x2x2", device="h100")

    def arrays(space):
        nodes = [(n.name, n.compute_s, n.grad_comm_s, n.output_comm_s) for n in space.nodes]
        return nodes, [(e.src, e.dst, e.cost_s) for e in space.edges]

    fast = arrays(build_space(captured, mesh, PlanOptions()))
    plain_table = pricing.price_table
    monkeypatch.setattr(
        pricing, "_route_counts", functools.lru_cache(maxsize=None)(reference_route_counts)
    )
    monkeypatch.setattr(
        planner_pricing,
        "price_table",
        lambda *a, memo=None, price_key=None: plain_table(*a),
    )
    plain = arrays(build_space(captured, mesh, PlanOptions()))
    assert len(fast[0]) == len(plain[0]) and len(fast[1]) == len(plain[1])
    for a, b in zip(fast[0], plain[0], strict=True):
        assert a[0] == b[0] and all(x.tobytes() == y.tobytes() for x, y in zip(a[1:], b[1:]))
    for a, b in zip(fast[1], plain[1], strict=True):
        assert a[:2] == b[:2] and a[2].tobytes() == b[2].tobytes()
    assert sum(np.isfinite(e[2]).sum() for e in fast[1]) > 1000
