"""Partial gradients carried back through ops on one parameter (``lowering.param_chains``).

A replicated lookup, slice or function of a parameter, used with batch-sharded activations,
receives a Partial gradient. The lowering moves its reduction to the parameter (the runtime's
buckets, or ZeRO's reduce-scatter) when every op between the two has replicated inputs and
every use of every value on the way leaves a Partial gradient; otherwise it stays in the graph:

* the tiny GPT's position embedding (``embedding(wpe, arange)``) and Hugging Face GPT-2's
  (``embedding`` then ``to``) under the ddp recipe: no gradient all-reduce left in the graph,
  ``wpe.weight`` reduced after backward on every mesh axis;
* a model with a position table read through ``slice`` and ``unsqueeze`` and a gate table
  through ``slice`` and ``tanh`` (both deferred), and a bias table whose rows also enter a
  replicated penalty added to the loss (a whole gradient: its rows' Partial gradient is
  all-reduced in the graph, the table not deferred); the same model also returning the
  position rows (a use outside the graph's edges: reduced in the graph); a position table
  more than ``CARRY_EXTRA_BYTES`` larger than the rows it reads keeps their all-reduce, one
  row fewer moves;
* numerics on gloo, against one process: that model and the tiny GPT under ddp on 2 ranks and
  on 2x2, and under fsdp (ZeRO-3) on 2 ranks: loss, every gradient and the parameters after 3
  SGD steps (fp32, rtol 1e-5, atol 1e-6), with the gradient all-reduces left in the graph
  counted.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.comm import collectives
from tests.distributed.reference import (
    assert_close_named,
    full_grads,
    model_loss,
    sgd_reference,
    sgd_steps,
)

RTOL, ATOL = 1e-5, 1e-6
NUM_STEPS = 3
LR = 0.1
VOCAB, WIDTH, SEQ, BATCH = 32, 16, 8, 4


class PositionTables(nn.Module):
    """Token embedding plus position rows (slice, unsqueeze) and bias rows, times a gate
    (slice, tanh), then a head; the loss adds a replicated penalty on the bias rows, and the
    model optionally also returns the position rows."""

    def __init__(self, *, return_rows: bool = False, pos_rows: int = 2 * SEQ) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(pos_rows, WIDTH))
        self.gate = nn.Parameter(torch.randn(2 * SEQ, WIDTH))
        self.bias = nn.Parameter(torch.randn(2 * SEQ, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)
        self.return_rows = return_rows

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> Any:
        t = idx.shape[1]
        rows = self.pos[:t]
        bias = self.bias[:t]
        x = (self.tok(idx) + rows.unsqueeze(0) + bias) * torch.tanh(self.gate[:t])
        loss = F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
        loss = loss + 0.01 * bias.square().mean()
        return (loss, rows) if self.return_rows else loss


def position_tables(
    return_rows: bool = False, pos_rows: int = 2 * SEQ
) -> tuple[nn.Module, tuple[Any, ...], dict]:
    torch.manual_seed(0)
    model = PositionTables(return_rows=return_rows, pos_rows=pos_rows)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ))
    return model, (idx, torch.randint(0, VOCAB, (BATCH, SEQ))), {}


def tiny_gpt() -> tuple[nn.Module, tuple[Any, ...], dict]:
    from tests import models

    return models.tiny_gpt()


MODELS = {"tables": position_tables, "gpt": tiny_gpt}


def _lowered(build: Any, recipe: str, mesh: str) -> Any:
    import autopar
    from autopar.api import plan_captured
    from autopar.capture.export import capture
    from autopar.lowering import lower
    from autopar.options import PlanOptions
    from autopar.plan.document import Plan

    model, args, kwargs = build()
    captured = capture(model, args, kwargs)
    plan = plan_captured(
        captured,
        autopar.Mesh.parse(mesh, device="h100"),
        PlanOptions(recipe=recipe),
        model_name="m",
        price_baselines=False,
    )
    return lower(captured, Plan(data=dict(plan.data)).choices(), plan.space.mesh.shape, "k")


def _in_graph(lowered: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name of the reduced value, axes) of every gradient all-reduce left in the graph."""
    return [
        (n.args[0].name, tuple(n.args[2]))
        for n in lowered.gm.graph.nodes
        if n.target is collectives.autopar_grad_all_reduce
    ]


@pytest.mark.parametrize(("mesh", "axes"), [("4", (0,)), ("2x2", (0, 1))])
def test_gpt_position_embedding_gradient_joins_the_buckets(mesh: str, axes: tuple) -> None:
    lowered = _lowered(tiny_gpt, "ddp", mesh)
    assert _in_graph(lowered) == []
    assert lowered.param_grad_reduce_axes["wpe.weight"] == axes


