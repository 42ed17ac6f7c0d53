"""The GPT sample on a padded batch, as a model source for the parity harness
(`tests/models/padded_gpt.py:build`): rows of different lengths, their padding's targets
`ignore_index` (-100), spread so that the ranks, and the microbatches, of every layout the
tests run count different numbers of targets (the batch's first rows are mostly padding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from samples import gpt

IGNORE = -100


class WeightedGPT(gpt.GPT):
    """The GPT sample whose cross-entropy weighs each class (a buffer, as
    `nn.CrossEntropyLoss(weight=...)` holds it): its mean divides by the targets' weights."""

    def __init__(self, config: gpt.GPTConfig) -> None:
        super().__init__(config)
        self.register_buffer("class_weight", torch.linspace(0.25, 4.0, config.vocab_size))

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        logits = self.logits(idx)
        flat = logits.view(-1, logits.size(-1))
        return F.cross_entropy(flat, targets.view(-1), weight=self.class_weight)


def build(config_name: str = "tiny") -> nn.Module:
    """`<gpt config>[-empty][-weighted]`: `-empty`, the batch's first half wholly padding
    too (a data-parallel rank, a microbatch, without any target: its mean is 0/0);
    `-weighted`, a class-weighted cross-entropy (`WeightedGPT`)."""
    name = config_name.removesuffix("-weighted").removesuffix("-empty")
    if config_name.endswith("-weighted"):
        model = WeightedGPT(gpt.GPTConfig.named(name))
    else:
        model = gpt.build(name)
    model.empty_half = "-empty" in config_name
    return model


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    idx, targets = gpt.example_batch(model, batch_size)
    seq = targets.shape[1]
    lengths = torch.linspace(2, seq, batch_size).long()  # row i keeps its first lengths[i]
    if getattr(model, "empty_half", False):
        lengths[: batch_size // 2] = 0
    padding = torch.arange(seq)[None, :] >= lengths[:, None]
    return idx, targets.masked_fill(padding, IGNORE)
