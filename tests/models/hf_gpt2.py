"""A Hugging Face GPT-2 (`transformers.GPT2LMHeadModel`) with dropout 0.1 everywhere, as a
model source for the parity harness (`tests/models/hf_gpt2.py:build`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ = 64, 16


class LanguageModelLoss(nn.Module):
    """The causal language-model loss Hugging Face computes from `labels`."""

    def __init__(self, model: GPT2LMHeadModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def build(config_name: str = "tiny") -> LanguageModelLoss:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    return LanguageModelLoss(GPT2LMHeadModel(config))


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    return ids, ids.clone()
