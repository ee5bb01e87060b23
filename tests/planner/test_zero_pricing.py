"""ZeRO-3 priced per chunk (autopar.planner.zero_pricing), in one process on fake tensors.

A chunk costs what its parameters would cost alone, each a chunk of its own, less the latencies
it saves (one per parameter beyond the first; the chunk kept gathered into backward, which holds
the parameter the graph uses last, priced kept alone too); the plan prices the fsdp recipe's parameters with
exactly their chunk's collectives, in place of the bucketed all-reduce they replace (its
latency included); and a
parameter joining a stream adds its bytes, not another latency.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest

import autopar
from autopar.api import plan_captured
from autopar.capture.export import capture
from autopar.options import PlanOptions
from autopar.planner.pricing import CommPricer, rounding_given_back
from autopar.planner.problem import ZeroConfig
from autopar.planner.zero_pricing import chosen_streams, stream_price
from tests.models import tiny_mlp

ZERO3 = ZeroConfig(stage=3, axes=(0,))


@functools.cache
def _fsdp() -> Any:
    model, args, kwargs = tiny_mlp()
    mesh = autopar.Mesh.spec((2,), ("dp",), device="cpu")
    return plan_captured(
        capture(model, args, kwargs),
        mesh,
        PlanOptions(recipe="fsdp"),
        model_name="mlp",
        price_baselines=False,
    )


def _numels(plan: Any) -> list[float]:
    space = plan.space
    return [
        float(node.local_numel[s])
        for node, s in zip(space.nodes, plan.choice)
        if node.kind == "param" and node.alias_of is None
    ]


def test_a_chunk_costs_its_parameters_alone_less_the_latencies_it_saves() -> None:
    plan = _fsdp()
    space, numels = plan.space, _numels(plan)
    [stream] = chosen_streams(space, plan.choice, ZERO3).streams
    assert stream.chunks == 1 and stream.elements == sum(numels) and len(numels) == 4
    assert stream.per_chunk_s > 0  # gloo: an all-gather and a reduce-scatter of latency
    # The one chunk holds the parameter the graph uses last: the runtime keeps it gathered
    # from forward into backward, so it is gathered once (twice, priced alone unkept).
    assert stream.keeps_last
    unkept = stream_price(space, ZERO3, (0,), (0,), numels)
    assert unkept.per_chunk_s > stream.per_chunk_s and unkept.per_element_s > stream.per_element_s
    alone = [stream_price(space, ZERO3, (0,), (0,), [n], keeps_last=True) for n in numels]
    chunk_s = stream.per_chunk_s * stream.chunks + stream.per_element_s * stream.elements
    alone_s = sum(a.per_chunk_s + a.per_element_s * n for a, n in zip(alone, numels))
    saved_s = (len(numels) - stream.chunks) * stream.per_chunk_s
    assert chunk_s == pytest.approx(alone_s - saved_s, rel=1e-12)
    # The plan's ZeRO seconds: the chunk, less the bucketed all-reduce it replaces, its bytes
    # and the last bucket's rounding its consumers price (pricing.rounding_given_back): the
    # parameters' gradients join no bucket, so the step's gradient and ZeRO communication is
    # the chunk's collectives and nothing else.
    pricer = CommPricer(space.mesh, None)
    replaced = sum(pricer.grad_sync_s(n * 4, 0) for n in numels)
    rounding = sum(r[0] for r in rounding_given_back(space, choice=plan.choice).values())
    assert rounding > 0.1 * pricer.all_reduce_latency_s(0)  # gloo's latency, tiny gradients
    breakdown = plan.data["predicted"]["breakdown"]
    assert breakdown["zero_comm_s"] == pytest.approx(chunk_s - replaced - rounding, rel=1e-9)
    assert breakdown["grad_sync_s"] + breakdown["zero_comm_s"] == pytest.approx(chunk_s, rel=1e-9)


def test_a_parameter_joining_a_stream_adds_its_bytes_not_a_latency() -> None:
    space, numels = _fsdp().space, _numels(_fsdp())
    fewer = stream_price(space, ZERO3, (0,), (0,), numels[:-1])
    more = stream_price(space, ZERO3, (0,), (0,), numels)
    assert more.chunks == fewer.chunks == 1
    total = more.per_chunk_s + more.per_element_s * more.elements
    assert total - (fewer.per_chunk_s + fewer.per_element_s * fewer.elements) == pytest.approx(
        more.per_element_s * numels[-1], rel=1e-9
    )
    # A stream with no Partial gradient reduces nothing: gathers only.
    gathers = stream_price(space, ZERO3, (0,), (), numels)
    assert gathers.collectives == (("all_gather", 2), ("all_gather", 2))
    assert more.collectives == (("all_gather", 2), ("all_gather", 2), ("reduce_scatter", 2))
