"""The GPT sample on a padded batch, as a model source for the parity harness
(`tests/models/padded_gpt.py:build`): rows of different lengths, their padding's targets
`ignore_index` (-100), spread so that the ranks, and the microbatches, of every layout the
tests run count different numbers of targets (the batch's first rows are mostly padding)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from samples import gpt

IGNORE = -100


def build(config_name: str = "tiny") -> nn.Module:
    """`<gpt config>` or `<gpt config>-empty`: the batch's first half wholly padding too (a
    data-parallel rank, a microbatch, without any target: its mean is 0/0)."""
    name = config_name.removesuffix("-empty")
    model = gpt.build(name)
    model.empty_half = config_name.endswith("-empty")
    return model


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    idx, targets = gpt.example_batch(model, batch_size)
    seq = targets.shape[1]
    lengths = torch.linspace(2, seq, batch_size).long()  # row i keeps its first lengths[i]
    if getattr(model, "empty_half", False):
        lengths[: batch_size // 2] = 0
    padding = torch.arange(seq)[None, :] >= lengths[:, None]
    return idx, targets.masked_fill(padding, IGNORE)
