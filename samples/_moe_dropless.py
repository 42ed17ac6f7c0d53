"""The drop-less MoE layer of ``samples/moe.py`` (``MoEConfig(dropless=True)``): a region.
(A part of that sample, not a sample: the underscore keeps it out of the CLI's list.)

Without a capacity every assignment is computed, so how many tokens each expert gets
depends on the router's choices: shapes that torch.export cannot trace. The layer is an
:class:`autopar.Region`, traced as one op with declared placements and its own lowering:

* ``compute(x)`` (one device, or a batch shard): top-k routing, assignments sorted by
  expert (the permute of ``autopar.kernels.moe_permute``: its Triton kernel on CUDA, its
  PyTorch reference elsewhere), one SwiGLU per expert on its rows, the weighted combine back
  (unpermute). Returns ``(y [G, T, d], aux [G])``: the Switch load-balancing loss per
  group (batch row), which the block averages.
* ``compute_expert_parallel(x, group)``: the experts are split over the ranks of ``group``
  (``Shard(0)`` of ``w1, w3, w2``: rank ``r`` holds experts ``[r E/n, (r + 1) E/n)``). A
  rank routes its tokens, exchanges the per-expert counts (all-to-all), sends each
  assignment to its expert's rank (all-to-all with variable splits, differentiable), runs
  its experts on what it received, and returns the outputs the same way.

Gradients: the region's backward runs the forward again under autograd
(:mod:`autopar.capture.regions`), so the all-to-alls run again and their backward (the
reverse exchange) carries the gradients home.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from autopar.capture.regions import Region, all_to_all


def permute(tokens: Tensor, expert: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """(rows sorted by expert [N k, d], counts [E], row_id_map [N, k]): the MoE permute
    kernel where it runs (:func:`use_kernels`), its PyTorch reference elsewhere."""
    if use_kernels(tokens):
        from autopar.kernels.moe_permute import moe_permute

        return moe_permute(tokens, expert, n_experts)
    return _reference().moe_permute_reference(tokens, expert, n_experts)


def unpermute(rows: Tensor, row_id_map: Tensor, gate: Tensor) -> Tensor:
    """``y[n] = sum_j gate[n, j] rows[row_id_map[n, j]]`` (the unpermute kernel where it
    runs)."""
    if use_kernels(rows):
        from autopar.kernels.moe_permute import moe_unpermute

        return moe_unpermute(rows, row_id_map, gate)
    return _reference().moe_unpermute_reference(rows, row_id_map, gate)


def use_kernels(t: Tensor) -> bool:
    """The Triton kernels serve CUDA tensors. (Under Triton's CPU interpreter they are
    correct but ~400x slower than the reference here: the tests run the reference.)"""
    from autopar.kernels import available

    return t.is_cuda and available()


def _reference():
    from autopar.kernels import moe_permute

    return moe_permute


def add_router_and_experts(module: nn.Module, config) -> None:
    """The router ``[d -> E]`` and the stacked SwiGLU experts ``w1, w3 [E, d, f]``,
    ``w2 [E, f, d]`` (both MoE layers of the sample hold them)."""
    E, d, f = config.n_experts, config.dim, config.expert_hidden_dim
    module.router = nn.Linear(d, E, bias=False)
    module.w1 = nn.Parameter(torch.empty(E, d, f))
    module.w3 = nn.Parameter(torch.empty(E, d, f))
    module.w2 = nn.Parameter(torch.empty(E, f, d))


class DroplessMoE(Region):
    """Top-k routed experts, every assignment computed; ``forward(x) -> (y, aux [G])``."""

    expert_params = ("w1", "w3", "w2")

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        add_router_and_experts(self, config)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(expert [G T, k], gate [G T, k], aux [G]) for ``x`` [G, T, d]."""
        E, k = self.config.n_experts, self.config.top_k
        G, T = x.shape[:2]
        probs = self.router(x).float().softmax(-1)  # [G, T, E]
        top_p, top_e = probs.topk(k, dim=-1)
        gate = top_p / top_p.sum(-1, keepdim=True) if k > 1 else top_p
        chosen = top_e.reshape(G, T * k)
        counts = torch.zeros(G, E, device=x.device).scatter_add_(
            1, chosen, torch.ones(chosen.shape, device=x.device)
        )
        aux = E * (counts / (T * k) * probs.mean(1)).sum(-1) / k  # Switch, per group
        return top_e.reshape(G * T, k), gate.reshape(G * T, k), aux

    def experts(self, rows: Tensor, counts: list[int]) -> Tensor:
        """SwiGLU of expert ``e`` (of this module's, local, weights) on its ``counts[e]``
        consecutive rows."""
        outs = [
            (F.silu(h @ self.w1[e]) * (h @ self.w3[e])) @ self.w2[e]
            for e, h in enumerate(rows.split(counts))
        ]
        return torch.cat(outs) if outs else rows

    def compute(self, x: Tensor) -> tuple[Tensor, Tensor]:
        G, T, d = x.shape
        expert, gate, aux = self.route(x)
        rows, counts, row_id_map = permute(x.reshape(G * T, d), expert, self.config.n_experts)
        out = self.experts(rows, counts.tolist())
        return unpermute(out, row_id_map, gate).reshape(G, T, d), aux

    def compute_expert_parallel(self, x: Tensor, group) -> tuple[Tensor, Tensor]:
        G, T, d = x.shape
        n, local = dist.get_world_size(group), self.w1.shape[0]
        expert, gate, aux = self.route(x)
        rows, counts, row_id_map = permute(x.reshape(G * T, d), expert, self.config.n_experts)
        send = counts.view(n, local)  # [rank, its expert]: assignments this rank sends
        recv = torch.empty_like(send)  # [source rank, my expert]: assignments received
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = all_to_all(rows, send_splits, recv_splits, group)
        # received: by source rank, then expert; regroup by expert (stable: source order)
        owner = torch.arange(local, device=x.device).repeat(n)
        order = torch.argsort(torch.repeat_interleave(owner, recv.flatten()), stable=True)
        out = self.experts(received[order], recv.sum(0).tolist())
        back = out[torch.argsort(order)]  # by source rank again
        returned = all_to_all(back, recv_splits, send_splits, group)
        return unpermute(returned, row_id_map, gate).reshape(G, T, d), aux

    def outputs_like(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.new_empty(x.shape), x.new_empty(x.shape[0], dtype=torch.float32)

    def flops(self, x: Tensor) -> float:
        """Router and SwiGLU experts on every assignment (2 FLOPs per multiply-add)."""
        c = self.config
        n = x.numel() // x.shape[-1]
        return 2.0 * n * c.dim * c.n_experts + 6.0 * n * c.top_k * c.dim * c.expert_hidden_dim

    def exchanged_bytes(self, x: Tensor) -> float:
        """One all-to-all moves every assignment's row once (dispatch; combine the same)."""
        return float(x.numel() * self.config.top_k * x.element_size())