def test_hf_gpt2_position_embedding_passes_its_cast() -> None:
    from tests import models

    lowered = _lowered(models.hf_gpt2, "ddp", "2")
    assert _in_graph(lowered) == []
    assert lowered.param_grad_reduce_axes["transformer.wpe.weight"] == (0,)


def _reduced_values(lowered: Any) -> list[str]:
    """The op (``slice``, ``unsqueeze``, ...) of each value reduced in the graph."""
    return sorted(name.rstrip("_0123456789") for name, _ in _in_graph(lowered))


def test_chains_are_deferred_only_where_every_use_leaves_a_partial_gradient() -> None:
    lowered = _lowered(position_tables, "ddp", "2")
    assert _reduced_values(lowered) == ["slice"]  # the bias rows, before their two uses
    assert lowered.param_grad_reduce_axes["pos"] == (0,)
    assert lowered.param_grad_reduce_axes["gate"] == (0,)
    assert "bias" not in lowered.param_grad_reduce_axes
    # The position rows are also an output: their gradient from there is whole on every rank.
    lowered = _lowered(functools.partial(position_tables, True), "ddp", "2")
    assert _reduced_values(lowered) == ["slice", "unsqueeze"]
    assert "pos" not in lowered.param_grad_reduce_axes
    assert lowered.param_grad_reduce_axes["gate"] == (0,)


def test_a_table_much_larger_than_the_rows_read_keeps_their_all_reduce() -> None:
    from autopar.planner.chain_grads import CARRY_EXTRA_BYTES

    # 4 bytes per element: the table is just over the limit larger than the 8 rows read.
    rows = (CARRY_EXTRA_BYTES + SEQ * WIDTH * 4) // (WIDTH * 4) + 1
    lowered = _lowered(functools.partial(position_tables, pos_rows=rows), "ddp", "2")
    assert _reduced_values(lowered) == ["slice", "unsqueeze"]
    assert "pos" not in lowered.param_grad_reduce_axes
    lowered = _lowered(functools.partial(position_tables, pos_rows=rows - 1), "ddp", "2")
    assert _reduced_values(lowered) == ["slice"]
    assert lowered.param_grad_reduce_axes["pos"] == (0,)


# ---------------------------------------------------------------------------------------------
# Numerics on gloo ranks.


def _close(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_close_named(what, got, want, rtol=RTOL, atol=ATOL)


def check_case(model_name: str, recipe: str, shape: tuple[int, ...]) -> dict[str, Any]:
    import autopar

    build = MODELS[model_name]
    model, args, kwargs = build()
    want = sgd_reference(model, args, kwargs, lr=LR, steps=NUM_STEPS)
    model, args, kwargs = build()
    mesh = autopar.Mesh.from_world(shape, device="h100")
    pmodel = autopar.autoparallelize(
        model, mesh, args, kwargs, recipe=recipe, optimizer="sgd", price_baselines=False
    )
    local_args = pmodel.shard_inputs(*args)
    loss = model_loss(pmodel(*local_args))
    _close("loss", loss.detach(), want["loss"])
    loss.backward()
    for name, grad in full_grads(pmodel).items():
        _close(f"grad of {name}", grad, want["grads"][name])
    sgd_steps(pmodel, local_args, {}, lr=LR, steps=NUM_STEPS)
    state = pmodel.state_dict()
    for name, param in want["params"].items():
        _close(f"{name} after {NUM_STEPS} SGD steps", state[name], param.detach())
    return {"in_graph": _in_graph(pmodel.lowered)}


CASES = {
    2: [("tables", "ddp"), ("gpt", "ddp"), ("tables", "fsdp"), ("gpt", "fsdp")],
    4: [("tables", "ddp"), ("gpt", "ddp")],
}


def run_case(rank: int, world_size: int, case: tuple[str, str]) -> Any:
    shape = (world_size,) if world_size == 2 else (2, 2)
    return check_case(*case, shape)


@functools.cache
def _results(world_size: int) -> dict[str, Any]:
    from tests.distributed.launcher import run_cases

    cases = [(f"{m}/{r}", (m, r)) for m, r in CASES[world_size]]
    return run_cases(run_case, world_size, cases, timeout_s=300)


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "case"), [(w, f"{m}/{r}") for w, cases in CASES.items() for m, r in cases]
)
def test_deferred_position_gradients_train_like_one_process(world_size: int, case: str) -> None:
    # Only the bias rows keep their gradient all-reduce (one call, every axis).
    expected = 1 if case.startswith("tables/") else 0
    for value in _results(world_size)[case].check():
        assert len(value["in_graph"]) == expected, value
