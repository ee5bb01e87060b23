"""ZeRO priced per chunk: the collectives a plan is priced with are the ones the runtime issues.

One spawn of 2 gloo ranks plans the MLP of ``benchmarks/cost_model.py`` with the fsdp recipe
(every rank alike) and runs one step of it and of the same layout at ZeRO stage 1, recording
every chunk collective (``autopar.tools.bench_cost_terms.CollectiveLog``). Stage 3: the plan's
priced collectives (``autopar.planner.zero_pricing``: the streams the solve prices with) are
the issued ones, in kind, count and bytes (up to each chunk's padding to its shard count).
Stage 1: the step is priced as the bucketed all-reduce (``zero_pricing``'s docstring says why),
but the chunk model (``ChunkPricing.calls``, which sizes the chunks) names what is issued.
ddp: the gradient buckets are priced as the all-reduces the runtime issues, one per bucket
(``autopar.planner.pricing.bucket_rounding``; before, 0.24 of one on this model).

The same spawn plans the GPT of ``benchmarks/cost_model.py``. fsdp: its position embedding's
gradient is Partial like the others' (the lookup of the replicated positions is added to the
batch-sharded tokens; ``lowering.param_chains`` reduces its gradient with the parameter's,
not in backward), so it joins the one stream, gathered once and reduce-scattered: 2
collectives (gathered twice, 3 collectives, before session 24: the one chunk is the one the
graph uses last, which the runtime now keeps gathered from forward into backward, and the
pricing knows it since session 25: ``ChunkPricing.keeps_last``). (Before session 20 its
gradient was reduced in the graph and whole at the parameter: a stream of its own, priced with
one all-gather, 4 collectives; before that, the solve priced one stream of everything: 3
collectives for the 4 issued.) ddp: the loss's sum and token count are all-reduced in one call
(``lowering.fused_reductions``), priced as one all-reduce (``planner.fused_pricing``; before,
two).
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import pytest

FACTORY = "benchmarks.cost_model:mlp"
GPT = "benchmarks.cost_model:gpt"
BATCH, SEQ = 2, 16


def _log_graph_collectives(log: Any) -> None:
    """Also record, in ``log``, the lowered graph's collectives (``autopar.comm.collectives``,
    which issue them through ``_guarded``) as ``(op, "graph", group size, bytes)``."""
    import torch.distributed as dist

    from autopar.comm import collectives

    original = collectives._guarded

    def guarded(op, groups, axis, t, call, _run=original):  # type: ignore[no-untyped-def]
        size = dist.get_world_size(groups.groups[axis])
        log.calls.append((op, "graph", size, t.numel() * t.element_size()))
        return _run(op, groups, axis, t, call)

    collectives._guarded = guarded


def _loss_latencies(plan: Any) -> float:
    """The loss's reductions as the plan prices them, in all-reduces of a scalar: the edges into
    the loss (the sum and the count converted to Replicate), the pair edges between them
    (``planner.fused_pricing``) and the loss's own output conversion."""
    from autopar.planner.pricing import CommPricer

    space, choice = plan.space, plan.choice
    out = next(n for n in space.captured.gm.graph.nodes if n.op == "output")
    loss = space.index[out.all_input_nodes[0].name]
    into = [e for e in space.edges if e.dst == loss and e.input_index >= 0]
    producers = {e.src for e in into}
    pairs = [e for e in space.edges if e.input_index == -2 and {e.src, e.dst} <= producers]
    total = sum(float(e.cost_s[choice[e.src], choice[e.dst]]) for e in into + pairs)
    total += float(space.nodes[loss].output_comm_s[choice[loss]])
    return total / CommPricer(space.mesh, None).all_reduce_s(4.0, 0)


