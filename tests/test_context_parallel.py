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
- Ring attention (``rules.ring``) on a ring of threads in one process (its collectives
  replaced by queues) equals the unsplit kernel, forward and backward: the load-balanced
  causal split on even and odd rings (halves of equal and unequal rows), the unsplit causal
  ring of one row per rank, non-causal; the split covers the causal mask once, every rank
  computing ``n / 2`` blocks, and the search prices it so (work factor 1, the swaps' bytes).
- ``build_encoder`` below is a bidirectional (non-causal) model source for the parity cases
  in ``tests/test_sequence_parallel.py`` (one spawn for SP and CP).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cluster import Cluster
from autopar.passes.strategies.rules.ring import (
    Ring,
    causal_step_work,
    key_spans,
    query_halves,
    ring_backward,
    ring_forward,
)
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


def test_ring_blocks_in_flight_count_in_the_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    from autopar.capture import capture
    from autopar.search import liveness
    from autopar.search.peak import predict_peak
    from samples.llama import Llama, LlamaConfig, example_batch

    cfg = dataclasses.replace(LlamaConfig.tiny(), max_seq_len=64)
    model, batch = Llama(cfg), example_batch(cfg, 2)
    cluster = Cluster.preset("cpu", mesh=(4,), axis_names=("cp",))
    plan = autopar.plan(model, batch, cluster=cluster, strategy="cp-ring")
    seen: list[tuple[str, float]] = []
    running = liveness._while_running
    monkeypatch.setattr(
        liveness,
        "_while_running",
        lambda live, n, b: (seen.append((n.name, b)), running(live, n, b)),
    )
    captured = capture(model, batch)
    predict_peak(captured, plan)
    attention = [n.name for n in plan.nodes if n.op.startswith("scaled_dot_product_attention")]
    k = next(n for n in captured.gm.graph.nodes if n.name == attention[0]).args[1]
    kv = 2 * k.meta["val"].numel() // 4 * 4  # local K and V: a quarter of the sequence, fp32
    for name in attention:
        assert [b for m, b in seen if m == name] == [3 * kv, 6 * kv], seen
    assert all(b == 0 for m, b in seen if m not in attention)


class _ThreadRing(Ring):
    """A ring of threads in one process: a rank's messages to another queue up in order."""

    __slots__ = ("boxes",)

    def __init__(self, rank: int, size: int, boxes: dict) -> None:
        super().__init__(rank, size, "threads")
        self.boxes = boxes

    def _exchange(self, flat: Tensor, to: int, source: int) -> Tensor:
        self.boxes[self.rank, to].put(flat.clone())
        return torch.tensor(source)

    def _received(self, flat: Tensor) -> Tensor:
        return self.boxes[int(flat), self.rank].get(timeout=30)


def test_balanced_causal_ring_covers_the_mask_once_with_even_work() -> None:
    for n in range(1, 8):
        assert all(sum(steps) == n / 2 for steps in causal_step_work(n))
        pairs = []  # (query half, key half, causal) over every rank and step
        for rank in range(n):
            for c in query_halves(rank, n):
                for j in range(n):
                    for first, count, causal in key_spans(c, j):
                        pairs += [(c, 2 * j + h, causal) for h in range(first, first + count)]
        below = [(c, h, c == h) for c in range(2 * n) for h in range(c + 1)]
        assert sorted(pairs) == below


def test_causal_step_work_is_what_each_rank_computes_at_each_step() -> None:
    """The pricing's table (read for every rank at once) holds, at rank r and step s, the
    blocks of the spans `key_spans` gives r's query halves against the K/V block it holds
    then, ``(r - s) mod n``: a quarter per full half by half, an eighth on the diagonal."""
    for n in (1, 2, 3, 5, 8, 13, 32):
        want = [
            [
                sum(
                    count / (8 if causal else 4)
                    for c in query_halves(rank, n)
                    for _, count, causal in key_spans(c, (rank - step) % n)
                )
                for step in range(n)
            ]
            for rank in range(n)
        ]
        assert causal_step_work(n).tolist() == want, n


def _on_thread_ring(n: int, fn: Callable[[Ring], object]) -> list:
    """``fn(ring)`` of every rank of a :class:`_ThreadRing` of ``n``, run at once."""
    boxes = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
    results: list = [None] * n

    def rank(r: int) -> None:
        results[r] = fn(_ThreadRing(r, n, boxes))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize(
    "n,rows,causal",
    # even and odd rings, halves of equal and unequal rows; one row per rank is not split
    [(4, 4, True), (3, 3, True), (2, 1, True), (3, 2, False)],
)
def test_ring_attention_matches_the_unsplit_kernel(n: int, rows: int, causal: bool) -> None:
    from autopar.passes.strategies.rules.attention import FLASH_CPU, FLASH_CPU_BWD

    gen = torch.Generator().manual_seed(n)
    q, k, v, dout = (torch.randn(2, 3, n * rows, 4, generator=gen).double() for _ in range(4))
    out, lse = FLASH_CPU(q, k, v, 0.0, causal)
    want = (out, lse, *FLASH_CPU_BWD(dout, q, k, v, out, lse, 0.0, causal))

    def attention(ring: Ring) -> tuple:
        q_r, k_r, v_r, dout_r = (t.narrow(2, ring.rank * rows, rows) for t in (q, k, v, dout))
        o, lse_r = ring_forward(FLASH_CPU, q_r, k_r, v_r, causal, None, ring)
        grads = ring_backward(FLASH_CPU_BWD, dout_r, q_r, k_r, v_r, o, lse_r, causal, None, ring)
        return (o, lse_r, *grads)

    got = _on_thread_ring(n, attention)
    for i, expected in enumerate(want):
        torch.testing.assert_close(torch.cat([g[i] for g in got], 2), expected)


class _CausalAttention(nn.Module):
    def forward(self, qkv: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(*qkv.unbind(0), is_causal=True).sum()


def test_causal_ring_prices_an_even_share_and_its_swaps() -> None:
    """`rules.attention`: the balanced causal ring does an even share of the work (all-gathered
    K/V twice that) and swaps half of q, out and the float32 logsumexp; a ring of one row
    per rank is not split (the last rank's ``n - 1/2`` blocks of ``n / 2``)."""
    from autopar.capture import capture
    from autopar.passes.strategies import NodeStrategy
    from autopar.passes.strategies.rules import attention

    s2, rep = (Shard(2),), (Replicate(),)
    ring, gathered = NodeStrategy((s2, s2, s2), (s2,)), NodeStrategy((s2, rep, rep), (s2,))
    expected = {16: (1.0, attention.HalfBytes(q=384.0, out=384.0, lse=48.0)), 4: (7 / 4, None)}
    for seq, (factor, halves) in expected.items():
        captured = capture(_CausalAttention(), (torch.randn(3, 2, 3, seq, 8),))
        sdpa = torch.ops.aten.scaled_dot_product_attention.default
        node = next(n for n in captured.gm.graph.nodes if n.target == sdpa)
        assert attention.work_factor(node, ring, (4,)) == factor
        assert attention.work_factor(node, gathered, (4,)) == 2.0
        # [2, 3, seq / 4, 8] float32 per rank, half of its rows swapped
        assert attention.ring_half_bytes(node, ring, (4,)) == halves
