"""``autopar::ring_merge``: one online-softmax merge step of ring attention as one op.

Ring attention (:mod:`autopar.passes.strategies.rules.ring`) combines a block's attention
output ``o_j`` and row logsumexp ``l_j`` with the running ``(O, L)``:

    L' = logaddexp(L, l_j),   O' = O exp(L - L') + o_j exp(l_j - L')

Written as pointwise ATen ops, the final ``(O, L)`` (what attention's backward reads) would
be pointwise outputs, which selective activation checkpointing recomputes in backward from
the kept kernel outputs of every block: ``n`` block outputs kept where unsplit attention
keeps one. As one op it is kept like the attention kernels
(:data:`autopar.capture.recompute_policy.SAVED_BY_SELECTIVE`), so the ring holds what the
search prices. It has no autograd: it runs inside the DTensor dispatch of the attention
kernel, below autograd.

``autopar::ring_skip(out, lse, block)`` stands for the merge of a wholly masked causal
block (no kernel runs): it returns copies of ``(out, lse)`` that depend on the received
``block``, so that the result depends on every K/V pass on every rank. Full activation
checkpointing re-runs what backward's inputs depend on; without it a rank whose last blocks
are all masked would re-run fewer passes than its neighbours and the ring would hang. The
load-balanced causal ring orders its collectives by it the same way (copies of K/V made
after the query swap, of the lent half's output after the last pass).
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.library.custom_op("autopar::ring_merge", mutates_args=())
def ring_merge(out: Tensor, lse: Tensor, o: Tensor, lse_j: Tensor) -> tuple[Tensor, Tensor]:
    """(O', L') of the module docstring; ``out``, ``o`` ``[B, H, T, D]``, ``lse``, ``lse_j``
    ``[B, H, T]``; O' contiguous."""
    new = torch.logaddexp(lse, lse_j)
    merged = out * torch.exp(lse - new).unsqueeze(-1).to(out.dtype)
    merged = merged + o * torch.exp(lse_j - new).unsqueeze(-1).to(o.dtype)
    return merged.contiguous(), new.contiguous()


@ring_merge.register_fake
def _(out: Tensor, lse: Tensor, o: Tensor, lse_j: Tensor) -> tuple[Tensor, Tensor]:
    return out.new_empty(out.shape), lse.new_empty(lse.shape)


@torch.library.custom_op("autopar::ring_skip", mutates_args=())
def ring_skip(out: Tensor, lse: Tensor, block: Tensor) -> tuple[Tensor, Tensor]:
    """Contiguous copies of (``out``, ``lse``), computed after ``block`` is received
    (docstring)."""
    del block
    contiguous = torch.contiguous_format
    return out.clone(memory_format=contiguous), lse.clone(memory_format=contiguous)


@ring_skip.register_fake
def _(out: Tensor, lse: Tensor, block: Tensor) -> tuple[Tensor, Tensor]:
    return out.new_empty(out.shape), lse.new_empty(lse.shape)


RING_MERGE = torch.ops.autopar.ring_merge.default
RING_SKIP = torch.ops.autopar.ring_skip.default
