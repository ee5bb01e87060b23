"""The fixed phases share their per-graph work (issue 16): the checkpoint candidates reuse the
strategy space's ``grad_nodes`` and ``saved_rules`` and compute each node's saved roots once;
the pricer's tables equal the direct calls and the candidates equal the ones computed from
scratch, on repeated layers (tiny LLaMA and GPT, 4 layers) and on a stack of unequal layers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn as nn

from autopar.capture.export import Captured, capture
from autopar.mesh import Mesh
from autopar.options import PlanOptions
from autopar.planner.checkpointing import Candidate, _ForwardPricer, candidate_segments
from autopar.planner.saved_activations import _root, _saves, saved_owners, saved_rules
from autopar.planner.space import build_space, grad_nodes
from tests.models import tiny_gpt, tiny_llama

MESH = Mesh.spec((2, 2), ("dp", "tp"))


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Unequal(nn.Module):
    """A stack of 4 layers whose hidden widths differ: no two layers are alike."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(16, h) for h in (32, 48, 64, 80))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def _unequal() -> Captured:
    return capture(_Unequal(), (torch.randn(8, 4, 16),), {})


@pytest.fixture(
    scope="module",
    params=["llama-4l", "gpt-4l", "unequal"],
)
def captured(request) -> Captured:
    if request.param == "unequal":
        return _unequal()
    model, args, kwargs = (tiny_llama if request.param == "llama-4l" else tiny_gpt)(layers=4)
    return capture(model, args, kwargs)


def _same_candidates(a: tuple[Candidate, ...], b: tuple[Candidate, ...]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.segment, x.node_index, x.footprint, x.block) == (
            y.segment,
            y.node_index,
            y.footprint,
            y.block,
        )
        for u, v in zip(x.freed_bytes + x.recompute_s, y.freed_bytes + y.recompute_s, strict=True):
            np.testing.assert_array_equal(u, v)
        assert [(s, d) for s, d, _ in x.edges] == [(s, d) for s, d, _ in y.edges]
        for (_, _, u), (_, _, v) in zip(x.edges, y.edges):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_space_keeps_the_graphs_grad_nodes_and_saved_rules(
    captured: Captured, mixed_precision: str | None
) -> None:
    space = build_space(captured, MESH, PlanOptions(mixed_precision=mixed_precision))
    needs = grad_nodes(captured.gm, captured.param_nodes)
    assert space.needs_grad == needs and needs
    assert space.saved == saved_rules(captured.gm.graph, needs) and space.saved


@pytest.mark.parametrize("mode", ["auto", "all"])
def test_candidates_equal_the_ones_computed_from_scratch(captured: Captured, mode: str) -> None:
    space = build_space(captured, MESH, PlanOptions(mixed_precision="bf16"))
    shared = candidate_segments(space, mode)
    scratch = candidate_segments(dataclasses.replace(space, needs_grad=None, saved=None), mode)
    assert shared
    _same_candidates(shared, scratch)


@pytest.mark.parametrize("shared", [True, False])
def test_forward_pricer_tables_equal_the_direct_calls(captured: Captured, shared: bool) -> None:
    space = build_space(captured, MESH, PlanOptions(mixed_precision="bf16"))
    if not shared:
        space = dataclasses.replace(space, needs_grad=None, saved=None)
    pricer = _ForwardPricer(space)
    graph = captured.gm.graph
    needs = grad_nodes(captured.gm, captured.param_nodes)
    assert pricer.rules == saved_rules(graph, needs) and pricer.rules
    assert pricer.owner == saved_owners(graph, needs) and pricer.owner
    want = [(n.name, {r.name for r in _saves(n, needs)[0]}) for n in graph.nodes]
    assert pricer.saves == want and any(roots for _, roots in want)
    for node in graph.nodes:
        assert pricer.root_of(node) is _root(node)
