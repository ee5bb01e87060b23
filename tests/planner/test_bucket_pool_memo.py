"""pricing._bucket_pool shares the tables of alike parameter inputs (consumers of repeated
layers share their strategy lists): the pool equals the one walked input by input, on a
4-layer tiny GPT whose parameters differ in shape and layer."""

from __future__ import annotations

import pytest

from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from tests.models import tiny_gpt


def test_the_pool_equals_the_one_walked_input_by_input() -> None:
    from autopar.planner.pricing import _bucket_pool, _partial_tables
    from autopar.planner.space import build_space

    model, args, kwargs = tiny_gpt(layers=4)
    space = build_space(capture(model, args, kwargs), Mesh.parse("2x2"), PlanOptions())
    nodes, mesh = space.nodes, space.mesh
    inputs, total = _bucket_pool(nodes, space.edges, mesh)
    walked, sums = [], [0.0] * mesh.ndim
    for edge in space.edges:
        src, dst, j = nodes[edge.src], nodes[edge.dst], edge.input_index
        if src.kind != "param" or dst.kind != "op" or j < 0:
            continue
        full_bytes = float(max(src.local_numel)) * src.itemsize
        partial, blocks, largest = _partial_tables(dst.strategies, j, full_bytes, mesh)
        sums = [t + b for t, b in zip(sums, largest)]
        walked.append((edge.dst, partial, blocks, largest))
    assert inputs == walked and total == sums
    # Shared: fewer distinct tables than inputs (the layers' consumers alike).
    assert len({id(x[1]) for x in inputs}) < len(inputs)
    assert len({tuple(map(tuple, (x[1], x[2]))) for x in inputs}) > 2


def test_the_rounding_given_back_is_what_every_allowed_use_prices() -> None:
    """pricing.rounding_given_back (what a ZeRO-3 parameter gives back), against a walk by
    hand: per owner (tiny GPT's head reads the token embedding: its uses count on the
    embedding) and axis, each use's largest Partial block times the axis's share where the
    strategy chosen (the ddp recipe's layout), every strategy allowed, or the one strategy a
    consumer is restricted to makes the gradient Partial. Under ddp that is nearly the whole
    last bucket's rounding of both axes."""
    import math

    from autopar.api import plan_captured
    from autopar.planner.pricing import GRAD_BUCKET_BYTES, CommPricer, rounding_given_back

    model, args, kwargs = tiny_gpt(layers=2)
    ddp = plan_captured(
        capture(model, args, kwargs),
        Mesh.parse("2x2"),
        PlanOptions(recipe="ddp"),
        model_name="gpt",
        price_baselines=False,
    )
    space, choice = ddp.space, ddp.choice
    nodes, mesh, share = space.nodes, space.mesh, space.bucket_share_s
    sources: list[int] = []
    inputs, total = _pool(space, sources)
    aliases = {n.name: n.alias_of for n in nodes if n.kind == "param" and n.alias_of}
    owner = next(iter(aliases.values()))
    restricted = nodes[inputs[0][0]].name
    cases = [
        (rounding_given_back(space, choice=choice), lambda dst, partial: partial[choice[dst]]),
        (rounding_given_back(space), lambda dst, partial: set.intersection(*map(set, partial))),
        (
            rounding_given_back(space, {restricted: [choice[inputs[0][0]]]}),
            lambda dst, partial: (
                partial[choice[dst]]
                if nodes[dst].name == restricted
                else set.intersection(*map(set, partial))
            ),
        ),
    ]
    for got, axes_of in cases:
        want: dict[str, list[float]] = {}
        for (dst, partial, _, largest), src in zip(inputs, sources, strict=True):
            name = nodes[src].alias_of or nodes[src].name
            for a in axes_of(dst, partial):
                want.setdefault(name, [0.0] * mesh.ndim)[a] += share[a] * largest[a]
        assert got.keys() == want.keys() and not set(aliases) & set(got)
        for name, values in want.items():
            assert got[name] == pytest.approx(tuple(values), rel=1e-12, abs=0.0)
    chosen, anywhere, one = (case[0] for case in cases)
    first = nodes[sources[0]].alias_of or nodes[sources[0]].name  # the restricted use's
    assert chosen[owner] > (0.0, 0.0) and sum(one[first]) > 0
    assert len(anywhere) < len(chosen)
    pricer = CommPricer(mesh, None)
    for a in range(mesh.ndim):
        whole = pricer.all_reduce_latency_s(a) * (1.0 - math.modf(total[a] / GRAD_BUCKET_BYTES)[0])
        assert 0.9 * whole < sum(r[a] for r in chosen.values()) <= whole * (1 + 1e-9)


def _pool(space, sources: list[int]) -> tuple[list[tuple], list[float]]:
    from autopar.planner.pricing import _bucket_pool

    return _bucket_pool(space.nodes, space.edges, space.mesh, space.shared_grad_uses, sources)
