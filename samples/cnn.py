"""A ResNet-style convolutional classifier with BatchNorm.

Stem ``conv -> BatchNorm2d -> ReLU``, then ``blocks`` (basic residual blocks: ``conv -> BN ->
ReLU -> conv -> BN``, plus the input, ReLU; a block that changes width or stride has a 1x1
``conv -> BN`` shortcut), global average pooling and a linear head; ``forward(images,
labels)`` returns the cross-entropy loss. BatchNorm in training mode updates its running
statistics and batch counter: buffers the forward mutates, which a parallel run must keep
exactly as one device does (global-batch statistics, as SyncBatchNorm).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class CNNConfig:
    """``widths[i]`` channels in stage ``i`` (one block each, stride 2 after the first)."""

    image_size: int
    in_channels: int
    widths: tuple[int, ...]
    num_classes: int


CNN_CONFIGS: dict[str, CNNConfig] = {
    "tiny": CNNConfig(image_size=8, in_channels=3, widths=(8, 8, 16), num_classes=8),
    # ResNet-18-like width on 64x64 images (one block per stage), ~5M parameters
    "small": CNNConfig(image_size=64, in_channels=3, widths=(64, 128, 256, 512), num_classes=100),
}
CONFIGS = tuple(CNN_CONFIGS)


class BasicBlock(nn.Module):
    """``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class CNN(nn.Module):
    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        self.config = config
        w = config.widths
        self.stem = nn.Sequential(
            nn.Conv2d(config.in_channels, w[0], 3, 1, 1, bias=False), nn.BatchNorm2d(w[0])
        )
        self.blocks = nn.ModuleList(
            BasicBlock(w[max(i - 1, 0)], w[i], 1 if i == 0 else 2) for i in range(len(w))
        )
        self.head = nn.Linear(w[-1], config.num_classes)

    def forward(self, images: Tensor, labels: Tensor) -> Tensor:
        x = F.relu(self.stem(images))
        for block in self.blocks:
            x = block(x)
        logits = self.head(x.mean(dim=(2, 3)))
        return F.cross_entropy(logits, labels)


def build(config_name: str = "tiny", device: torch.device | str | None = None) -> CNN:
    """A CNN with weights from the global RNG (torch's default init)."""
    config = CNN_CONFIGS[config_name]
    if device is None:
        return CNN(config)
    with torch.device(device):
        return CNN(config)


def example_batch(
    model_or_config: nn.Module | CNNConfig | str,
    batch_size: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Global batch ``(images [B, C, H, W], labels [B])`` from a private generator."""
    config = _config_of(model_or_config)
    gen = torch.Generator().manual_seed(seed)
    size = config.image_size
    images = torch.randn(batch_size, config.in_channels, size, size, generator=gen)
    labels = torch.randint(0, config.num_classes, (batch_size,), generator=gen)
    if device is not None:
        images, labels = images.to(device), labels.to(device)
    return images, labels


def _config_of(model_or_config: nn.Module | CNNConfig | str) -> CNNConfig:
    if isinstance(model_or_config, str):
        return CNN_CONFIGS[model_or_config]
    if isinstance(model_or_config, CNNConfig):
        return model_or_config
    return model_or_config.config  # type: ignore[return-value]
