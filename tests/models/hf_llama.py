"""A Hugging Face Llama (`transformers.LlamaForCausalLM`: GQA, rotary embeddings) as a model
source for the parity harness (`tests/models/hf_llama.py:build`; config "tiny4": 4 layers,
else 2). Its rotary table (`inv_freq`, a buffer) is read once, before the first layer: a
pipeline holds it on the first stage only."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB, SEQ = 64, 16


class LanguageModelLoss(nn.Module):
    """The causal language-model loss Hugging Face computes from `labels`."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build(config_name: str = "tiny") -> LanguageModelLoss:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=4 if config_name == "tiny4" else 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
    )
    return LanguageModelLoss(LlamaForCausalLM(config))


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    return ids, ids.clone()
