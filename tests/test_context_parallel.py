"""Context parallelism: attention with the sequence split (all-gathered K/V, or a ring).

- Strategies: ``scaled_dot_product_attention`` offers q/out ``Shard(2)`` with k/v
  ``Replicate`` (and the CPU flash kernels' DTensor strategies the same, with ``dk``/``dv``
  ``Partial`` in backward), and the ring: q, k, v, out all ``Shard(2)`` on one axis.
- The search chooses between them by cost (fake process group, meta device): at a long
  sequence on H100 the ring (its K/V passes overlapped with the kernels, no gathered K/V
  held, less causal imbalance) is faster and smaller than the pinned all-gather plan; the
  tiny model on gloo (latency-bound) keeps the all-gather.
- The causal offset mask (``rules.attention.flash_cpu_handler``) is exact: each query shard
  against the full K/V equals the rows of unsharded causal attention, forward and backward.
- Planning only (fake process group, meta device): Llama-3-8B at sequence 131072 on 64 H100
  (8 nodes) fits only with the sequence split; the search's plan splits attention (as a
  ring) and the norms on the sequence.
- ``build_encoder`` below is a bidirectional (non-causal) model source for the parity cases
  in ``tests/test_sequence_parallel.py`` (one spawn for SP and CP).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import autopar
from autopar.cluster import Cluster
from autopar.views import axis_roles, summary

ENCODER_VOCAB, ENCODER_SEQ = 64, 16


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool = False) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # no k bias: its gradient is zero in exact arithmetic (softmax is shift-invariant),
        # so its relative parity error would be noise over noise
        self.qkv, self.proj = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Encoder(nn.Module):
    """A bidirectional (non-causal) token classifier: ``forward(idx, labels) -> loss``;
    ``causal`` (one flag per block) makes some blocks' attention causal."""

    def __init__(
        self, dim: int = 32, heads: int = 4, causal: tuple[bool, ...] = (False, False)
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(ENCODER_VOCAB, dim)
        self.blocks = nn.ModuleList(EncoderBlock(dim, heads, c) for c in causal)
        self.head = nn.Linear(dim, ENCODER_VOCAB)

    def forward(self, idx: Tensor, labels: Tensor) -> Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


def build_encoder(config: str = "tiny") -> Encoder:
    """ "tiny": two non-causal blocks; "tiny-mixed": a non-causal block, then a causal one."""
    configs = {"tiny": (False, False), "tiny-mixed": (False, True)}
    if config not in configs:
        raise ValueError(f"unknown encoder config {config!r}; choose from {sorted(configs)}")
    return Encoder(causal=configs[config])


def example_batch(model: nn.Module, batch_size: int) -> tuple[Tensor, Tensor]:
    idx = torch.randint(0, ENCODER_VOCAB, (batch_size, ENCODER_SEQ))
    return idx, torch.randint(0, ENCODER_VOCAB, (batch_size, ENCODER_SEQ))


def test_causal_offset_mask_is_exact() -> None:
    from autopar.passes.strategies.rules.attention import FLASH_CPU, FLASH_CPU_BWD

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, dtype=torch.float64) for _ in range(3))
    out, lse = FLASH_CPU(q, k, v, 0.0, True)
    dout = torch.randn_like(out)
    dq, dk, dv = FLASH_CPU_BWD(dout, q, k, v, out, lse, 0.0, True)
    n, rows = 4, 2
    dk_sum, dv_sum = torch.zeros_like(dk), torch.zeros_like(dv)
    for r in range(n):
        s = slice(r * rows, (r + 1) * rows)
        mask = torch.full((rows, 8), float("-inf"), dtype=q.dtype).triu(r * rows + 1)
        o, lo = FLASH_CPU(q[:, :, s], k, v, 0.0, False, attn_mask=mask)
        torch.testing.assert_close(o, out[:, :, s])
        torch.testing.assert_close(lo, lse[:, :, s])
        g = FLASH_CPU_BWD(dout[:, :, s], q[:, :, s], k, v, o, lo, 0.0, False, attn_mask=mask)
        torch.testing.assert_close(g[0], dq[:, :, s])
        dk_sum, dv_sum = dk_sum + g[1], dv_sum + g[2]  # Partial: summed over the query shards
    torch.testing.assert_close(dk_sum, dk)
    torch.testing.assert_close(dv_sum, dv)


def _llama_8b(seq: int, layers: int):
    from samples.llama import Llama, LlamaConfig, example_batch

    cfg = dataclasses.replace(LlamaConfig.llama3_8b(), max_seq_len=seq, n_layers=layers)
    with torch.device("meta"):
        model = Llama(cfg)
    return model, example_batch(cfg, 1, device="meta")


def _k_specs(plan) -> list[str]:
    att = [n for n in plan.nodes if n.op.startswith("scaled_dot_product_attention")]
    assert att, summary(plan)
    return [n.inputs[1] for n in att]


def test_search_chooses_ring_or_gathered_kv_by_cost() -> None:
    from samples.llama import Llama, LlamaConfig, example_batch

    cfg = dataclasses.replace(
        LlamaConfig.llama3_8b(),
        max_seq_len=8192,
        n_layers=2,
        dim=512,
        n_heads=4,
        n_kv_heads=1,
        ffn_hidden_dim=1536,
        vocab_size=4096,
    )
    with torch.device("meta"):
        model = Llama(cfg)
    batch = example_batch(cfg, 1, device="meta")
    cluster = Cluster.preset("dgx-h100", nodes=1, mesh=(8,), axis_names=("cp",))
    searched = autopar.plan(model, batch, cluster=cluster, strategy="cp")
    gathered = autopar.plan(model, batch, cluster=cluster, strategy="cp-gather")
    text = summary(searched)
    assert _k_specs(searched) == ["S(2)", "S(2)"], text
    assert _k_specs(gathered) == ["R", "R"], summary(gathered)
    assert searched.predicted_step_time < gathered.predicted_step_time, text
    assert searched.predicted_peak_memory < gathered.predicted_peak_memory, text
    assert "CP ring attention 2/2 (K/V passes per step" in text, text

    tiny_cfg = LlamaConfig.tiny()
    tiny = autopar.plan(
        Llama(tiny_cfg),
        example_batch(tiny_cfg, 8),
        cluster=Cluster.preset("cpu", mesh=(4,), axis_names=("cp",)),
        strategy="cp",
    )
    assert _k_specs(tiny) == ["R", "R"], summary(tiny)


def test_llama3_8b_at_128k_on_64_h100_splits_the_sequence() -> None:
    # Llama-3-8B's width, heads and vocabulary; 2 of its 32 identical blocks keep this fast.
    # A 1-row batch cannot be split over 64 ranks, nor can 32 query / 8 K/V heads: without
    # the sequence split every rank would hold a whole layer's attention activations.
    model, batch = _llama_8b(131072, layers=2)
    cluster = Cluster.preset("dgx-h100", nodes=8, mesh=(64,), axis_names=("all",))
    plan = autopar.plan(model, batch, cluster=cluster)
    text = summary(plan)
    assert axis_roles(plan)[0].endswith("cp"), text
    assert plan.predicted_peak_memory <= cluster.device.memory_bytes, text
    activations = plan.predicted_memory["activations"]
    assert activations * cluster.world_size > cluster.device.memory_bytes, text
    # the ring: its K/V passes overlap the kernels and no rank holds a layer's whole K/V
    assert "CP ring attention 2/2 (K/V passes per step" in text, text
