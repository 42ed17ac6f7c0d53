"""GPT-2-style decoder-only transformer (nanoGPT layout).

Token + learned positional embeddings, pre-LayerNorm blocks with a fused qkv projection and
causal ``scaled_dot_product_attention``, a GELU MLP, a final LayerNorm, and an LM head whose
weight is tied to the token embedding. ``forward(idx, targets)`` returns the scalar
cross-entropy loss, so the whole training step is one exportable graph.

There is no dropout: the samples must be deterministic so that eager and exported / parallel
runs can be compared bit for bit (up to reduction order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """Shape of a GPT model. ``n_embd`` must be divisible by ``n_head``."""

    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    bias: bool = True
    gelu_approximate: str = "tanh"  # GPT-2 used the tanh approximation; "none" = exact erf
    layer_norm_eps: float = 1e-5
    tie_embeddings: bool = True  # lm_head shares wte's weight (GPT-2); Megatron unties them
    dtype: str = "float32"  # parameter dtype; "bfloat16" for the Megatron-scale configs
    # the cross-entropy on float32 logits (Megatron-Core's casts its logits so:
    # `VocabParallelCrossEntropy.calculate_logits_max`), whatever the parameters' dtype
    loss_in_fp32: bool = False

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} not divisible by n_head={self.n_head}")

    @classmethod
    def named(cls, name: str) -> GPTConfig:
        """Return one of the named configurations in ``GPT_CONFIGS``."""
        try:
            return GPT_CONFIGS[name]
        except KeyError:
            raise KeyError(f"unknown GPT config {name!r}; known: {sorted(GPT_CONFIGS)}") from None

    @classmethod
    def tiny(cls) -> GPTConfig:
        return GPT_CONFIGS["tiny"]

    @classmethod
    def gpt2_124m(cls) -> GPTConfig:
        return GPT_CONFIGS["gpt2-124m"]

    @classmethod
    def gpt2_1_5b(cls) -> GPTConfig:
        return GPT_CONFIGS["gpt2-1.5b"]


# GPT-2's real vocabulary is 50257 tokens; like nanoGPT we pad it to 50304 (a multiple of 64,
# and of 2/4/8/16 so the vocab dim can be sharded evenly). The extra rows are never targets.
GPT2_PADDED_VOCAB = 50304

GPT_CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=4, n_embd=32),
    "tiny4": GPTConfig(vocab_size=128, block_size=16, n_layer=4, n_head=4, n_embd=32),
    # big enough that parallelizing pays off on this CPU box's gloo cost model (the demo)
    "small": GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=256),
    "gpt2-124m": GPTConfig(
        vocab_size=GPT2_PADDED_VOCAB, block_size=1024, n_layer=12, n_head=12, n_embd=768
    ),
    "gpt2-1.5b": GPTConfig(
        vocab_size=GPT2_PADDED_VOCAB, block_size=1024, n_layer=48, n_head=25, n_embd=1600
    ),
}

# Megatron-Core's H100 weak-scaling models (seq 4096, vocab 131072, untied head, bf16):
# name -> (hidden, layers, heads). Planning-only (meta device): see
# benchmarks/megatron_weak_scaling.py.
MEGATRON_SHAPES: dict[str, tuple[int, int, int]] = {
    "1.7b": (2048, 24, 16),
    "7.1b": (4096, 30, 32),
    "16b": (6144, 32, 48),
    "32b": (7168, 48, 56),
    "70b": (8192, 84, 64),
    "177b": (12288, 96, 96),
    "462b": (18432, 112, 144),
}
GPT_CONFIGS.update(
    {
        f"megatron-{size}": GPTConfig(
            vocab_size=131072,
            block_size=4096,
            n_layer=layers,
            n_head=heads,
            n_embd=hidden,
            bias=False,
            tie_embeddings=False,
            dtype="bfloat16",
            loss_in_fp32=True,
        )
        for size, (hidden, layers, heads) in MEGATRON_SHAPES.items()
    }
)
# the config names `build` accepts (the model protocol of `autopar.cli.sources`)
CONFIGS = tuple(GPT_CONFIGS)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> GELU -> Linear(4C, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 language model; ``forward(idx, targets)`` returns the mean cross-entropy loss."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # weight tying: one Parameter, two uses
        self.init_weights()
        self.to(getattr(torch, config.dtype))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic GPT-2 init from the global RNG: N(0, 0.02), zero biases, unit norms.

        Residual output projections get std 0.02 / sqrt(2 * n_layer) as in GPT-2. Modules are
        visited in registration order, so a fixed seed always yields the same weights.
        """
        proj_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.lm_head and self.config.tie_embeddings:
                    continue  # tied to wte, initialised there
                std = proj_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        logits = self.logits(idx)
        if self.config.loss_in_fp32:
            logits = logits.float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))

    def logits(self, idx: Tensor) -> Tensor:
        _, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _config_of(model_or_config: nn.Module | GPTConfig | str) -> GPTConfig:
    if isinstance(model_or_config, str):
        return GPTConfig.named(model_or_config)
    if isinstance(model_or_config, GPTConfig):
        return model_or_config
    config = getattr(model_or_config, "config", None)
    if not isinstance(config, GPTConfig):
        raise TypeError(f"expected a GPT, GPTConfig or config name, got {type(model_or_config)}")
    return config


def build(config_name: str = "tiny", device: torch.device | str | None = None) -> GPT:
    """Build a seeded-deterministic GPT; ``device="meta"`` allocates no storage."""
    config = GPTConfig.named(config_name)
    if device is None:
        return GPT(config)
    with torch.device(device):
        return GPT(config)


def example_batch(
    model_or_config: nn.Module | GPTConfig | str,
    batch_size: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Global batch ``(idx, targets)`` of shape (batch_size, block_size), int64.

    Tokens are drawn on CPU from a private generator (the global RNG is untouched), so the
    batch is identical for a given seed on every rank and device; targets are idx shifted by 1.
    """
    config = _config_of(model_or_config)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.block_size + 1), generator=gen)
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if device is not None:
        idx, targets = idx.to(device), targets.to(device)
    return idx, targets
