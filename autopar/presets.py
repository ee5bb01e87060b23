"""Built-in models by name: the zoo on public shapes, Hugging Face configs, user factories.

``build_preset(name, batch=..., seq=...)`` returns ``(model, example_args, example_kwargs)``
with GLOBAL-batch example inputs on the model's device. Names:

* ``mlp``, ``gpt2-small``, ``gpt2-xl``, ``llama3-8b``, ``llama3-70b``, ``llama-8l-2048`` (see
  PRESETS), each with an optional ``-Nl`` suffix for an N-layer variant (``llama3-8b-2l``);
* ``hf:<model_type>[?key=value&...]``: ``transformers.AutoConfig.for_model(model_type,
  **overrides)`` + ``AutoModelForCausalLM.from_config`` (offline, random weights; the real
  architecture's shapes unless overridden);
* ``package.module:factory``: ``factory(batch, seq)`` returning ``(model, args)`` or
  ``(model, args, kwargs)``.

Built-in presets default to the meta device: a 70B model builds in well under a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn

from autopar.models import GPT, MLP, GPTConfig, Llama, LlamaConfig, MLPConfig

# GPT-2's vocabulary 50257 padded to a multiple of 128 (as nanoGPT does) so it splits evenly.
GPT2_VOCAB = 50304
LLAMA3_VOCAB = 128256

MLP_CONFIG = MLPConfig(in_features=1024, hidden=8192, out_features=1024, num_layers=2)
GPT_CONFIGS: dict[str, GPTConfig] = {
    "gpt2-small": GPTConfig(
        vocab_size=GPT2_VOCAB, block_size=1024, n_layer=12, n_head=12, n_embd=768
    ),
    "gpt2-xl": GPTConfig(
        vocab_size=GPT2_VOCAB, block_size=1024, n_layer=48, n_head=25, n_embd=1600
    ),
}
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "llama3-8b": LlamaConfig(
        vocab_size=LLAMA3_VOCAB,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama3-70b": LlamaConfig(
        vocab_size=LLAMA3_VOCAB,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_hidden=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    # An 8-layer LLaMA-like model at TinyLlama's width (grouped-query attention, tied
    # embeddings): the budget-bound planning-time row of benchmarks/plan_time.py.
    "llama-8l-2048": LlamaConfig(
        vocab_size=32000,
        dim=2048,
        n_layers=8,
        n_heads=32,
        n_kv_heads=4,
        ffn_hidden=5632,
        max_seq_len=2048,
        rope_theta=10000.0,
        tie_weights=True,
    ),
}
PRESETS: tuple[str, ...] = ("mlp", *GPT_CONFIGS, *LLAMA_CONFIGS)
SPLICE_PROVEN: tuple[str, ...] = (*GPT_CONFIGS, *LLAMA_CONFIGS)
"""Presets whose replicated capture (``autopar.capture.layer_replication``) a CI test proves
equal to a real export at several depths (tests/planner/test_layer_replication.py runs every
name here), so ``autopar plan`` captures them without the run-time check export."""

_LAYER_SUFFIX = re.compile(r"^(?P<base>.+)-(?P<layers>\d+)l$")

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def build_preset(name: str, *, batch: int, seq: int, device: str | torch.device = "meta") -> Built:
    """Build a model and global-batch example inputs by name (see the module docstring).

    Args:
        name: a preset (optionally ``-Nl``), ``hf:<model_type>[?k=v&...]`` or ``pkg.mod:factory``.
        batch, seq: global batch size and sequence length of the example inputs (``seq`` is
            ignored by ``mlp``).
        device: where parameters and inputs live; "meta" allocates nothing. Ignored for
            factories, which choose their own device.

    Raises:
        ValueError: unknown name, bad ``-Nl`` suffix, or bad ``hf:`` override.
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    if name.startswith("hf:"):
        return _build_hf(name[3:], batch=batch, seq=seq, device=torch.device(device))
    if ":" in name:
        return _build_factory(name, batch=batch, seq=seq)
    base, num_layers = _split_layers(name)
    device = torch.device(device)
    if base == "mlp":
        config = (
            MLP_CONFIG
            if num_layers is None
            else dataclasses.replace(MLP_CONFIG, num_layers=num_layers)
        )
        with device:
            model: nn.Module = MLP(config)
            x = torch.randn(batch, config.in_features)
            y = torch.randn(batch, config.out_features)
        return model, (x, y), {}
    if base in GPT_CONFIGS:
        gpt = (
            GPT_CONFIGS[base]
            if num_layers is None
            else dataclasses.replace(GPT_CONFIGS[base], n_layer=num_layers)
        )
        if seq > gpt.block_size:
            raise ValueError(f"{name}: seq {seq} exceeds block_size {gpt.block_size}")
        with device:
            model = GPT(gpt)
        return model, _token_inputs(gpt.vocab_size, batch, seq, device), {}
    if base in LLAMA_CONFIGS:
        llama = LLAMA_CONFIGS[base]
        if num_layers is not None:
            llama = dataclasses.replace(llama, n_layers=num_layers)
        if seq > llama.max_seq_len:
            llama = dataclasses.replace(llama, max_seq_len=seq)
        with device:
            model = Llama(llama)
        return model, _token_inputs(llama.vocab_size, batch, seq, device), {}
    raise ValueError(
        f"unknown model {name!r}: use one of {', '.join(PRESETS)} (optionally with an -Nl suffix, "
        "e.g. llama3-8b-2l), hf:<model_type>[?key=value&...] (e.g. hf:gpt2, "
        "hf:llama?num_hidden_layers=2), or package.module:factory"
    )


