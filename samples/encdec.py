"""An encoder-decoder Transformer (T5/BART-like) for sequence-to-sequence training.

A shared token embedding, learned positions, pre-norm encoder blocks (bidirectional
self-attention, GELU MLP), pre-norm decoder blocks (causal self-attention, cross-attention
to the encoder's output, GELU MLP), final LayerNorms and a language-model head tied to the
embedding; ``forward(src, tgt_in, tgt_out)`` returns the cross-entropy of the next target
token. Attention goes through ``scaled_dot_product_attention`` (the cross-attention with
queries from the decoder and keys/values from the encoder, of another length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class EncDecConfig:
    vocab_size: int
    dim: int
    n_head: int
    n_encoder: int
    n_decoder: int
    src_len: int
    tgt_len: int

    def __post_init__(self) -> None:
        if self.dim % self.n_head:
            raise ValueError("dim % n_head must be 0")


ENCDEC_CONFIGS: dict[str, EncDecConfig] = {
    "tiny": EncDecConfig(
        vocab_size=64, dim=16, n_head=2, n_encoder=2, n_decoder=2, src_len=8, tgt_len=4
    ),
    # T5-base-like widths, ~220M parameters
    "base": EncDecConfig(
        vocab_size=32128, dim=768, n_head=12, n_encoder=12, n_decoder=12, src_len=512, tgt_len=128
    ),
}
CONFIGS = tuple(ENCDEC_CONFIGS)


class Attention(nn.Module):
    """Multi-head attention of ``x`` over ``memory`` (``x`` itself for self-attention)."""

    def __init__(self, c: EncDecConfig, causal: bool = False) -> None:
        super().__init__()
        self.n_head, self.causal = c.n_head, causal
        # no biases, as T5 (a key bias has an exactly zero gradient anyway)
        self.q = nn.Linear(c.dim, c.dim, bias=False)
        self.kv = nn.Linear(c.dim, 2 * c.dim, bias=False)
        self.proj = nn.Linear(c.dim, c.dim, bias=False)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        b, t, d = x.shape
        s = memory.shape[1]
        h = self.n_head
        q = self.q(x).view(b, t, h, d // h).transpose(1, 2)
        k, v = (z.view(b, s, h, d // h).transpose(1, 2) for z in self.kv(memory).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, c: EncDecConfig) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class EncoderBlock(nn.Module):
    def __init__(self, c: EncDecConfig) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.attn, self.mlp = Attention(c), MLP(c)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h)
        return x + self.mlp(self.ln2(x))


class DecoderBlock(nn.Module):
    def __init__(self, c: EncDecConfig) -> None:
        super().__init__()
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(c.dim) for _ in range(3))
        self.self_attn, self.cross_attn = Attention(c, causal=True), Attention(c)
        self.mlp = MLP(c)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:
        h = self.ln1(x)
        x = x + self.self_attn(h, h)
        x = x + self.cross_attn(self.ln2(x), memory)
        return x + self.mlp(self.ln3(x))


class EncoderDecoder(nn.Module):
    def __init__(self, config: EncDecConfig) -> None:
        super().__init__()
        self.config = c = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.src_pos = nn.Embedding(c.src_len, c.dim)
        self.tgt_pos = nn.Embedding(c.tgt_len, c.dim)
        self.encoder = nn.ModuleList(EncoderBlock(c) for _ in range(c.n_encoder))
        self.decoder = nn.ModuleList(DecoderBlock(c) for _ in range(c.n_decoder))
        self.ln_enc, self.ln_dec = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.head.weight = self.embed.weight  # tied, as T5 and BART

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> Tensor:
        pos_s = torch.arange(src.shape[1], device=src.device)
        pos_t = torch.arange(tgt_in.shape[1], device=tgt_in.device)
        memory = self.embed(src) + self.src_pos(pos_s)
        for block in self.encoder:
            memory = block(memory)
        memory = self.ln_enc(memory)
        x = self.embed(tgt_in) + self.tgt_pos(pos_t)
        for block in self.decoder:
            x = block(x, memory)
        logits = self.head(self.ln_dec(x))
        return F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten())


def build(config_name: str = "tiny", device: torch.device | str | None = None) -> EncoderDecoder:
    """An encoder-decoder with weights from the global RNG."""
    config = ENCDEC_CONFIGS[config_name]
    if device is None:
        return EncoderDecoder(config)
    with torch.device(device):
        return EncoderDecoder(config)


def example_batch(
    model_or_config: nn.Module | EncDecConfig | str,
    batch_size: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Global batch ``(src [B, S], tgt_in [B, T], tgt_out [B, T])``: random source tokens,
    the target a shifted copy (``tgt_out[:, i] = tgt_in[:, i + 1]``)."""
    c = _config_of(model_or_config)
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, c.vocab_size, (batch_size, c.src_len), generator=gen)
    tgt = torch.randint(0, c.vocab_size, (batch_size, c.tgt_len + 1), generator=gen)
    batch = (src, tgt[:, :-1].contiguous(), tgt[:, 1:].contiguous())
    if device is not None:
        batch = tuple(t.to(device) for t in batch)
    return batch  # type: ignore[return-value]


def _config_of(model_or_config: nn.Module | EncDecConfig | str) -> EncDecConfig:
    if isinstance(model_or_config, str):
        return ENCDEC_CONFIGS[model_or_config]
    if isinstance(model_or_config, EncDecConfig):
        return model_or_config
    return model_or_config.config  # type: ignore[return-value]
