"""Tiny Hugging Face models of several families, as a model source for the parity harness
and planning tests (`tests/models/hf_families.py:build`, config = the family):

* "bert": `BertForMaskedLM`, an encoder with a tied masked-LM head. Its attention keys carry
  a bias whose gradient is exactly zero in exact arithmetic (softmax ignores a constant
  added to every score): both runs hold float noise there (`testing.parity.GRAD_NOISE_FLOOR`).
* "llama", "llama4" (4 layers): `LlamaForCausalLM` (GQA, rotary embeddings). Its rotary
  table (`inv_freq`, a buffer) is read once, before the first layer: a pipeline holds it on
  the first stage only.
* "gemma2": `Gemma2ForCausalLM`, sandwich norms whose weight is used as `1 + w.float()`,
  logit soft-capping, sliding-window layers.

The loss is the one Hugging Face computes from `labels` (every token)."""

from __future__ import annotations

import torch
import transformers
from torch import Tensor, nn

VOCAB, SEQ = 64, 16
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, intermediate_size=64)


class LabelsLoss(nn.Module):
    """The loss a Hugging Face model computes from `labels`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def build(config_name: str = "llama") -> LabelsLoss:
    t = transformers
    if config_name == "bert":
        config = t.BertConfig(**SHAPE, num_hidden_layers=2, max_position_embeddings=SEQ)
        config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
        return LabelsLoss(t.BertForMaskedLM(config))
    decoder = dict(SHAPE, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)
    if config_name in ("llama", "llama4"):
        layers = 4 if config_name == "llama4" else 2
        return LabelsLoss(t.LlamaForCausalLM(t.LlamaConfig(**decoder, num_hidden_layers=layers)))
    if config_name == "gemma2":
        config = t.Gemma2Config(**decoder, num_hidden_layers=2, head_dim=8, sliding_window=8)
        return LabelsLoss(t.Gemma2ForCausalLM(config))
    raise ValueError(f"unknown family {config_name!r}: bert, llama, llama4 or gemma2")


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=gen)
    return ids, ids.clone()
