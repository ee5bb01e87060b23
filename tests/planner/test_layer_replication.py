"""Capture of a stack of identical layers from 3 of them: the same program as a full export.

Each test compares ``capture`` (replicating layers) with ``capture(..., replicate_layers=False)``
(tracing every layer): node names, ops, arguments, module paths, shapes, FQNs, hash; and the
models the splice cannot model (layers that differ, skip connections between layers, forward
depending on the number of layers) fall back to the full export. For the built-in presets of
``SPLICE_PROVEN``, which ``autopar plan`` captures without the run-time check export, these
tests are the check: each such preset's splice equals real exports at 4 and 5 layers (and two
of them at 8 and 9, unchecked), and a Llama whose layers behave by position fails that proof.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.capture.export import Captured, capture
from autopar.capture.export_compare import program_difference
from autopar.capture.layer_replication import (
    SAMPLE_LAYERS,
    export_cut,
    find_repeated_layers,
    splice_layers,
)
from autopar.models import Llama
from autopar.presets import SPLICE_PROVEN, build_preset, splice_proven
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


@pytest.mark.parametrize("name", ["llama3-8b-9l", "gpt2-small-8l"])
def test_preset_on_meta_is_replicated_and_equals_full_export(name: str) -> None:
    # Unchecked, as `autopar plan` captures the presets: this test is (part of) the check.
    model, args, kwargs = build_preset(name, batch=2, seq=64)
    fast = capture(model, args, kwargs, check_splice=False)
    assert fast.replicated_layers.startswith(("layers: 3 of", "blocks: 3 of"))
    _assert_same_capture(fast, capture(model, args, kwargs, replicate_layers=False))


def _splice_differences(model: nn.Module, args: tuple, kwargs: dict, depths: tuple) -> list[str]:
    """Where the 3-layer sample of ``model`` spliced to each depth differs from a real export of
    the model cut to that depth (what ``export_replicated``'s run-time check does at depth 4)."""
    found = find_repeated_layers(model, min_layers=4)
    assert found is not None
    sample = export_cut(model, found, SAMPLE_LAYERS, args, kwargs)
    differences = []
    for depth in depths:
        spliced = splice_layers(sample, model, found[2], SAMPLE_LAYERS, depth)
        real = export_cut(model, found, depth, args, kwargs)
        difference = "no splice" if spliced is None else program_difference(spliced, real)
        if difference is not None:
            differences.append(f"{depth} layers: {difference}")
    return differences


@pytest.mark.parametrize("name", SPLICE_PROVEN)
def test_every_splice_proven_preset_splices_to_real_exports_at_four_and_five_layers(
    name: str,
) -> None:
    # The CI proof that lets `autopar plan` skip the run-time check export for these presets.
    model, args, kwargs = build_preset(f"{name}-5l", batch=1, seq=16)
    assert _splice_differences(model, args, kwargs, (4, 5)) == []


class _LlamaByPosition(Llama):
    """A preset whose layers behave by position: what the CI proof above must catch."""

    def __init__(self, config, rule: str) -> None:
        super().__init__(config)
        self.rule = rule

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = idx.shape[1]
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_embeddings(idx)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin)
            if self.rule == "odd layers scale" and index % 2:
                x = x * 0.5
        if self.rule == "depth in forward":
            x = x / len(self.layers)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


@pytest.mark.parametrize("rule", ["odd layers scale", "depth in forward"])
def test_the_splice_proof_fails_for_a_preset_whose_layers_differ_by_position(rule: str) -> None:
    preset, args, kwargs = build_preset("llama3-8b-5l", batch=1, seq=16)
    with torch.device("meta"):
        model = _LlamaByPosition(preset.config, rule)
    differences = _splice_differences(model, args, kwargs, (5,))
    assert [d.split(":")[0] for d in differences] == ["5 layers"]


def test_only_the_proven_presets_skip_the_run_time_check() -> None:
    assert splice_proven("llama3-8b") and splice_proven("llama3-70b-2l")
    assert splice_proven("gpt2-small") and splice_proven("llama-8l-2048")
    assert not splice_proven("mlp") and not splice_proven("hf:llama")
    assert not splice_proven("tests.models:tiny_llama") and not splice_proven("llama3-8b-x")


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
