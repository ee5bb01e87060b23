"""Fused reductions (``autopar.lowering.fused_reductions``): specification and numerics.

* On hand-built graphs: back-to-back all-reduces on one axis are fused; not when one uses
  another's result, not across axes, not a float of another dtype, and an integer only when it
  is a count whose bound the buffer's dtype holds exactly.
* On 2 and 4 gloo ranks: the tiny GPT under the ddp recipe with ``ignore_index`` targets spread
  unevenly over the ranks (a rank may hold none, or only ignored ones) issues ONE all-reduce
  for its loss (sum and count fused), and its loss, every gradient and the parameters after 3
  SGD steps equal one process's (fp32, rtol 1e-5, atol 1e-6).
* The fused all-reduce against separate ones on the same values (64 random loss sums of
  magnitudes 1e-3..1e3 and counts): the 2-element buffer bit-identical on 2 and 4 gloo ranks;
  a longer buffer (a [3, 2] block first) bit-identical on 2 ranks, equal to rounding (rtol
  1e-5, atol 1e-6 of the values' scale) on 4, where gloo's ring adds its elements in another rank order.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import pytest
import torch
import torch.fx as fx

from autopar.comm import collectives
from autopar.lowering.fused_reductions import fuse_all_reduces
from tests.chains import loss_and_count_chains
from tests.distributed.reference import assert_close_named, model_loss, sgd_reference, sgd_steps

RTOL, ATOL = 1e-5, 1e-6
NUM_STEPS = 3
LR = 0.1
IGNORED_PER_ROW = (10, 0, 3, 16, 0, 7, 16, 1)
"""Ignored targets in each of the 8 rows (16 tokens each): uneven over 2 and 4 ranks, and on 4
ranks rank 1 holds a fully ignored row next to a partly ignored one."""


# ---------------------------------------------------------------------------------------------
# The pass on hand-built graphs.


def _graph(*specs: tuple[str, torch.dtype, tuple[int, ...], str, int]) -> fx.Graph:
    """One all-reduce per spec (name, dtype, shape, group key, axis) of a placeholder with that
    value; a spec whose name starts with ``count`` all-reduces ``sum`` of a bool placeholder."""
    graph = fx.Graph()
    outs = []
    for name, dtype, shape, key, axis in specs:
        if name.startswith("count"):
            flags = graph.placeholder(f"{name}_flags")
            flags.meta["val"] = torch.zeros(shape, dtype=torch.bool)
            value = graph.call_function(torch.ops.aten.sum.default, (flags,))
            value.meta["val"] = torch.zeros((), dtype=dtype)
        else:
            value = graph.placeholder(name)
            value.meta["val"] = torch.zeros(shape, dtype=dtype)
        outs.append(graph.call_function(collectives.autopar_all_reduce, (value, key, axis)))
    graph.output(tuple(outs))
    return graph


def _calls(graph: fx.Graph) -> list[str]:
    return [
        n.target.__name__ for n in graph.nodes if n.op == "call_function" and "autopar" in str(n)
    ]


def test_loss_sum_and_token_count_become_one_all_reduce() -> None:
    graph = _graph(("loss", torch.float32, (), "m", 0), ("count", torch.int64, (64,), "m", 0))
    assert fuse_all_reduces(graph) == 1
    graph.lint()
    assert _calls(graph) == ["autopar_all_reduce_many"]
    fused = next(n for n in graph.nodes if n.target is collectives.autopar_all_reduce_many)
    assert [a.name for a in fused.args[0]] == ["loss", "sum_default"]
    assert fused.args[1:] == ("m", 0, torch.float32)
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    assert [(o.target, o.args[1]) for o in outputs] == [
        (operator.getitem, 0),
        (operator.getitem, 1),
    ]


def test_reductions_that_cannot_share_a_buffer_stay_apart() -> None:
    cases = {
        "other axis": _graph(
            ("a", torch.float32, (4,), "m", 0), ("b", torch.float32, (4,), "m", 1)
        ),
        "other mesh": _graph(
            ("a", torch.float32, (4,), "m", 0), ("b", torch.float32, (4,), "n", 0)
        ),
        "other float dtype": _graph(
            ("a", torch.float32, (4,), "m", 0), ("b", torch.float64, (4,), "m", 0)
        ),
        "integer that is no count": _graph(
            ("a", torch.float32, (4,), "m", 0), ("b", torch.int64, (4,), "m", 0)
        ),
        "count beyond float32's exact integers": _graph(
            ("a", torch.float32, (), "m", 0), ("count", torch.int64, (2**24 + 1,), "m", 0)
        ),
        "count beyond bfloat16's exact integers": _graph(
            ("a", torch.bfloat16, (), "m", 0), ("count", torch.int64, (257,), "m", 0)
        ),
        "too large to copy": _graph(
            ("a", torch.float32, (65536,), "m", 0), ("b", torch.float32, (1,), "m", 0)
        ),
    }
    for what, graph in cases.items():
        assert fuse_all_reduces(graph) == 0, what
        assert _calls(graph) == ["autopar_all_reduce"] * 2, what


def test_a_reduction_of_a_reduced_value_is_not_fused_with_it() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.zeros(4)
    first = graph.call_function(collectives.autopar_all_reduce, (x, "m", 0))
    used = graph.call_function(torch.ops.aten.mul.Tensor, (first, 2.0))
    used.meta["val"] = torch.zeros(4)
    second = graph.call_function(collectives.autopar_all_reduce, (used, "m", 0))
    third = graph.call_function(collectives.autopar_all_reduce, (x, "m", 0))
    graph.output((second, third))
    # ``first`` is used before ``second``: only ``second`` and ``third`` may share a buffer.
    assert fuse_all_reduces(graph) == 1
    graph.lint()
    fused = next(n for n in graph.nodes if n.target is collectives.autopar_all_reduce_many)
    assert [a.name for a in fused.args[0]] == ["mul_tensor", "x"]
    assert first in graph.nodes


def test_chains_over_two_axes_are_fused_axis_by_axis() -> None:
    """A sum and a count each all-reduced on axis 0 then axis 1, issued chain after chain: the
    pass orders the four calls by chain step and fuses each step (two calls, axis 0 first), the
    count checked on its chain's origin (the second step's input is the first's result)."""
    graph, ends = loss_and_count_chains((0, 1), (0, 1), "m")
    div = graph.call_function(torch.ops.aten.div.Tensor, tuple(ends))
    graph.output((div,))
    assert fuse_all_reduces(graph) == 2
    graph.lint()
    fused = [n for n in graph.nodes if n.target is collectives.autopar_all_reduce_many]
    assert _calls(graph) == ["autopar_all_reduce_many"] * 2
    assert [n.args[2] for n in fused] == [0, 1]
    assert [a.name for a in fused[0].args[0]] == ["loss", "sum_default"]
    assert all(a.args[0] is fused[0] for a in fused[1].args[0])
    assert [a.args[1] for a in fused[1].args[0]] == [0, 1]
    assert [a.args for a in div.args] == [(fused[1], 0), (fused[1], 1)]


