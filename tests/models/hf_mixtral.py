"""A Hugging Face Mixtral (`transformers.MixtralForCausalLM`: top-2 of 4 experts, GQA) as a
model source for the parity harness (`tests/models/hf_mixtral.py:build`). Its config is the
experts' implementation: "batched_mm" (gathers and batched matmuls, which autopar plans) or
"grouped_mm" (Hugging Face's default, an opaque custom op on CPU and in fp32)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import MixtralConfig, MixtralForCausalLM

VOCAB, SEQ = 64, 16
CONFIGS = ("batched_mm", "grouped_mm")


class LanguageModelLoss(nn.Module):
    """The causal language-model loss Hugging Face computes from `labels`."""

    def __init__(self, model: MixtralForCausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


def build(config_name: str = "batched_mm") -> LanguageModelLoss:
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=SEQ,
    )
    config._attn_implementation = "sdpa"
    config._experts_implementation = config_name
    return LanguageModelLoss(MixtralForCausalLM(config))


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=gen)
    return ids, ids.clone()
