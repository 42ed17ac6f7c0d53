"""A Hugging Face BERT (`transformers.BertForMaskedLM`: an encoder, a tied MLM head) as a
model source for the parity harness (`tests/models/hf_bert.py:build`). Its attention keys
carry a bias whose gradient is exactly zero in exact arithmetic (softmax ignores a constant
added to every score): both runs hold float noise there (`testing.parity.GRAD_NOISE_FLOOR`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import BertConfig, BertForMaskedLM

VOCAB, SEQ = 64, 16


class MaskedLanguageModelLoss(nn.Module):
    """The masked language-model loss Hugging Face computes from `labels` (every token)."""

    def __init__(self, model: BertForMaskedLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def build(config_name: str = "tiny") -> MaskedLanguageModelLoss:
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return MaskedLanguageModelLoss(BertForMaskedLM(config))


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=gen)
    return ids, ids.clone()
