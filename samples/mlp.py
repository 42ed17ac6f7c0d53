"""A plain multi-layer perceptron regression model.

``Linear -> GELU`` hidden layers followed by a linear output layer; ``forward(x, y)`` returns
the mean-squared-error loss. The smallest sample: useful to test data parallelism, ZeRO and
Megatron-style column/row tensor parallelism without attention in the way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class MLPConfig:
    """``n_hidden_layers`` hidden layers of width ``hidden_dim`` between in and out."""

    in_dim: int
    hidden_dim: int
    out_dim: int
    n_hidden_layers: int
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_hidden_layers < 1:
            raise ValueError("need at least one hidden layer")

    @classmethod
    def named(cls, name: str) -> MLPConfig:
        """Return one of the named configurations in ``MLP_CONFIGS``."""
        try:
            return MLP_CONFIGS[name]
        except KeyError:
            raise KeyError(f"unknown MLP config {name!r}; known: {sorted(MLP_CONFIGS)}") from None

    @classmethod
    def tiny(cls) -> MLPConfig:
        return MLP_CONFIGS["tiny"]

    @classmethod
    def large(cls) -> MLPConfig:
        return MLP_CONFIGS["large"]


MLP_CONFIGS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(in_dim=32, hidden_dim=64, out_dim=32, n_hidden_layers=2),
    # ~10M parameters (~0.1-0.5 s a step on CPU processes: benchmarks/bench_costmodel.py)
    "medium": MLPConfig(in_dim=512, hidden_dim=2048, out_dim=512, n_hidden_layers=3),
    # ~218M parameters: 1024 -> 8192 -> 8192 -> 8192 -> 8192 -> 1024
    "large": MLPConfig(in_dim=1024, hidden_dim=8192, out_dim=1024, n_hidden_layers=4),
}
# the config names `build` accepts (the model protocol of `autopar.cli.sources`)
CONFIGS = tuple(MLP_CONFIGS)


class MLP(nn.Module):
    """``layers[i]`` are Linear layers; GELU after every one but the last. Loss = MSE."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        dims = [config.in_dim] + [config.hidden_dim] * config.n_hidden_layers + [config.out_dim]
        self.layers = nn.ModuleList(
            nn.Linear(dims[i], dims[i + 1], bias=config.bias) for i in range(len(dims) - 1)
        )
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic init from the global RNG: weights N(0, 0.02), zero biases."""
        for layer in self.layers:
            nn.init.normal_(layer.weight, mean=0.0, std=0.02)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return F.mse_loss(x, y)


def _config_of(model_or_config: nn.Module | MLPConfig | str) -> MLPConfig:
    if isinstance(model_or_config, str):
        return MLPConfig.named(model_or_config)
    if isinstance(model_or_config, MLPConfig):
        return model_or_config
    config = getattr(model_or_config, "config", None)
    if not isinstance(config, MLPConfig):
        raise TypeError(f"expected an MLP, MLPConfig or name, got {type(model_or_config)}")
    return config


def build(config_name: str = "tiny", device: torch.device | str | None = None) -> MLP:
    """Build a seeded-deterministic MLP; ``device="meta"`` allocates no storage."""
    config = MLPConfig.named(config_name)
    if device is None:
        return MLP(config)
    with torch.device(device):
        return MLP(config)


def example_batch(
    model_or_config: nn.Module | MLPConfig | str,
    batch_size: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Global batch ``(x, y)``: x is (batch_size, in_dim), y is (batch_size, out_dim), fp32.

    Drawn on CPU from a private generator seeded with ``seed`` (identical on every rank and
    device; the global RNG is untouched).
    """
    config = _config_of(model_or_config)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, config.in_dim, generator=gen)
    y = torch.randn(batch_size, config.out_dim, generator=gen)
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y
