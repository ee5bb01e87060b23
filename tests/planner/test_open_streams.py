"""problem_streams with every strategy allowed (the auto plan's problems, evaluate's open
streams, the plan document's 62 configurations on 8x16x8) is built from parts kept per space:
the same streams as walking every strategy of every parameter under each configuration, on a
4-layer tiny GPT on 3x1x2 under every ZeRO configuration, and the parts are made once."""

from __future__ import annotations

import pytest

from autopar.capture.export import capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from tests.models import tiny_gpt


@pytest.fixture(scope="module")
def space():  # type: ignore[no-untyped-def]
    from autopar.planner.space import build_space

    model, args, kwargs = tiny_gpt(layers=4)
    return build_space(capture(model, args, kwargs), Mesh.parse("3x1x2"), PlanOptions())


@pytest.fixture(scope="module")
def uneven(space):  # type: ignore[no-untyped-def]
    """``space`` with every parameter's local elements different per strategy (real spaces
    here give a parameter one size per set of Replicate axes): a stream takes the largest."""
    import dataclasses

    import numpy as np

    nodes = [
        dataclasses.replace(
            node,
            local_numel=node.local_numel
            * (1.0 + 0.01 * ((np.arange(len(node.strategies)) * 7) % 5)),
        )
        if node.kind == "param" and node.local_numel is not None
        else node
        for node in space.nodes
    ]
    return dataclasses.replace(space, nodes=nodes, evaluation_cache={})


def _walked(space, zero):  # type: ignore[no-untyped-def]
    """The streams from every strategy of every parameter under ``zero`` (the walk the kept
    parts replace)."""
    from autopar.planner import zero_pricing as zp

    from autopar.planner.pricing import rounding_given_back

    given = rounding_given_back(space)
    grads = zp._grads(space, zp.allowed_partial_axes(space, None), given)
    members: dict = {}
    last, last_used = set(), zp.last_used_param(space)  # its streams keep the last chunk
    for node in space.nodes:
        if node.kind != "param" or node.alias_of is not None or node.local_numel is None:
            continue
        largest: dict = {}
        for s in range(len(node.strategies)):
            axes = zp.gathered_axes(space, node, s, zero)
            if axes:
                largest[axes] = max(largest.get(axes, 0.0), float(node.local_numel[s]))
        partial, saved, _ = grads[node.name]
        for axes, numel in largest.items():
            key = (axes, tuple(a for a in axes if a in partial))
            members.setdefault(key, []).append((numel, saved))
            if node.name == last_used:
                last.add(key)
    return zp._streams(space, zero, members, grads, last)


def _zeros(space):  # type: ignore[no-untyped-def]
    from autopar.planner.zero_choice import zero_configurations

    zeros = [zero for zero, _ in zero_configurations(space.mesh.shape) if zero.stage == 3]
    assert len(zeros) >= 7
    return zeros


@pytest.mark.parametrize("which", ["space", "uneven"])
def test_open_streams_are_the_streams_of_every_strategy_walked(which, request) -> None:  # type: ignore[no-untyped-def]
    from autopar.planner.zero_pricing import problem_streams

    space = request.getfixturevalue(which)
    seen = 0
    for zero in _zeros(space):
        got = problem_streams(space, zero, None)
        want = _walked(space, zero)
        assert got == want
        assert got.grads_key == want.grads_key
        seen += len(got.streams)
    assert seen > 10


def test_open_streams_walk_the_strategies_once_per_space(space, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from autopar.planner import zero_pricing as zp

    calls = []
    original = zp.allowed_partial_axes

    def counted(space, allowed):  # type: ignore[no-untyped-def]
        calls.append(allowed)
        return original(space, allowed)

    monkeypatch.setattr(zp, "allowed_partial_axes", counted)
    space.evaluation_cache.pop("open_stream_parts", None)
    for zero in _zeros(space):
        zp.problem_streams(space, zero, None)
    assert calls == [None]
