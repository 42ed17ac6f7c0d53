"""A Hugging Face Gemma-2 (`transformers.Gemma2ForCausalLM`: sandwich norms whose weight is
used as `1 + w.float()`, logit soft-capping, sliding-window layers) as a model source for
the parity harness and planning tests (`tests/models/hf_gemma2.py:build`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import Gemma2Config, Gemma2ForCausalLM

VOCAB, SEQ = 64, 16


class LanguageModelLoss(nn.Module):
    """The causal language-model loss Hugging Face computes from `labels`."""

    def __init__(self, model: Gemma2ForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build(config_name: str = "tiny") -> LanguageModelLoss:
    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        sliding_window=8,
        attention_dropout=0.0,
    )
    return LanguageModelLoss(Gemma2ForCausalLM(config))


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    return ids, ids.clone()
