"""Price of ring attention (``passes.strategies.rules.ring``) as it runs: ``n`` steps per
direction, each step's K/V pass overlapped with that step's kernel.

With ``C_f``, ``C_b`` the rank's forward and backward kernel time (its share of the node's
FLOPs over the work factor: 1, causal attention being load-balanced), ``w_s`` the share of
it the rank computes at step ``s`` (``1 / n`` without a mask; causal: the balanced split's
blocks at that step over ``n / 2``, ``rules.ring.causal_step_work``, the slowest rank's
sum), ``p = send_recv_time(kv_bytes)`` one pass of the local K and V blocks (one message:
``[k, v]`` flat) to the next rank:

    forward  = sum_{s < n-1} max(w_s C_f, p) + w_{n-1} C_f               (no pass after the
                                                                          last block)
    backward = sum_{s < n-1} max(w_s C_b, 2p) + w_{n-1} C_b + p          (K/V and the dK/dV
                                                                          accumulator pass
                                                                          together; the
                                                                          accumulator makes
                                                                          one last pass home)

Causal attention adds its swaps with the partner rank (``HalfBytes``: one rank's high half
of q, of the output and of its logsumexp), each one message waited at once, overlapped
with nothing: forward ``swap(q) + swap(out + lse)``, backward ``swap(q + dout + out + lse)
+ swap(dq)`` (``dout``, ``dq`` the size of ``out``, ``q``).

Traffic per rank: forward ``(n - 1) kv_bytes``, backward ``(2n - 1) kv_bytes``, plus the
swaps' ``q + out + lse`` forward and ``2 q + 2 out + lse`` backward.
"""

from __future__ import annotations

import functools

import numpy as np

from autopar.cluster import Link
from autopar.cost_models.comm import send_recv_time
from autopar.passes.strategies.rules.ring import HalfBytes, causal_step_work


@functools.lru_cache(maxsize=64)
def _step_shares(n: int, causal: bool) -> np.ndarray:
    """[rank][step]: the share of its kernel time a rank spends at each step."""
    if not causal:
        return np.full((1, n), 1.0 / n)
    return causal_step_work(n) / (n / 2)


def _overlapped(kernel_s: float, shares: np.ndarray, pass_s: float, last_s: float) -> float:
    """The slowest rank's steps, whose kernels (``kernel_s`` spread by ``shares``) overlap
    ``pass_s`` of passes, but the last, followed by ``last_s``."""
    steps = np.maximum(kernel_s * shares[:, :-1], pass_s).sum(axis=1)
    return float((steps + kernel_s * shares[:, -1]).max()) + last_s


def ring_forward_time(
    forward_s: float, n: int, kv_bytes: float, link: Link, halves: HalfBytes | None = None
) -> float:
    """Seconds of the ring forward whose kernels take ``forward_s`` on this rank;
    ``halves``: what the balanced causal split swaps (None without a mask)."""
    if n <= 1:
        return forward_s
    p = send_recv_time(kv_bytes, link)
    ring = _overlapped(forward_s, _step_shares(n, halves is not None), p, 0.0)
    if halves is None:
        return ring
    swaps = send_recv_time(halves.q, link) + send_recv_time(halves.out + halves.lse, link)
    return ring + swaps


def ring_attention_time(
    compute_s: float,
    backward_factor: float,
    n: int,
    kv_bytes: float,
    link: Link,
    halves: HalfBytes | None = None,
) -> float:
    """Seconds of ring attention's forward and backward, whose kernels take ``compute_s``
    in all (forward : backward = 1 : ``backward_factor``)."""
    if n <= 1:
        return compute_s
    forward_s = compute_s / (1.0 + backward_factor)
    backward_s = compute_s - forward_s
    p = send_recv_time(kv_bytes, link)
    backward = _overlapped(backward_s, _step_shares(n, halves is not None), 2.0 * p, p)
    if halves is not None:
        swapped = halves.q + 2.0 * halves.out + halves.lse
        backward += send_recv_time(swapped, link) + send_recv_time(halves.q, link)
    return ring_forward_time(forward_s, n, kv_bytes, link, halves) + backward


def ring_traffic_bytes(
    n: int, kv_bytes: float, halves: HalfBytes | None = None
) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per ring attention."""
    if n <= 1:
        return 0.0, 0.0
    fwd, bwd = (n - 1) * kv_bytes, (2 * n - 1) * kv_bytes
    if halves is None:
        return fwd, bwd
    swapped = halves.q + halves.out + halves.lse
    return fwd + swapped, bwd + swapped + halves.q + halves.out
