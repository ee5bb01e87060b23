"""Capture of the test zoo: shapes, module paths, FQNs, numerics, hashes, errors, FLOPs."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopar.capture.export import ASSERT_OPS, Captured, capture, graph_hash
from autopar.capture.flops import NodeWork, node_costs
from autopar.errors import UnsupportedModelError
from autopar.models import GPT, GPTConfig
from tests.models import ALL_MODELS, tiny_gpt, tiny_llama

_CAPTURED: dict[str, tuple[nn.Module, tuple, dict, Captured]] = {}


def _zoo(name: str) -> tuple[nn.Module, tuple, dict, Captured]:
    """Each zoo model captured once per session (on real CPU tensors, no decomposition)."""
    if name not in _CAPTURED:
        model, args, kwargs = ALL_MODELS[name]()
        _CAPTURED[name] = (model, args, kwargs, capture(model, args, kwargs, decompose=False))
    return _CAPTURED[name]


def _loss(output: object) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    return output.loss  # a Hugging Face ModelOutput


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_every_node_has_value_and_module_path(name: str) -> None:
    _, _, _, captured = _zoo(name)
    for node in captured.gm.graph.nodes:
        assert "val" in node.meta, node.name
        assert isinstance(node.meta["autopar_module_path"], str), node.name
        assert node.target not in ASSERT_OPS
    assert any(node.meta["autopar_module_path"] for node in captured.gm.graph.nodes)


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_parameter_placeholders_carry_model_fqns(name: str) -> None:
    model, _, _, captured = _zoo(name)
    all_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert set(captured.param_nodes.values()) <= all_names
    covered = set(captured.param_nodes.values())
    for fqn in captured.param_nodes.values():
        covered.update(captured.tied_params.get(fqn, []))
    assert {n for n, _ in model.named_parameters()} <= covered
    nodes = {node.name: node for node in captured.gm.graph.nodes}
    for node_name, fqn in {**captured.param_nodes, **captured.buffer_nodes}.items():
        assert nodes[node_name].meta["autopar_fqn"] == fqn
        assert nodes[node_name].op == "placeholder"
    assert captured.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(ALL_MODELS))
def test_exported_module_matches_eager(name: str) -> None:
    model, args, kwargs, captured = _zoo(name)
    with torch.no_grad():
        expected = _loss(model(*args, **kwargs))
        got = _loss(captured.exported.module()(*args, **kwargs))
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_inputs_and_outputs_are_named_in_order() -> None:
    _, _, _, gpt = _zoo("tiny_gpt")
    assert gpt.input_nodes == ["idx", "targets"]
    assert len(gpt.output_names) == 1
    _, _, _, hf = _zoo("hf_gpt2")
    assert hf.input_nodes == ["input_ids", "labels", "use_cache"]
    assert hf.output_names[0].startswith("div")  # mean loss rewritten as sum / count


def test_module_paths_name_the_innermost_module() -> None:
    _, _, _, captured = _zoo("tiny_gpt")
    linear_paths = {
        node.meta["autopar_module_path"]
        for node in captured.gm.graph.nodes
        if node.target == torch.ops.aten.linear.default
    }
    assert "blocks.0.attn.qkv" in linear_paths
    assert "blocks.1.mlp.proj" in linear_paths
    nodes = {node.name: node for node in captured.gm.graph.nodes}
    qkv_weight = next(
        n for n, fqn in captured.param_nodes.items() if fqn == "blocks.0.attn.qkv.weight"
    )
    assert nodes[qkv_weight].meta["autopar_module_path"] == "blocks.0.attn.qkv"


def test_tied_weights_are_recorded() -> None:
    _, _, _, captured = _zoo("tiny_gpt")
    assert captured.tied_params["wte.weight"] == ["lm_head.weight"]
    assert captured.tied_params["lm_head.weight"] == ["wte.weight"]
    _, _, _, llama = _zoo("tiny_llama")
    assert llama.tied_params == {}


@pytest.mark.parametrize("builder", [tiny_gpt, tiny_llama])
def test_meta_capture_allocates_nothing_and_hashes_like_real(builder) -> None:
    _, _, _, real = _zoo(builder.__name__)
    with torch.device("meta"):
        model, args, kwargs = builder()
    captured = capture(model, args, kwargs, decompose=False)
    assert all(t.is_meta for t in captured.exported.state_dict.values())
    assert all(p.is_meta for p in model.parameters())
    assert captured.graph_hash == real.graph_hash
    assert graph_hash(captured.gm) == captured.graph_hash


def test_hash_changes_with_shapes() -> None:
    config = GPTConfig(vocab_size=128, block_size=16, n_layer=1, n_head=4, n_embd=64)
    with torch.device("meta"):
        model = GPT(config)
        idx8 = torch.zeros(8, 16, dtype=torch.long)
        idx4 = torch.zeros(4, 16, dtype=torch.long)
    hash8 = capture(model, (idx8, idx8), decompose=False).graph_hash
    hash4 = capture(model, (idx4, idx4), decompose=False).graph_hash
    assert hash8 != hash4
    assert hash8 == capture(model, (idx8, idx8), decompose=False).graph_hash


def test_captured_zoo_ops_have_rules_or_no_decomposition() -> None:
    from autopar.strategies.registry import get_rule

    model, args, kwargs = tiny_gpt()
    captured = capture(model, args, kwargs)
    export_table = torch.export.default_decompositions()
    for node in captured.gm.graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            assert get_rule(node.target) is not None or node.target not in export_table, node.target
    with torch.no_grad():
        expected = model(*args)
        torch.testing.assert_close(
            captured.exported.module()(*args), expected, rtol=1e-5, atol=1e-6
        )


_RARE_ACTIVATIONS = [
    (F.hardswish, torch.ops.aten.hardswish.default),
    (F.selu, torch.ops.aten.selu.default),
    (F.celu, torch.ops.aten.celu.default),
    (torch.frac, torch.ops.aten.frac.default),
]


def test_op_without_rule_is_decomposed_and_numerics_kept() -> None:
    from autopar.strategies.registry import get_rule

    unruled = [(fn, op) for fn, op in _RARE_ACTIVATIONS if get_rule(op) is None]
    if not unruled:
        pytest.skip("every candidate op has a sharding rule now")
    activation, op = unruled[0]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return activation(self.linear(x)).sum()

    model, x = Model(), torch.randn(4, 8)
    plain = capture(model, (x,), decompose=False)
    assert any(node.target == op for node in plain.gm.graph.nodes)
    captured = capture(model, (x,))
    assert str(op) in captured.decomposed_ops
    assert all(node.target != op for node in captured.gm.graph.nodes)
    assert captured.graph_hash != plain.graph_hash
    with torch.no_grad():
        torch.testing.assert_close(captured.exported.module()(x), model(x))


# --------------------------------------------------------------------------------------------
# Models that cannot be captured


class BranchOnValue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        if y.sum() > 0:  # marker: branch
            return y * 2
        return y


class CallsItem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        scale = y.abs().max().item()  # marker: item
        return y / scale


class MasksByValue(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x > 0].sum()  # marker: mask


def _line_of(marker: str) -> int:
    with open(__file__, encoding="ascii") as source:
        for number, line in enumerate(source, start=1):
            if line.rstrip().endswith(f"# marker: {marker}"):
                return number
    raise AssertionError(marker)


@pytest.mark.parametrize(
    "model, marker, advice",
    [
        (BranchOnValue(), "branch", "torch.where"),
        (CallsItem(), "item", ".item()"),
        (MasksByValue(), "mask", "boolean-mask"),
    ],
)
def test_untraceable_model_error_names_the_source_line(
    model: nn.Module, marker: str, advice: str
) -> None:
    with pytest.raises(UnsupportedModelError) as info:
        capture(model, (torch.randn(4, 8),))
    message = str(info.value)
    assert f"test_capture.py:{_line_of(marker)}" in message
    assert advice in message


# --------------------------------------------------------------------------------------------
# FLOPs


def _single_op_graph(fn, *inputs: torch.Tensor) -> list:
    class Wrapper(nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    captured = capture(Wrapper(), inputs, decompose=False)
    return [n for n in captured.gm.graph.nodes if n.op == "call_function"]


def test_linear_flops_are_2mnk_and_weight_grad_doubles_backward() -> None:
    with torch.device("meta"):
        layer = nn.Linear(32, 48, bias=True)
        x = torch.empty(4, 6, 32)
    captured = capture(layer, (x,), decompose=False)
    (node,) = [n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.linear.default]
    work = node_costs(node)
    assert work.family == "matmul"
    assert work.fwd_flops == 2 * 24 * 32 * 48
    # x needs no gradient, the weight does: backward is one more matmul.
    assert work.bwd_flops == work.fwd_flops
    assert work.fwd_bytes == 4 * (24 * 32 + 48 * 32 + 48 + 24 * 48)
    assert work.bwd_bytes == 2 * work.fwd_bytes


def test_causal_attention_counts_about_half() -> None:
    q = torch.empty(2, 4, 64, 16, device="meta")
    full = _single_op_graph(lambda a, b, c: F.scaled_dot_product_attention(a, b, c), q, q, q)
    causal = _single_op_graph(
        lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, q, q
    )
    full_work = node_costs(full[0])
    causal_work = node_costs(causal[0])
    assert full_work.family == causal_work.family == "attention"
    assert full_work.fwd_flops == 4 * 2 * 4 * 64 * 64 * 16
    assert causal_work.fwd_flops == pytest.approx(full_work.fwd_flops * 65 / 128)
    assert full_work.bwd_flops == 0  # no input needs a gradient


def test_views_move_no_bytes() -> None:
    x = torch.empty(8, 16, device="meta")
    nodes = _single_op_graph(lambda a: a.view(16, 8).transpose(0, 1), x)
    for node in nodes:
        assert node_costs(node) == NodeWork(
            fwd_flops=0.0, bwd_flops=0.0, fwd_bytes=0, bwd_bytes=0, family="view"
        )


def test_tiny_gpt_training_flops_near_six_params_tokens() -> None:
    model, args, _, captured = _zoo("tiny_gpt")
    total = 0.0
    families = set()
    for node in captured.gm.graph.nodes:
        work = node_costs(node)
        total += work.fwd_flops + work.bwd_flops
        families.add(work.family)
    tokens = args[0].numel()
    ratio = total / (6 * captured.num_params * tokens)
    assert 0.8 < ratio < 1.5, ratio
    assert {"matmul", "attention", "norm", "embedding", "view", "loss"} <= families


def test_embedding_reads_rows_not_the_table() -> None:
    with torch.device("meta"):
        table = nn.Embedding(1000, 64)
        idx = torch.zeros(4, 8, dtype=torch.long)
    captured = capture(table, (idx,), decompose=False)
    (node,) = [n for n in captured.gm.graph.nodes if n.op == "call_function"]
    work = node_costs(node)
    out_bytes = 4 * 8 * 64 * 4
    assert work.family == "embedding" and work.fwd_flops == 0
    assert work.fwd_bytes == 4 * 8 * 8 + 2 * out_bytes
    assert work.bwd_bytes == 1000 * 64 * 4 + 2 * out_bytes


def test_fake_tensor_inputs_capture_the_same_graph_as_real_ones():
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, args, kwargs = tiny_gpt()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_args = tuple(mode.from_tensor(t) for t in args)
    assert capture(model, fake_args, kwargs).graph_hash == capture(model, args, kwargs).graph_hash
