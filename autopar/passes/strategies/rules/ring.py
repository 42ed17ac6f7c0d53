"""Ring attention: the local computation of attention with q, k and v all split on the
sequence over one mesh axis (context parallelism without gathering K/V).

On a ring of ``n`` ranks, rank ``r`` holds rows ``[r t, (r + 1) t)`` (``t = T / n``) of
``q``, ``k``, ``v`` ``[B, H, t, D]``. In ``n`` steps every K/V block visits every rank: at
step ``s`` rank ``r`` holds block ``j = (r - s) mod n`` and passes it to ``r + 1``.

Forward. The flash kernel on (q, k_j, v_j) gives a block output ``o_j`` and its row
logsumexp ``l_j``; blocks merge by the online softmax (``autopar::ring_merge``, one op so
that activation checkpointing keeps the result, :mod:`autopar.capture.ring_merge`):

    L' = logaddexp(L, l_j),   O' = O exp(L - L') + o_j exp(l_j - L')

which after the last block is exactly softmax attention over all keys (O, L = the output
and logsumexp of the unsplit kernel, in the rank's rows).

Backward. With the *final* ``O`` and ``L``, the flash backward of block ``j`` (its
``D = rowsum(dO * O)`` and ``P_j = exp(q k_j^T scale - L)``) returns exactly block ``j``'s
share: ``dq = sum_j dq_j``, and ``dk_j``, ``dv_j`` are partial sums over the ranks' query
rows. K/V rotate as in forward; each block's (dk, dv) accumulator travels with it, one step
behind (a rank adds its share, then sends the sum on), and one last pass returns it to the
block's owner: ``n - 1`` K/V rotations and ``n`` dK/dV rotations.

Causal attention (``T == S``, top-left mask ``key <= query``): block ``j < r`` lies wholly
below the diagonal (full attention), ``j == r`` (step 0) is the diagonal block (the
kernel's own causal mask, the offsets being equal), ``j > r`` is wholly masked: its kernel
is skipped (block skipping; the rotation still runs, and ``autopar::ring_skip`` makes the
result depend on it, so that full activation checkpointing re-runs every pass on every
rank). The slowest rank (``n - 1``) thus
computes ``n - 1/2`` blocks where an even split would be ``n / 2``: a work factor
``(2n - 1) / n`` (``attention.work_factor``). The load-balanced split (rank ``r`` holding
chunks ``r`` and ``2n - 1 - r``, a permutation of the sequence) is not done.

Communication: each rotation is one ``_c10d_functional.all_to_all_single`` of the flat
``[k, v]`` (or ``[dk, dv]``) whose only non-empty splits are "to ``r + 1``" and "from
``r - 1``", i.e. a send/recv pair, on the mesh axis's process group (any backend). The
rotation for step ``s + 1`` is issued before step ``s``'s kernel and waited after it, so
it overlaps the kernel wherever the backend runs collectives asynchronously; the cost
model prices it so (``cost_models.ring``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from autopar.capture.ring_merge import RING_MERGE, RING_SKIP

SEQ = 2  # q, k, v [B, H, T, D]; out [B, H, T, D]; logsumexp [B, H, T]
_F = torch.ops._c10d_functional


class Ring:
    """One rank's place on the ring: ``rank`` of ``size`` in process group ``group_name``."""

    __slots__ = ("group_name", "rank", "size")

    def __init__(self, rank: int, size: int, group_name: str) -> None:
        assert 0 <= rank < size, (rank, size)
        self.rank, self.size, self.group_name = rank, size, group_name

    def send(self, tensors: tuple[Tensor, ...]) -> tuple[Tensor, tuple[Tensor, ...]]:
        """Issue the pass of ``tensors`` to rank + 1 (receiving rank - 1's); returns the
        pending flat buffer and the templates to unpack it with :meth:`wait`."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        numel = flat.numel()
        out_splits, in_splits = [0] * self.size, [0] * self.size
        in_splits[(self.rank + 1) % self.size] = numel
        out_splits[(self.rank - 1) % self.size] = numel
        return _F.all_to_all_single(flat, out_splits, in_splits, self.group_name), tensors

    @staticmethod
    def wait(pending: tuple[Tensor, tuple[Tensor, ...]]) -> list[Tensor]:
        """The tensors of a :meth:`send`, as received (contiguous, same shapes)."""
        flat, templates = pending
        flat = _F.wait_tensor(flat)
        sizes = [t.numel() for t in templates]
        return [p.view(t.shape) for p, t in zip(flat.split(sizes), templates, strict=True)]


def _skipped(ring: Ring, j: int, causal: bool) -> bool:
    return causal and j > ring.rank


def ring_forward(
    kernel: Callable[..., tuple[Tensor, Tensor]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    scale: float | None,
    ring: Ring,
) -> tuple[Tensor, Tensor]:
    """(out, logsumexp) of this rank's query rows against every K/V block of the ring;
    ``kernel(q, k, v, dropout_p, is_causal, scale=)`` is the flash forward."""
    assert not causal or q.shape[SEQ] == k.shape[SEQ], "causal ring attention needs T == S"
    out, lse = kernel(q, k, v, 0.0, causal, scale=scale)  # step 0: the own (diagonal) block
    pending = ring.send((k, v)) if ring.size > 1 else None
    for s in range(1, ring.size):
        assert pending is not None
        k, v = Ring.wait(pending)
        pending = ring.send((k, v)) if s < ring.size - 1 else None
        j = (ring.rank - s) % ring.size
        if _skipped(ring, j, causal):  # no kernel; the result still depends on the pass
            out, lse = RING_SKIP(out, lse, k)
            continue
        o, lse_j = kernel(q, k, v, 0.0, False, scale=scale)
        out, lse = RING_MERGE(out, lse, o, lse_j)  # one op: kept, not recomputed
    return out, lse


def ring_backward(
    kernel: Callable[..., tuple[Tensor, Tensor, Tensor]],
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    scale: float | None,
    ring: Ring,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of this rank's rows (module docstring); ``kernel(dout, q, k, v, out,
    lse, dropout_p, is_causal, scale=)`` is the flash backward."""
    dq, dk, dv = kernel(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if ring.size == 1:
        return dq, dk, dv
    kv = ring.send((k, v))
    acc = ring.send((dk, dv))
    for s in range(1, ring.size):
        k, v = Ring.wait(kv)
        if s < ring.size - 1:
            kv = ring.send((k, v))
        j = (ring.rank - s) % ring.size
        if _skipped(ring, j, causal):
            acc = ring.send(tuple(Ring.wait(acc)))
            continue
        gq, gk, gv = kernel(dout, q, k, v, out, lse, 0.0, False, scale=scale)
        dq = dq + gq
        dk, dv = Ring.wait(acc)
        acc = ring.send((dk + gk, dv + gv))
    dk, dv = Ring.wait(acc)  # back at its owner: every rank's share summed
    return dq, dk, dv
