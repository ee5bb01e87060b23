"""Presets: every name builds on meta from public shapes, quickly, with global-batch inputs."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from autopar.capture.export import capture
from autopar.models import GPT, Llama
from autopar.presets import PRESETS, build_preset, parse_hf_name


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_on_meta(name: str) -> None:
    start = time.perf_counter()
    model, args, kwargs = build_preset(name, batch=4, seq=64)
    assert time.perf_counter() - start < 5.0
    assert all(p.is_meta for p in model.parameters())
    assert all(a.is_meta and a.shape[0] == 4 for a in args)
    assert kwargs == {}


@pytest.mark.parametrize(
    "name, billions",
    [
        ("gpt2-small", 0.124),
        ("gpt2-xl", 1.56),
        ("llama3-8b", 8.03),
        ("llama3-70b", 70.6),
        ("llama-8l-2048", 0.418),
    ],
)
def test_presets_have_public_sizes(name: str, billions: float) -> None:
    model, _, _ = build_preset(name, batch=1, seq=16)
    assert _num_params(model) / 1e9 == pytest.approx(billions, rel=0.01)


def test_token_inputs_are_global_batch_int64() -> None:
    _, (idx, targets), _ = build_preset("llama3-8b-2l", batch=8, seq=128)
    assert idx.shape == targets.shape == (8, 128)
    assert idx.dtype == targets.dtype == torch.int64
    _, (x, y), _ = build_preset("mlp", batch=8, seq=1)
    assert x.shape == y.shape == (8, 1024) and x.dtype == torch.float32


def test_layer_suffix_builds_n_layers() -> None:
    llama, _, _ = build_preset("llama3-8b-2l", batch=2, seq=16)
    assert len(llama.layers) == 2 and llama.config.dim == 4096
    gpt, _, _ = build_preset("gpt2-small-4l", batch=2, seq=16)
    assert len(gpt.blocks) == 4 and gpt.config.vocab_size % 128 == 0


def test_two_layer_llama_preset_captures_on_meta() -> None:
    model, args, kwargs = build_preset("llama3-8b-2l", batch=2, seq=64)
    captured = capture(model, args, kwargs, decompose=False)
    assert all(t.is_meta for t in captured.exported.state_dict.values())
    assert captured.num_params == _num_params(model)


def test_hf_preset_builds_offline_with_overrides() -> None:
    model, args, kwargs = build_preset("hf:gpt2?n_layer=2", batch=2, seq=32)
    assert args == ()
    assert set(kwargs) == {"input_ids", "labels", "use_cache"} and kwargs["use_cache"] is False
    assert kwargs["input_ids"].shape == (2, 32) and kwargs["input_ids"].is_meta
    assert model.config.n_layer == 2 and model.config.n_embd == 768
    assert model.config._attn_implementation == "sdpa"


def test_hf_default_keeps_real_shapes() -> None:
    model, _, _ = build_preset("hf:gpt2", batch=1, seq=16)
    assert model.config.n_layer == 12 and _num_params(model) / 1e6 == pytest.approx(124.4, rel=0.01)


def test_hf_name_parsing_types_values() -> None:
    assert parse_hf_name(
        "llama?num_hidden_layers=2&tie_word_embeddings=true&rms_norm_eps=1e-6"
    ) == (
        "llama",
        {"num_hidden_layers": 2, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    )
    with pytest.raises(ValueError):
        parse_hf_name("llama?num_hidden_layers")


def test_factory_preset_loads_user_function() -> None:
    model, args, kwargs = build_preset("tests.models:tiny_factory", batch=4, seq=16)
    assert args[0].shape == (4, 16) and kwargs == {}
    assert isinstance(model, torch.nn.Module)


def test_unknown_name_lists_presets() -> None:
    with pytest.raises(ValueError) as info:
        build_preset("gpt5", batch=1, seq=1)
    assert all(name in str(info.value) for name in PRESETS)
    with pytest.raises(ValueError):
        build_preset("no.such.module:factory", batch=1, seq=1)


@pytest.mark.parametrize("name", ["gpt2-small-1l", "llama3-8b-1l"])
def test_meta_model_materializes_with_reset_parameters(name: str) -> None:
    # Same architecture at toy width so the test stays fast.
    config_model, _, _ = build_preset(name, batch=1, seq=8)

    small = {"n_embd": 64, "n_head": 4} if isinstance(config_model, GPT) else {}
    if isinstance(config_model, Llama):
        small = {"dim": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128, "vocab_size": 256}
    config = dataclasses.replace(config_model.config, **small)
    with torch.device("meta"):
        model = type(config_model)(config)
    model.to_empty(device="cpu")
    model.reset_parameters()
    idx = torch.randint(0, config.vocab_size, (2, 8))
    loss = model(idx, idx)
    assert torch.isfinite(loss)
    assert loss.item() == pytest.approx(
        torch.log(torch.tensor(float(config.vocab_size))).item(), rel=0.1
    )
