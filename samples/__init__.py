"""Sample models for autopar: a registry of buildable models with example batches.

Each ``samples/<name>.py`` follows the model protocol the CLI reads (``build(config)``,
``example_batch(model, batch_size)``, ``CONFIGS``; see ``autopar.cli.sources``): the CLI loads
the file by path (``autopar plan gpt``), so this package is for scripts and tests run from
the repository root; it is not installed with autopar.

``SAMPLES[name]`` is a :class:`Sample`. Every model's ``forward(*batch)`` returns a scalar
loss, so the whole training step is one graph::

    from samples import SAMPLES
    s = SAMPLES["gpt"]
    torch.manual_seed(0)
    model = s.build("tiny")                  # or s.build("gpt2-1.5b", device="meta")
    loss = model(*s.example_batch(model, batch_size=8))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from samples import gpt, llama, mlp

__all__ = ["SAMPLES", "Sample", "get_sample"]


@dataclass(frozen=True, slots=True)
class Sample:
    """A named sample model.

    ``build(config_name="tiny", device=None)`` constructs the model (weights depend only on the
    global RNG seed; ``device="meta"`` allocates nothing). ``example_batch(model_or_config,
    batch_size, seed=0, device=None)`` returns the *global* batch as a tuple of tensors,
    deterministic in ``seed``; ``model_or_config`` may be a model, its config or a config name.
    """

    name: str
    build: Callable[..., nn.Module]
    example_batch: Callable[..., tuple[Tensor, ...]]
    configs: tuple[str, ...]

    def build_with_batch(
        self,
        config_name: str = "tiny",
        batch_size: int = 8,
        seed: int = 0,
        device: torch.device | str | None = None,
    ) -> tuple[nn.Module, tuple[Tensor, ...]]:
        """Convenience: ``(model, batch)`` with weights seeded by ``torch.manual_seed(seed)``."""
        torch.manual_seed(seed)
        model = self.build(config_name, device=device)
        return model, self.example_batch(model, batch_size, seed=seed, device=device)


SAMPLES: dict[str, Sample] = {
    "gpt": Sample("gpt", gpt.build, gpt.example_batch, gpt.CONFIGS),
    "llama": Sample("llama", llama.build, llama.example_batch, llama.CONFIGS),
    "mlp": Sample("mlp", mlp.build, mlp.example_batch, mlp.CONFIGS),
}


def get_sample(name: str) -> Sample:
    """Look a sample up by name, with a helpful error."""
    try:
        return SAMPLES[name]
    except KeyError:
        raise KeyError(f"unknown sample {name!r}; known: {sorted(SAMPLES)}") from None
