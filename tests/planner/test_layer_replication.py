"""Capture of a stack of identical layers from 3 of them: the same program as a full export.

Each test compares ``capture`` (replicating layers) with ``capture(..., replicate_layers=False)``
(tracing every layer): node names, ops, arguments, module paths, shapes, FQNs, hash; and the
models the splice cannot model (layers that differ, skip connections between layers, forward
depending on the number of layers) fall back to the full export.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.capture.export import Captured, capture
from autopar.capture.export_compare import program_difference
from autopar.capture.layer_replication import export_replicated, find_repeated_layers
from autopar.presets import build_preset
from tests.models import tiny_gpt, tiny_llama


def _node_table(captured: Captured) -> list[tuple]:
    return [
        (
            node.name,
            node.op,
            str(node.target),
            node.meta.get("autopar_module_path"),
            node.meta.get("autopar_fqn"),
            [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()],
            tuple(node.meta["val"].shape)
            if isinstance(node.meta.get("val"), torch.Tensor)
            else None,
        )
        for node in captured.gm.graph.nodes
    ]


def _assert_same_capture(fast: Captured, full: Captured) -> None:
    assert program_difference(fast.exported, full.exported) is None
    assert fast.graph_hash == full.graph_hash
    assert len(fast.gm.graph.nodes) == len(full.gm.graph.nodes)
    assert _node_table(fast) == _node_table(full)
    assert fast.param_nodes == full.param_nodes
    assert fast.buffer_nodes == full.buffer_nodes
    assert (fast.input_nodes, fast.output_names) == (full.input_nodes, full.output_names)
    assert fast.gm.code == full.gm.code


def _assert_runs_like_eager(model: nn.Module, args: tuple, captured: Captured) -> None:
    """Forward and backward of the captured program equal eager (loss and every gradient)."""
    expected = model(*args)
    expected.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    got = captured.exported.module()(*args)
    got.backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("builder", [tiny_gpt, tiny_llama])
def test_tiny_zoo_at_depth_is_replicated_and_equals_full_export(builder) -> None:
    model, args, kwargs = builder(layers=9)
    fast = capture(model, args, kwargs)
    path = "blocks" if builder is tiny_gpt else "layers"
    assert fast.replicated_layers == f"{path}: 3 of 9 traced"
    full = capture(model, args, kwargs, replicate_layers=False)
    assert full.replicated_layers == ""
    _assert_same_capture(fast, full)
    _assert_runs_like_eager(model, args, fast)


@pytest.mark.parametrize("num_layers", [4, 5])
def test_tiny_llama_at_four_and_five_layers_splices_to_the_full_export(num_layers: int) -> None:
    model, args, kwargs = tiny_llama(layers=num_layers)
    spliced = export_replicated(model, args, kwargs, min_layers=4)
    assert spliced is not None
    full = torch.export.export(model, args, kwargs, strict=False)
    assert program_difference(spliced[0], full) is None


@pytest.mark.parametrize("name", ["llama3-8b-9l", "gpt2-small-8l"])
def test_preset_on_meta_is_replicated_and_equals_full_export(name: str) -> None:
    model, args, kwargs = build_preset(name, batch=2, seq=64)
    fast = capture(model, args, kwargs)
    assert fast.replicated_layers.startswith(("layers: 3 of", "blocks: 3 of"))
    _assert_same_capture(fast, capture(model, args, kwargs, replicate_layers=False))


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.scale = 1.0

        self.activation = torch.relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.activation(self.fc(x)) * self.scale


class _Stack(nn.Module):
    """8 blocks of one Linear; ``wiring`` says how forward chains them."""

    def __init__(self, wiring: str, num_layers: int = 8, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wiring = wiring
        self.layers = nn.ModuleList(_Block(width) for _ in range(num_layers))
        if wiring == "one layer differs":
            self.layers[6].scale = 2.0
        if wiring == "hardswish, an op without a rule":
            for layer in self.layers:
                layer.activation = F.hardswish
        if wiring == "one layer differs privately":
            self.layers[
                6
            ]._private_scale = 2.0  # an attribute forward does not read, still unproven alike

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        states = [x]
        for layer in self.layers:
            h = layer(states[-1])
            if self.wiring == "skip connection" and len(states) > 1:
                h = h + states[-2]
            states.append(h)
        out = states[-1]
        if self.wiring == "depth in forward":
            out = out / len(self.layers)
        if self.wiring == "all hidden states":
            out = torch.stack(states).sum(0)
        return F.mse_loss(out, y)


def _stack_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(4, 16, generator=generator), torch.randn(4, 16, generator=generator)


@pytest.mark.parametrize("wiring", ["chain", "hardswish, an op without a rule"])
def test_custom_stack_of_identical_blocks_is_replicated(wiring: str) -> None:
    model, args = _Stack(wiring), _stack_inputs()
    fast = capture(model, args)
    assert fast.replicated_layers == "layers: 3 of 8 traced"
    full = capture(model, args, replicate_layers=False)
    _assert_same_capture(fast, full)
    assert fast.decomposed_ops == full.decomposed_ops  # decomposed in the spliced program too
    _assert_runs_like_eager(model, args, fast)


@pytest.mark.parametrize(
    "wiring",
    [
        "one layer differs",
        "one layer differs privately",
        "skip connection",
        "depth in forward",
        "all hidden states",
    ],
)
def test_what_the_splice_cannot_model_falls_back_to_the_full_export(wiring: str) -> None:
    model, args = _Stack(wiring), _stack_inputs()
    fast = capture(model, args)
    assert fast.replicated_layers == ""
    _assert_same_capture(fast, capture(model, args, replicate_layers=False))
    _assert_runs_like_eager(model, args, fast)


def test_repeated_layers_are_found_only_where_every_layer_is_alike() -> None:
    model, _, _ = build_preset("llama3-8b-8l", batch=1, seq=8)
    found = find_repeated_layers(model)
    assert found is not None and found[2] == "layers" and found[0] is model
    assert find_repeated_layers(build_preset("llama3-8b-7l", batch=1, seq=8)[0]) is None  # < 8
    mlp, _, _ = build_preset("mlp-9l", batch=1, seq=8)  # first and last Linear differ in shape
    assert find_repeated_layers(mlp) is None
    assert find_repeated_layers(_Stack("one layer differs")) is None
    shared = _Stack("chain")
    shared.layers[3].fc = shared.layers[2].fc  # one Linear used by two layers
    assert find_repeated_layers(shared) is None
    aliased = _Stack("chain")
    aliased.blocks = aliased.layers  # one list under two names
    assert find_repeated_layers(aliased) is None
