"""Llama-style decoder-only transformer (Llama 2/3 layout, torchtitan-like names).

RMSNorm pre-norm blocks, rotary position embeddings on q and k, grouped-query attention
(``n_kv_heads`` < ``n_heads``; kv heads are repeated to match), a SwiGLU feed-forward
(``w2(silu(w1(x)) * w3(x))``), bias-free linears and an untied output head.
``forward(idx, targets)`` returns the scalar cross-entropy loss.

Rotary tables are real-valued (cos/sin, "rotate half" form, no complex numbers) and kept as
non-persistent buffers, so the model exports with ``torch.export`` (non-strict), builds on the
meta device, and is easy to shard. After materialising a meta model (``to_empty``), call
``init_weights()`` to fill both parameters and rotary tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """Shape of a Llama model. ``n_heads`` must be a multiple of ``n_kv_heads``."""

    vocab_size: int
    max_seq_len: int
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0  # Llama 3 value (Llama 2 used 10000)

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} not a multiple of n_kv={self.n_kv_heads}")
        if (self.dim // self.n_heads) % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def named(cls, name: str) -> LlamaConfig:
        """Return one of the named configurations in ``LLAMA_CONFIGS``."""
        try:
            return LLAMA_CONFIGS[name]
        except KeyError:
            raise KeyError(
                f"unknown Llama config {name!r}; known: {sorted(LLAMA_CONFIGS)}"
            ) from None

    @classmethod
    def tiny(cls) -> LlamaConfig:
        return LLAMA_CONFIGS["tiny"]

    @classmethod
    def llama3_8b(cls) -> LlamaConfig:
        return LLAMA_CONFIGS["llama3-8b"]

    @classmethod
    def llama3_70b(cls) -> LlamaConfig:
        return LLAMA_CONFIGS["llama3-70b"]


_LLAMA3_VOCAB = 128256
# fields: vocab_size, max_seq_len, n_layers, dim, n_heads, n_kv_heads, ffn_hidden_dim
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(128, 16, 2, 32, 4, 2, 64),
    "tiny4": LlamaConfig(128, 16, 4, 32, 4, 2, 64),
    # GPT small's size (~0.1-0.5 s a step on CPU processes: benchmarks/bench_costmodel.py)
    "small": LlamaConfig(512, 128, 4, 256, 4, 2, 704),
    "llama3-8b": LlamaConfig(_LLAMA3_VOCAB, 8192, 32, 4096, 32, 8, 14336),
    "llama3-70b": LlamaConfig(_LLAMA3_VOCAB, 8192, 80, 8192, 64, 8, 28672),
}
# the config names `build` accepts (the model protocol of `autopar.cli.sources`)
CONFIGS = tuple(LLAMA_CONFIGS)


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``x / sqrt(mean(x**2) + eps) * weight`` (computed in fp32)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """Rotary cos/sin tables of shape (seq_len, head_dim), fp32, on the current device."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x of shape (B, H, T, head_dim) by position; cos/sin are (T, head_dim)."""
    return (x * cos + _rotate_half(x) * sin).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal attention with rotary embeddings and no biases."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def _repeat_kv(self, x: Tensor) -> Tensor:
        """(B, T, n_kv, D) -> (B, T, n_heads, D): each kv head serves n_heads/n_kv q heads."""
        n_rep = self.n_heads // self.n_kv_heads
        if n_rep == 1:
            return x
        B, T, n_kv, D = x.shape
        return x[:, :, :, None, :].expand(B, T, n_kv, n_rep, D).reshape(B, T, n_kv * n_rep, D)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim)
        k, v = self._repeat_kv(k), self._repeat_kv(v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + feed_forward(norm(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Llama language model; ``forward(idx, targets)`` returns the mean cross-entropy loss."""

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic init from the global RNG, and (re)computed rotary tables.

        Linears and the embedding get N(0, 0.02); residual output projections (``wo``, ``w2``)
        get 0.02 / sqrt(2 * n_layers); norms get ones. Order = registration order.
        """
        if not self.rope_cos.is_meta:
            cos, sin = rope_tables(
                self.config.head_dim, self.config.max_seq_len, self.config.rope_theta
            )
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)
        proj_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = proj_std if name.endswith(("wo", "w2")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        T = idx.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _config_of(model_or_config: nn.Module | LlamaConfig | str) -> LlamaConfig:
    if isinstance(model_or_config, str):
        return LlamaConfig.named(model_or_config)
    if isinstance(model_or_config, LlamaConfig):
        return model_or_config
    config = getattr(model_or_config, "config", None)
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"expected a Llama, LlamaConfig or name, got {type(model_or_config)}")
    return config


def build(config_name: str = "tiny", device: torch.device | str | None = None) -> Llama:
    """Build a seeded-deterministic Llama; ``device="meta"`` allocates no storage."""
    config = LlamaConfig.named(config_name)
    if device is None:
        return Llama(config)
    with torch.device(device):
        return Llama(config)


def example_batch(
    model_or_config: nn.Module | LlamaConfig | str,
    batch_size: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Global batch ``(idx, targets)`` of shape (batch_size, max_seq_len), int64.

    Drawn on CPU from a private generator seeded with ``seed`` (identical on every rank and
    device; the global RNG is untouched); targets are idx shifted left by one token.
    """
    config = _config_of(model_or_config)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(
        0, config.vocab_size, (batch_size, config.max_seq_len + 1), generator=gen
    )
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if device is not None:
        idx, targets = idx.to(device), targets.to(device)
    return idx, targets
