"""Tiny Hugging Face models of 20 families, as a model source for the parity harness and
planning tests (`tests/models/hf_families.py:build`, config = the family, "family:N" for N
layers; 2 layers, d 32, vocab 64, seq 16, dropout off) and `benchmarks/hf_families.py`.

Families the tests run: "bert" (an encoder with a tied masked-LM head; its attention keys
carry a bias whose gradient is exactly zero in exact arithmetic, so both runs hold float
noise there: `testing.parity.GRAD_NOISE_FLOOR`), "llama:4" (its rotary table `inv_freq`, a
buffer, is read once before the first layer: a pipeline holds it on the first stage only),
"gemma2" (sandwich norms whose weight is used as `1 + w.float()`). The loss is the one
Hugging Face computes from `labels` (every token)."""

from __future__ import annotations

import torch
import transformers as t
from torch import Tensor, nn

VOCAB, SEQ = 64, 16
FAMILIES = (
    "llama mistral qwen2 qwen3 phi3 gemma gemma2 olmo2 starcoder2 stablelm gpt_neox opt "
    "bloom falcon gptj bert roberta distilbert t5 bart"
).split()
# family -> (config class, model class), for configs that name their dims as Llama does
LLAMA_NAMED = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM"),
}
TINY = dict(h=32, layers=2, heads=4, ff=64, vocab=VOCAB, seq=SEQ, kv=2, hd=8)
DROPOUTS = (
    "hidden_dropout_prob attention_probs_dropout_prob dropout attention_dropout resid_pdrop "
    "embd_pdrop attn_pdrop hidden_dropout dropout_rate activation_dropout"
).split()


def hf_model(family: str, h, layers, heads, ff, vocab, seq, kv, hd) -> nn.Module:
    """The family's Hugging Face model at these dims, dropout off."""
    if family in LLAMA_NAMED:
        config_cls, model_cls = (getattr(t, n) for n in LLAMA_NAMED[family])
        dims = dict(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers)
        dims |= dict(num_attention_heads=heads, intermediate_size=ff)
        dims["max_position_embeddings"] = seq + 2 if family == "roberta" else seq
        if family not in ("gpt_neox", "bert", "roberta"):
            dims["num_key_value_heads"] = kv
        if family in ("qwen3", "gemma", "gemma2"):
            dims["head_dim"] = hd
        if family == "gemma2":
            dims["sliding_window"] = seq // 2
        if family == "phi3":
            dims["pad_token_id"] = 0
        config = config_cls(**dims)
    else:
        config_cls, model_cls, config = _other(family, h, layers, heads, ff, vocab, seq, hd)
    for name in DROPOUTS:
        if hasattr(config, name):
            setattr(config, name, 0.0)
    return model_cls(config)


def _other(family, h, layers, heads, ff, vocab, seq, hd):
    """Families whose configs name their dims their own way."""
    if family == "opt":
        c = t.OPTConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers, ffn_dim=ff,
                        num_attention_heads=heads, max_position_embeddings=seq,
                        word_embed_proj_dim=h)  # fmt: skip
        return t.OPTConfig, t.OPTForCausalLM, c
    if family == "bloom":
        c = t.BloomConfig(vocab_size=vocab, hidden_size=h, n_layer=layers, n_head=heads)
        return t.BloomConfig, t.BloomForCausalLM, c
    if family == "falcon":
        c = t.FalconConfig(vocab_size=vocab, hidden_size=h, num_hidden_layers=layers,
                           num_attention_heads=heads)  # fmt: skip
        return t.FalconConfig, t.FalconForCausalLM, c
    if family == "gptj":
        c = t.GPTJConfig(vocab_size=vocab, n_embd=h, n_layer=layers, n_head=heads,
                         n_positions=seq, rotary_dim=hd // 2)  # fmt: skip
        return t.GPTJConfig, t.GPTJForCausalLM, c
    if family == "distilbert":
        c = t.DistilBertConfig(vocab_size=vocab, dim=h, n_layers=layers, n_heads=heads,
                               hidden_dim=ff, max_position_embeddings=seq)  # fmt: skip
        return t.DistilBertConfig, t.DistilBertForMaskedLM, c
    if family == "t5":
        c = t.T5Config(vocab_size=vocab, d_model=h, d_kv=hd, d_ff=ff, num_layers=layers,
                       num_heads=heads, decoder_start_token_id=0)  # fmt: skip
        return t.T5Config, t.T5ForConditionalGeneration, c
    if family == "bart":
        c = t.BartConfig(vocab_size=vocab, d_model=h, encoder_layers=layers,
                         decoder_layers=layers, encoder_attention_heads=heads,
                         decoder_attention_heads=heads, encoder_ffn_dim=ff,
                         decoder_ffn_dim=ff, max_position_embeddings=seq)  # fmt: skip
        return t.BartConfig, t.BartForConditionalGeneration, c
    raise ValueError(f"unknown family {family!r}: one of {', '.join(FAMILIES)}")


class LabelsLoss(nn.Module):
    """The loss a Hugging Face model computes from `labels` (every token)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def build(config_name: str = "llama") -> LabelsLoss:
    """The family's tiny model; "family:N" gives it N layers (a pipeline's "llama:4")."""
    family, _, layers = config_name.partition(":")
    return LabelsLoss(hf_model(family, **(TINY | ({"layers": int(layers)} if layers else {}))))


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (batch_size, SEQ), generator=gen)
    return ids, ids.clone()
