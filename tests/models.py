"""The test model zoo: tiny versions of every supported model family, real CPU fp32 tensors.

Every builder returns ``(model, args, kwargs)`` with a fixed seed. Shapes: 2 layers, width 64,
4 heads (LLaMA: 2 KV heads), vocab 128, sequence 16, batch 8 -- every dim divisible by 8 so
meshes of 2, 4 and 8 devices can split them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from autopar.models import GPT, MLP, GPTConfig, Llama, LlamaConfig, MLPConfig

BATCH = 8
SEQ = 16
VOCAB = 128
WIDTH = 64
HEADS = 4
KV_HEADS = 2
LAYERS = 2

Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def _tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return idx, targets


def tiny_mlp() -> Built:
    torch.manual_seed(0)
    model = MLP(MLPConfig(in_features=WIDTH, hidden=4 * WIDTH, out_features=WIDTH))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTH, generator=generator)
    y = torch.randn(BATCH, WIDTH, generator=generator)
    return model, (x, y), {}


def tiny_gpt(dropout: float = 0.0, layers: int = LAYERS) -> Built:
    torch.manual_seed(0)
    config = GPTConfig(
        vocab_size=VOCAB,
        block_size=SEQ,
        n_layer=layers,
        n_head=HEADS,
        n_embd=WIDTH,
        dropout=dropout,
    )
    return GPT(config), _tokens(1), {}


def tiny_llama(layers: int = LAYERS) -> Built:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        dim=WIDTH,
        n_layers=layers,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        ffn_hidden=2 * WIDTH,
        max_seq_len=SEQ,
    )
    return Llama(config), _tokens(1), {}


def _hf_model(model_type: str, **overrides: Any) -> nn.Module:
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def hf_gpt2() -> Built:
    model = _hf_model(
        "gpt2",
        n_layer=LAYERS,
        n_embd=WIDTH,
        n_head=HEADS,
        n_positions=SEQ,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        # No dropout: train-mode captures then match eager outputs exactly.
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    idx, targets = _tokens(1)
    return model, (), {"input_ids": idx, "labels": targets, "use_cache": False}


def hf_llama() -> Built:
    model = _hf_model(
        "llama",
        num_hidden_layers=LAYERS,
        hidden_size=WIDTH,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=2 * WIDTH,
        max_position_embeddings=SEQ,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    idx, targets = _tokens(1)
    return model, (), {"input_ids": idx, "labels": targets, "use_cache": False}


ALL_MODELS: dict[str, Callable[[], Built]] = {
    "tiny_mlp": tiny_mlp,
    "tiny_gpt": tiny_gpt,
    "tiny_llama": tiny_llama,
    "hf_gpt2": hf_gpt2,
    "hf_llama": hf_llama,
}


def tiny_factory(batch: int, seq: int) -> tuple[nn.Module, tuple[Any, ...]]:
    """A ``package.module:factory`` for preset tests: tiny GPT with the requested input shape."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, block_size=seq, n_layer=1, n_head=HEADS, n_embd=WIDTH)
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (batch, seq), generator=generator)
    return GPT(config), (idx, idx)
