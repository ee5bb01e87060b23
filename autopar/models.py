"""Plain-PyTorch model zoo: an MLP, a GPT-2 style decoder and a LLaMA-3 style decoder.

Used by the presets, tests, examples and benchmarks. Every model returns the scalar mean loss
when targets are given (so one captured graph is a whole training step's forward) and its
logits otherwise. The layers are the textbook ones so Megatron-style tensor parallelism applies:
GPT has a fused qkv projection, LLaMA separate q/k/v projections with grouped-query attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------------------------
# MLP


@dataclass(frozen=True, kw_only=True, slots=True)
class MLPConfig:
    in_features: int
    """Width of the input x."""
    hidden: int
    """Width of every hidden layer."""
    out_features: int
    """Width of the output (and of the regression target y)."""
    num_layers: int = 2
    """Number of Linear layers (>= 1); GELU between consecutive ones."""
    bias: bool = True
    """Whether the Linear layers have biases."""


class MLP(nn.Module):
    """Linear -> GELU -> Linear ...; ``forward(x, y)`` returns the MSE loss against y."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        if config.num_layers < 1:
            raise ValueError(f"MLPConfig.num_layers must be >= 1, got {config.num_layers}")
        self.config = config
        widths = (
            [config.in_features] + [config.hidden] * (config.num_layers - 1) + [config.out_features]
        )
        self.layers = nn.ModuleList(
            nn.Linear(widths[i], widths[i + 1], bias=config.bias) for i in range(config.num_layers)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        if y is None:
            return x
        return F.mse_loss(x, y)


# --------------------------------------------------------------------------------------------
# GPT (GPT-2 shapes, nanoGPT layout)


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    vocab_size: int
    """Token vocabulary (pad to a multiple of 64 or 128 so tensor parallelism can split it)."""
    block_size: int
    """Maximum sequence length (size of the learned position embedding)."""
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block."""
    n_embd: int
    """Model width; divisible by n_head."""
    dropout: float = 0.0
    """Dropout probability (attention, residual and embedding)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers."""
    tie_weights: bool = True
    """Share the LM head's weight with the token embedding."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q = q.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, self.head_dim).transpose(1, 2)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return self.resid_dropout(self.proj(y))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 style decoder; ``forward(idx, targets=None)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        if not _on_meta(self):
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 initialization (also after ``to_empty`` when the model was built on meta)."""
        self.apply(_init_gpt_weights)
        # GPT-2's scaled init of the residual projections.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.block_size:
            raise ValueError(f"sequence length {seq} exceeds block_size {self.config.block_size}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def _init_gpt_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def _on_meta(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


# --------------------------------------------------------------------------------------------
# LLaMA (LLaMA-3 layout)


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    vocab_size: int
    """Token vocabulary."""
    dim: int
    """Model width; divisible by n_heads."""
    n_layers: int
    """Number of transformer layers."""
    n_heads: int
    """Query heads per layer."""
    n_kv_heads: int
    """Key/value heads per layer (grouped-query attention); divides n_heads."""
    ffn_hidden: int
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int
    """Length of the precomputed rotary tables."""
    rope_theta: float = 500000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    tie_weights: bool = False
    """Share the output projection's weight with the token embedding."""


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (written out so it exports to portable ops)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(
    head_dim: int, max_seq_len: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, each [max_seq_len, head_dim // 2], float32 on CPU."""
    # Explicit CPU so the values are real even under a ``with torch.device("meta")`` block.
    steps = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")
    inv_freq = 1.0 / (theta ** (steps / head_dim))
    positions = torch.arange(max_seq_len, dtype=torch.float32, device="cpu")
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x [batch, seq, heads, head_dim] by the angles (real arithmetic)."""
    batch, seq, heads, head_dim = x.shape
    pairs = x.float().reshape(batch, seq, heads, head_dim // 2, 2)
    x_even, x_odd = pairs[..., 0], pairs[..., 1]
    cos = cos.view(1, seq, 1, head_dim // 2)
    sin = sin.view(1, seq, 1, head_dim // 2)
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.reshape(batch, seq, heads, head_dim).type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.dim % config.n_heads != 0 or config.n_heads % config.n_kv_heads != 0:
            raise ValueError(
                f"LlamaConfig needs dim % n_heads == 0 and n_heads % n_kv_heads == 0, got dim "
                f"{config.dim}, n_heads {config.n_heads}, n_kv_heads {config.n_kv_heads}"
            )
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        repeats = self.n_heads // self.n_kv_heads
        if repeats > 1:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim)
        return self.wo(y)


class SwiGLU(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """LLaMA-3 style decoder; ``forward(idx, targets=None)``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_weights:
            self.output.weight = self.tok_embeddings.weight
        # The tables are computed on CPU and moved: on the meta device they cost nothing.
        head_dim = config.dim // config.n_heads
        device = self.tok_embeddings.weight.device
        cos, sin = rotary_tables(head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        if not _on_meta(self):
            self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize weights and recompute the rotary tables on the model's device.

        Call it after ``to_empty`` when the model was built on meta (the tables are
        non-persistent buffers, so they are not in a state_dict either).
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        config = self.config
        cos, sin = rotary_tables(
            config.dim // config.n_heads, config.max_seq_len, config.rope_theta
        )
        device = self.tok_embeddings.weight.device
        with torch.no_grad():
            self.rope_cos.copy_(cos.to(device))
            self.rope_sin.copy_(sin.to(device))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq} exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
