"""A Vision Transformer classifier (ViT).

Patch embedding as a strided convolution (``kernel = stride = patch``), a learned position
embedding, pre-norm encoder blocks (multi-head self-attention through
``scaled_dot_product_attention``, GELU MLP), a final LayerNorm, global average pooling over
the patches (no class token, as in later ViT variants) and a linear head;
``forward(images, labels)`` returns the cross-entropy loss. No dropout (samples are
deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class ViTConfig:
    image_size: int
    patch: int
    in_channels: int
    dim: int
    n_head: int
    n_layer: int
    num_classes: int

    def __post_init__(self) -> None:
        if self.image_size % self.patch or self.dim % self.n_head:
            raise ValueError("image_size % patch and dim % n_head must be 0")

    @property
    def tokens(self) -> int:
        return (self.image_size // self.patch) ** 2


VIT_CONFIGS: dict[str, ViTConfig] = {
    "tiny": ViTConfig(
        image_size=8, patch=4, in_channels=3, dim=16, n_head=2, n_layer=2, num_classes=8
    ),
    # ViT-B/16 on 224x224 images, ~86M parameters
    "base": ViTConfig(
        image_size=224, patch=16, in_channels=3, dim=768, n_head=12, n_layer=12, num_classes=1000
    ),
}
CONFIGS = tuple(VIT_CONFIGS)


class Block(nn.Module):
    """``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, c: ViTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln1, self.ln2 = nn.LayerNorm(c.dim), nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)
        self.fc1, self.fc2 = nn.Linear(c.dim, 4 * c.dim), nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = c = config
        self.patch_embed = nn.Conv2d(c.in_channels, c.dim, c.patch, c.patch)
        self.pos_embed = nn.Parameter(torch.randn(1, c.tokens, c.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.num_classes)

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # [B, patches, dim]
        x = x + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.ln_f(x).mean(dim=1)), labels)


def build(config_name: str = "tiny", device: torch.device | str | None = None) -> ViT:
    """A ViT with weights from the global RNG."""
    config = VIT_CONFIGS[config_name]
    if device is None:
        return ViT(config)
    with torch.device(device):
        return ViT(config)


def example_batch(
    model_or_config: nn.Module | ViTConfig | str,
    batch_size: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Global batch ``(images [B, C, H, W], labels [B])`` from a private generator."""
    c = _config_of(model_or_config)
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch_size, c.in_channels, c.image_size, c.image_size, generator=gen)
    labels = torch.randint(0, c.num_classes, (batch_size,), generator=gen)
    if device is not None:
        images, labels = images.to(device), labels.to(device)
    return images, labels


def _config_of(model_or_config: nn.Module | ViTConfig | str) -> ViTConfig:
    if isinstance(model_or_config, str):
        return VIT_CONFIGS[model_or_config]
    if isinstance(model_or_config, ViTConfig):
        return model_or_config
    return model_or_config.config  # type: ignore[return-value]