def splice_proven(name: str) -> bool:
    """Whether ``name`` (as ``build_preset`` takes it) builds a preset of ``SPLICE_PROVEN``."""
    return _split_layers(name)[0] in SPLICE_PROVEN


def _split_layers(name: str) -> tuple[str, int | None]:
    match = _LAYER_SUFFIX.match(name)
    if match is None or match.group("base") not in PRESETS:
        return name, None
    num_layers = int(match.group("layers"))
    if num_layers < 1:
        raise ValueError(f"{name}: the -Nl suffix needs N >= 1")
    return match.group("base"), num_layers


def _token_inputs(
    vocab_size: int, batch: int, seq: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    # Fixed seed so two builds of one preset on real devices see the same tokens.
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, vocab_size, (batch, seq), generator=generator).to(device)
    targets = torch.randint(0, vocab_size, (batch, seq), generator=generator).to(device)
    return idx, targets


# --------------------------------------------------------------------------------------------
# Hugging Face


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_hf_name(spec: str) -> tuple[str, dict[str, Any]]:
    """``"llama?num_hidden_layers=2&hidden_size=64"`` -> ``("llama", {...})`` (values typed)."""
    model_type, _, query = spec.partition("?")
    if not model_type:
        raise ValueError("hf: needs a model type, e.g. hf:gpt2 or hf:llama?num_hidden_layers=2")
    overrides: dict[str, Any] = {}
    for item in filter(None, query.split("&")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"hf:{spec}: override {item!r} is not key=value")
        overrides[key] = _parse_value(value)
    return model_type, overrides


def _build_hf(spec: str, *, batch: int, seq: int, device: torch.device) -> Built:
    try:
        import transformers
    except ImportError as error:
        raise ValueError("hf: models need transformers (pip install 'autopar[hf]')") from error
    model_type, overrides = parse_hf_name(spec)
    config = _hf_config(transformers, spec, model_type, overrides)
    # SDPA keeps attention one op (aten.scaled_dot_product_attention) in the captured graph.
    config._attn_implementation = "sdpa"
    for key in ("n_positions", "max_position_embeddings"):
        limit = getattr(config, key, None)
        if isinstance(limit, int) and seq > limit:
            raise ValueError(f"hf:{spec}: seq {seq} exceeds {key}={limit}; pass ?{key}={seq}")
    with _quiet_transformers(transformers), device:
        model = transformers.AutoModelForCausalLM.from_config(config)
    if getattr(model, "loss_type", None) is None:
        # What transformers falls back to anyway, said here so it does not warn at capture.
        model.loss_type = "ForCausalLM"
    vocab_size = int(config.vocab_size)
    idx, labels = _token_inputs(vocab_size, batch, seq, device)
    return model, (), {"input_ids": idx, "labels": labels, "use_cache": False}


def _hf_config(transformers: Any, spec: str, model_type: str, overrides: dict[str, Any]) -> Any:
    """``AutoConfig.for_model(model_type, **overrides)`` with one-line errors for an unknown
    model type, an unknown key (a typo would otherwise be ignored) and a bad value."""
    known_types = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known_types:
        close = difflib.get_close_matches(model_type, known_types, n=5)
        did_you_mean = f"did you mean {', '.join(close)}? " if close else "none is close; "
        raise ValueError(
            f"hf:{spec}: unknown model type {model_type!r}; {did_you_mean}{len(known_types)} "
            "types are known (transformers.CONFIG_MAPPING.keys())"
        )
    with _quiet_transformers(transformers):
        default = transformers.AutoConfig.for_model(model_type)
    known_keys = {*default.to_dict(), *getattr(default, "attribute_map", {})}
    for key in overrides:
        if key not in known_keys and not hasattr(default, key):
            close = difflib.get_close_matches(key, sorted(known_keys), n=3)
            did_you_mean = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"hf:{spec}: {model_type} configs have no key {key!r}{did_you_mean}")
    try:
        with _quiet_transformers(transformers):
            return transformers.AutoConfig.for_model(model_type, **overrides)
    except Exception as error:  # transformers raises ValueError, TypeError or its own
        reason = " ".join(str(error).split())
        raise ValueError(f"hf:{spec}: bad override value ({reason})") from None


@contextlib.contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    """transformers' logging (e.g. BERT's "add is_decoder=True" advice) and Python warnings
    silenced while a model is built from a config; the previous verbosity comes back."""
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)


# --------------------------------------------------------------------------------------------
# User factories


def _build_factory(name: str, *, batch: int, seq: int) -> Built:
    module_name, _, attr = name.partition(":")
    # A factory module next to the user (``autopar plan mymodels:build`` beside mymodels.py)
    # imports without PYTHONPATH=.; the working directory is on the path only meanwhile.
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        try:
            factory: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as error:
            raise ValueError(
                f"cannot load factory {name!r} ({error}); expected package.module:function with "
                "function(batch: int, seq: int) -> (model, args) or (model, args, kwargs), "
                "importable from the working directory or PYTHONPATH"
            ) from None
        result = factory(batch, seq)
    finally:
        if added:
            sys.path.remove(cwd)
    if (
        not isinstance(result, tuple)
        or len(result) not in (2, 3)
        or not isinstance(result[0], nn.Module)
    ):
        raise ValueError(
            f"factory {name!r} must return (model, args) or (model, args, kwargs), got {type(result).__name__}"
        )
    model, args = result[0], tuple(result[1])
    kwargs = dict(result[2]) if len(result) == 3 else {}
    return model, args, kwargs