def _rank(rank: int, world_size: int) -> dict[str, Any]:
    import autopar
    from autopar.api import plan_captured
    from autopar.capture.export import capture
    from autopar.comm.process_groups import axis_groups
    from autopar.options import PlanOptions
    from autopar.planner.chunks import ChunkPricing
    from autopar.planner.pricing import priced_bucket_calls
    from autopar.planner.problem import ZeroConfig
    from autopar.planner.recipes import recipe_spec
    from autopar.planner.zero_pricing import chosen_streams, priced_calls, problem_streams
    from autopar.presets import build_preset
    from autopar.tools.bench_cost import prepare_plan
    from autopar.tools.bench_cost_terms import CollectiveLog, issued_per_step

    log = CollectiveLog()
    log.install()
    _log_graph_collectives(log)
    model, args, kwargs = build_preset(FACTORY, batch=BATCH, seq=SEQ)
    captured = capture(model, args, kwargs)
    mesh = autopar.Mesh.spec((2,), ("dp",), device="cpu")
    plan = plan_captured(
        captured, mesh, PlanOptions(recipe="fsdp"), model_name="mlp", price_baselines=False
    )
    ddp = plan_captured(
        captured, mesh, PlanOptions(recipe="ddp"), model_name="mlp", price_baselines=False
    )
    space, zero = plan.space, ZeroConfig(stage=3, axes=(0,))
    solved = problem_streams(space, zero, recipe_spec(space, "fsdp").allowed)
    stage1 = {**plan.data, "zero": {**plan.data["zero"], "stage": 1, "stages": {"dp": 1}}}
    groups = axis_groups((2,), ("a0",), key="priced")
    prepared = {
        name: prepare_plan(captured, model, args, kwargs, data, groups)
        for name, data in (("fsdp", plan.data), ("stage1", stage1), ("ddp", ddp.data))
    }
    gpt_model, gpt_args, gpt_kwargs = build_preset(GPT, batch=BATCH, seq=SEQ)
    gpt_captured = capture(gpt_model, gpt_args, gpt_kwargs)
    gpt = {
        recipe: plan_captured(
            gpt_captured, mesh, PlanOptions(recipe=recipe), model_name="gpt", price_baselines=False
        )
        for recipe in ("fsdp", "ddp")
    }
    for recipe, gpt_plan in gpt.items():
        prepared[f"gpt {recipe}"] = prepare_plan(
            gpt_captured, gpt_model, gpt_args, gpt_kwargs, gpt_plan.data, groups
        )
    gpt_space = gpt["fsdp"].space
    gpt_solved = problem_streams(gpt_space, zero, recipe_spec(gpt_space, "fsdp").allowed)
    stage1_model = ChunkPricing.on_mesh(
        shape=mesh.shape, links=mesh.links, device=mesh.device, stages=(1,),
        forward_s=0.0, backward_s=0.0,
    )  # fmt: skip
    return {
        "solved_is_chosen": solved.streams == chosen_streams(space, plan.choice, zero).streams,
        "priced": priced_calls(space, solved),
        "gpt_solved_is_chosen": gpt_solved.streams
        == chosen_streams(gpt_space, gpt["fsdp"].choice, zero).streams,
        "gpt_priced": priced_calls(gpt_space, gpt_solved),
        "gpt_streams": [(s.partial, s.regathers) for s in gpt_solved.streams],
        "gpt_loss_latencies": _loss_latencies(gpt["ddp"]),
        "ddp_buckets": priced_bucket_calls(ddp.space, ddp.choice),
        "stage1_model": [(k, n) for k, n, _ in stage1_model.calls(1.0, 1.0)],
        "issued": issued_per_step(prepared, log, warmup=1),
    }


@functools.cache
def _result() -> dict[str, Any]:
    from tests.distributed.launcher import run_distributed

    return run_distributed(_rank, 2, timeout_s=120)[0]


def _zero_calls(calls: list[tuple[str, str, int, int]]) -> list[tuple[str, str, int, int]]:
    return [c for c in calls if c[1].startswith("zero")]


@pytest.mark.distributed
def test_fsdp_is_priced_with_the_collectives_the_runtime_issues() -> None:
    result = _result()
    assert result["solved_is_chosen"]  # the solve priced the recipe's own streams
    priced, issued = result["priced"], _zero_calls(result["issued"]["fsdp"])
    assert (
        Counter(k for k, _, _ in priced)
        == Counter(c[0] for c in issued)
        == {
            "all_gather": 1,  # one chunk, the one used last: kept from forward into backward
            "reduce_scatter": 1,
        }
    )
    # Bytes: each chunk is padded to a multiple of its 2 shards (4-byte elements).
    padding = 2 * 4 * len(issued)
    assert abs(sum(b for _, _, b in priced) - sum(c[3] for c in issued)) <= padding


@pytest.mark.distributed
def test_stage1_chunk_model_names_the_collectives_the_runtime_issues() -> None:
    result = _result()
    issued = _zero_calls(result["issued"]["stage1"])
    # One chunk: its gradient all-reduced, then refreshed by one broadcast per rank (gloo).
    assert result["stage1_model"] == [(c[0], c[2]) for c in issued]
    assert [c[0] for c in issued] == ["all_reduce", "broadcast", "broadcast"]


@pytest.mark.distributed
def test_ddp_buckets_are_priced_as_the_all_reduces_the_runtime_issues() -> None:
    result = _result()
    issued = [c for c in result["issued"]["ddp"] if c[1].startswith("grad bucket")]
    assert [c[0] for c in issued] == ["all_reduce"]  # the whole model in one 25 MiB bucket
    assert result["ddp_buckets"] == [pytest.approx(len(issued), rel=1e-9)]
    assert not _zero_calls(result["issued"]["ddp"])


@pytest.mark.distributed
def test_zero3_prices_the_gathers_and_reductions_the_runtime_issues_per_chunk() -> None:
    result = _result()
    assert result["gpt_solved_is_chosen"]
    # Every gradient Partial (the position embedding's carried back to it), some saved.
    assert sorted(result["gpt_streams"]) == [((0,), True)]
    priced, issued = result["gpt_priced"], _zero_calls(result["issued"]["gpt fsdp"])
    assert (
        Counter(k for k, _, _ in priced)
        == Counter(c[0] for c in issued)
        == {"all_gather": 1, "reduce_scatter": 1}
    )
    padding = 2 * 4 * len(issued)
    assert abs(sum(b for _, _, b in priced) - sum(c[3] for c in issued)) <= padding


@pytest.mark.distributed
def test_the_loss_reductions_are_priced_as_the_one_fused_all_reduce_issued() -> None:
    result = _result()
    # Scalars in the lowered graph's collectives: the loss's sum and count, one 2-float buffer.
    issued = [c for c in result["issued"]["gpt ddp"] if c[1] == "graph" and c[3] <= 16]
    assert [(c[0], c[3]) for c in issued] == [("all_reduce", 8)]
    assert result["gpt_loss_latencies"] == pytest.approx(len(issued), rel=1e-3)
