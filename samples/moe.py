"""A Mixtral/DeepSeek-style mixture-of-experts decoder with static-shape routing.

Blocks are pre-norm (RMSNorm) causal attention followed by an MoE feed-forward:

* router: ``logits = x @ w_router`` over ``E`` experts, ``probs = softmax(logits)``, top-k
  (k = 1 or 2) experts per token, gates = the top-k probabilities renormalized (k = 2) or
  the top-1 probability itself (k = 1, Switch);
* capacity: tokens are routed per *group* (one batch row of ``T`` tokens), each expert takes
  at most ``C = ceil(capacity_factor * T * k / E)`` of a group's assignments, first come
  first served in (token, choice) order; the rest are dropped (their gate contributes 0: the
  residual carries the token);
* dispatch / combine with static shapes (GShard): assignment ``(t, j)`` of a group goes to
  slot ``e * C + position`` of a ``[E * C + 1, d]`` buffer (slot ``E * C`` collects dropped
  ones) by ``scatter``; the buffer, viewed ``[G, E, C, d]`` and permuted to ``[E, G * C, d]``,
  meets the stacked expert weights ``w1, w3: [E, d, f]``, ``w2: [E, f, d]`` in batched
  matmuls (SwiGLU); ``gather`` brings each assignment's output back, weighted by its gate.
  No ``one_hot`` (the mask is a ``scatter`` of ones), so nothing data-dependent is traced;
* an optional shared expert (DeepSeek) every token goes through;
* the auxiliary load-balancing loss (Switch): ``E * sum_e f_e * P_e`` with ``f_e`` the
  fraction of assignments routed to ``e`` (before dropping) and ``P_e`` the mean router
  probability, added to the LM loss with weight ``aux_loss_weight``.

Expert parallelism is then a sharding: with groups split over an axis (tokens ``Shard(0)``),
the dispatched ``[E, G * C, d]`` buffer is ``Shard(1)``; experts split on the same axis
need it ``Shard(0)``, and ``Shard(1) -> Shard(0)`` is an all-to-all (and back after the
expert matmuls).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from samples._moe_dropless import DroplessMoE, add_router_and_experts
from samples.llama import RMSNorm


@dataclass(frozen=True, slots=True)
class MoEConfig:
    vocab_size: int
    max_seq_len: int
    n_layers: int
    dim: int
    n_heads: int
    n_experts: int
    expert_hidden_dim: int
    top_k: int = 2
    capacity_factor: float = 1.25
    shared_expert: bool = False
    aux_loss_weight: float = 0.01
    dropless: bool = False  # no capacity: every assignment computed (DroplessMoE, a region)

    def __post_init__(self) -> None:
        if self.top_k not in (1, 2):
            raise ValueError(f"top_k={self.top_k}: choose 1 or 2")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} not divisible by n_heads={self.n_heads}")
        if self.dropless and self.shared_expert:
            raise ValueError("the drop-less variant has no shared expert")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor} must be positive")

    @property
    def capacity(self) -> int:
        """Slots per expert and group (one batch row)."""
        per_expert = self.capacity_factor * self.max_seq_len * self.top_k / self.n_experts
        return max(1, math.ceil(per_expert))


# fields: vocab_size, max_seq_len, n_layers, dim, n_heads, n_experts, expert_hidden_dim, ...
MOE_CONFIGS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(128, 16, 2, 32, 4, 4, 32),
    "tiny-top1": MoEConfig(128, 16, 2, 32, 4, 4, 32, top_k=1, capacity_factor=1.0),
    "tiny-shared": MoEConfig(128, 16, 2, 32, 4, 4, 32, shared_expert=True),
    "tiny-dropless": MoEConfig(128, 16, 2, 32, 4, 4, 32, dropless=True),
    "mixtral-8x7b": MoEConfig(32000, 4096, 32, 4096, 32, 8, 14336),
    "moe-64e": MoEConfig(32000, 4096, 16, 2048, 16, 64, 1408, top_k=2, shared_expert=True),
}
CONFIGS = tuple(MOE_CONFIGS)


class Attention(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.wqkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.wqkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))


class MoE(nn.Module):
    """Top-k routed experts with a capacity; ``forward(x) -> (y, aux_loss)``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        add_router_and_experts(self, config)
        d, f = config.dim, config.expert_hidden_dim
        if config.shared_expert:
            self.shared_w1 = nn.Linear(d, f, bias=False)
            self.shared_w3 = nn.Linear(d, f, bias=False)
            self.shared_w2 = nn.Linear(f, d, bias=False)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(slot [G, T*k] in [0, E*C], gate [G, T*k] (0 where dropped), aux loss)."""
        cfg = self.config
        E, k, C = cfg.n_experts, cfg.top_k, cfg.capacity
        probs = self.router(x).float().softmax(-1)  # [G, T, E]
        top_p, top_e = probs.topk(k, dim=-1)  # [G, T, k]
        gate = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
        G, T = x.shape[:2]
        expert = top_e.reshape(G, T * k)  # assignments in (token, choice) order
        mask = torch.zeros(G, T * k, E, device=x.device).scatter(-1, expert[..., None], 1.0)
        position = (mask.cumsum(1) * mask).sum(-1) - 1  # rank of the assignment in its expert
        kept = position < C
        slot = torch.where(kept, expert * C + position.long(), torch.full_like(expert, E * C))
        gate = torch.where(kept, gate.reshape(G, T * k), torch.zeros_like(position))
        fraction = mask.mean(1)  # [G, E] share of assignments per expert, before dropping
        aux = E * (fraction * probs.mean(1)).sum(-1).mean() / k
        return slot, gate, aux

    def experts(self, h: Tensor) -> Tensor:
        """SwiGLU per expert on ``h [E, N, d]`` (stacked weights: batched matmuls)."""
        return torch.bmm(F.silu(torch.bmm(h, self.w1)) * torch.bmm(h, self.w3), self.w2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.config
        G, T, d = x.shape
        E, k, C = cfg.n_experts, cfg.top_k, cfg.capacity
        slot, gate, aux = self.route(x)
        src = x[:, :, None, :].expand(G, T, k, d).reshape(G, T * k, d)
        index = slot[..., None].expand(G, T * k, d)
        buffer = torch.zeros(G, E * C + 1, d, dtype=x.dtype, device=x.device)
        buffer = buffer.scatter(1, index, src)  # each slot written once; the last collects drops
        h = buffer[:, : E * C].reshape(G, E, C, d).permute(1, 0, 2, 3).reshape(E, G * C, d)
        out = self.experts(h).reshape(E, G, C, d).permute(1, 0, 2, 3).reshape(G, E * C, d)
        out = torch.cat([out, torch.zeros(G, 1, d, dtype=out.dtype, device=out.device)], 1)
        picked = out.gather(1, index) * gate[..., None].to(out.dtype)  # [G, T*k, d]
        y = picked.reshape(G, T, k, d).sum(2)
        if cfg.shared_expert:
            y = y + self.shared_w2(F.silu(self.shared_w1(x)) * self.shared_w3(x))
        return y, aux


class Block(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim)
        self.attention = Attention(config)
        self.moe_norm = RMSNorm(config.dim)
        self.moe = DroplessMoE(config) if config.dropless else MoE(config)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x = x + self.attention(self.attention_norm(x))
        y, aux = self.moe(self.moe_norm(x))
        return x + y, aux.mean()  # the drop-less region's aux loss is per group


class MoEModel(nn.Module):
    """``forward(idx, targets)`` -> cross-entropy + ``aux_loss_weight`` x mean aux loss."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.pos_embeddings = nn.Embedding(config.max_seq_len, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """N(0, 0.02) for linears, embeddings and experts; norms ones (registration order)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, (MoE, DroplessMoE)):
                for w in (module.w1, module.w3, module.w2):
                    nn.init.normal_(w, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        T = idx.shape[1]
        x = self.tok_embeddings(idx) + self.pos_embeddings.weight[:T]
        aux = torch.zeros((), device=x.device)
        for layer in self.layers:
            x, layer_aux = layer(x)
            aux = aux + layer_aux
        logits = self.output(self.norm(x))
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss + self.config.aux_loss_weight * aux / len(self.layers)


def build(config_name: str = "tiny", device: torch.device | str | None = None) -> MoEModel:
    """Build a seeded-deterministic MoE model; ``device="meta"`` allocates no storage."""
    try:
        config = MOE_CONFIGS[config_name]
    except KeyError:
        raise KeyError(f"unknown MoE config {config_name!r}; known: {CONFIGS}") from None
    if device is None:
        return MoEModel(config)
    with torch.device(device):
        return MoEModel(config)


def example_batch(
    model_or_config: nn.Module | MoEConfig | str,
    batch_size: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Global batch ``(idx, targets)`` of shape (batch_size, max_seq_len), int64."""
    config = model_or_config
    if isinstance(config, str):
        config = MOE_CONFIGS[config]
    elif isinstance(config, nn.Module):
        config = config.config  # type: ignore[assignment]
    assert isinstance(config, MoEConfig)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(
        0, config.vocab_size, (batch_size, config.max_seq_len + 1), generator=gen
    )
    idx, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if device is not None:
        idx, targets = idx.to(device), targets.to(device)
    return idx, targets