def test_chains_are_reordered_only_within_a_block_of_all_reduces() -> None:
    """A node between two chains (here one using the first chain's result) keeps them apart:
    nothing moves across it, and each chain stays as issued."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.zeros(4)
    a = graph.call_function(collectives.autopar_all_reduce, (x, "m", 0))
    b = graph.call_function(collectives.autopar_all_reduce, (a, "m", 1))
    used = graph.call_function(torch.ops.aten.mul.Tensor, (b, 2.0))
    c = graph.call_function(collectives.autopar_all_reduce, (used, "m", 0))
    d = graph.call_function(collectives.autopar_all_reduce, (c, "m", 1))
    for node in (a, b, used, c, d):
        node.meta["val"] = torch.zeros(4)
    graph.output((d,))
    assert fuse_all_reduces(graph) == 0
    assert [n for n in graph.nodes if n.op == "call_function"] == [a, b, used, c, d]


# ---------------------------------------------------------------------------------------------
# Numerics on gloo ranks.


def _ignored_gpt() -> tuple[torch.nn.Module, tuple[Any, ...], dict[str, Any]]:
    from tests import models

    model, (idx, targets), kwargs = models.tiny_gpt()
    targets = targets.clone()
    for row, count in enumerate(IGNORED_PER_ROW):
        targets[row, :count] = -100
    return model, (idx, targets), kwargs


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close_named(what, got, want, rtol=RTOL, atol=ATOL)


def check_ddp_ignore_index(shape: tuple[int, ...]) -> dict[str, Any]:
    """The ddp recipe on ``shape``: the loss's sum and count take one fused all-reduce per mesh
    axis (on 2x2, each value's two-step chain fused axis by axis: two calls, not four)."""
    import autopar
    from autopar.runtime.module import gather_full

    model, args, kwargs = _ignored_gpt()
    want = sgd_reference(model, args, kwargs, lr=LR, steps=NUM_STEPS)
    model, args, kwargs = _ignored_gpt()
    mesh = autopar.Mesh.from_world(shape, device="h100")
    pmodel = autopar.autoparallelize(
        model, mesh, args, kwargs, recipe="ddp", optimizer="sgd", price_baselines=False
    )
    code = pmodel.lowered.gm.code
    assert code.count("autopar_all_reduce_many(") == len(shape), code
    assert "autopar_all_reduce(" not in code, code
    local_args = pmodel.shard_inputs(*args)
    loss = model_loss(pmodel(*local_args))
    _close("loss", loss.detach(), want["loss"])
    loss.backward()
    group_of = pmodel.groups.groups.__getitem__
    for name, param in pmodel.named_parameters():
        grad = gather_full(param.grad, pmodel.lowered.param_placements[name], group_of)
        _close(f"grad of {name}", grad, want["grads"][name])
    sgd_steps(pmodel, local_args, {}, lr=LR, steps=NUM_STEPS)
    state = pmodel.state_dict()
    for name, param in want["params"].items():
        _close(f"{name} after {NUM_STEPS} SGD steps", state[name], param.detach())
    return {"loss": float(loss)}


def check_fused_against_separate(world_size: int) -> dict[str, Any]:
    """Random float sums (several magnitudes) and counts, fused and separately, on every rank."""
    import torch.distributed as dist

    from autopar.comm.process_groups import axis_groups

    axis_groups((world_size,), ("dp",), key="fused-vs-separate")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(1000 + rank)
    max_ulps, exact, long_exact = 0.0, True, True  # max_ulps: for the message when not exact
    for trial in range(64):
        scale = 10.0 ** (trial % 7 - 3)
        loss = torch.randn((), generator=generator) * scale
        count = torch.randint(0, 1000, (), generator=generator)
        want_loss = collectives.autopar_all_reduce(loss, "fused-vs-separate", 0)
        want_count = collectives.autopar_all_reduce(count, "fused-vs-separate", 0)
        got_loss, got_count = collectives.autopar_all_reduce_many(
            [loss, count], "fused-vs-separate", 0, torch.float32
        )
        assert got_count.dtype == torch.int64 and int(got_count) == int(want_count)
        # Not all scalars (the flatten-and-cat path): on 4 ranks gloo's ring may add a longer
        # buffer's elements in another rank order, so those sums agree to rounding only.
        block = torch.randn(3, 2, generator=generator)
        want_block = collectives.autopar_all_reduce(block, "fused-vs-separate", 0)
        got = collectives.autopar_all_reduce_many(
            [block, loss, count], "fused-vs-separate", 0, torch.float32
        )
        assert got[0].shape == (3, 2) and torch.equal(got[2], want_count)
        for got_part, want_part, part_scale in (
            (got[0], want_block, 1.0),
            (got[1], want_loss, scale),
        ):
            part_diff = (got_part - want_part).abs().max()
            long_exact = long_exact and bool(part_diff == 0)
            torch.testing.assert_close(got_part, want_part, rtol=RTOL, atol=ATOL * part_scale)
        diff = float((got_loss - want_loss).abs())
        exact = exact and diff == 0.0
        ulp = float(torch.finfo(torch.float32).eps * want_loss.abs().clamp_min(1e-30))
        max_ulps = max(max_ulps, diff / ulp)
    return {"bit_identical": exact, "max_ulps": max_ulps, "long_bit_identical": long_exact}


def run_case(rank: int, world_size: int, case: str) -> Any:
    if case == "gpt/dp_ignore_index":
        return check_ddp_ignore_index((world_size,))
    if case == "gpt/2x2_ignore_index":
        return check_ddp_ignore_index((2, 2))
    return check_fused_against_separate(world_size)


def _cases(world_size: int) -> tuple[str, ...]:
    extra = ("gpt/2x2_ignore_index",) if world_size == 4 else ()
    return ("gpt/dp_ignore_index", "fused-vs-separate", *extra)


@functools.cache
def _results(world_size: int) -> dict[str, Any]:
    from tests.distributed.launcher import run_cases

    return run_cases(
        run_case,
        world_size,
        [(case, case) for case in _cases(world_size)],
        timeout_s=300,
        env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"},
    )


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_mean_loss_with_ignored_tokens_trains_like_one_process(world_size: int) -> None:
    _results(world_size)["gpt/dp_ignore_index"].check()


@pytest.mark.distributed
def test_ddp_mean_loss_on_2x2_takes_one_call_per_axis_and_trains_like_one_process() -> None:
    _results(4)["gpt/2x2_ignore_index"].check()


@pytest.mark.distributed
@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_all_reduce_sums_like_separate_ones(world_size: int) -> None:
    values = _results(world_size)["fused-vs-separate"].check()
    # gloo adds a short buffer's elements in the same rank order as a lone scalar's.
    for value in values:
        assert value["bit_identical"], value
        assert value["long_bit_identical"] or world_size > 2, value
