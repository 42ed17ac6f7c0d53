"""Price of ring attention (``passes.strategies.rules.ring``) as it runs: ``n`` steps per
direction, each step's K/V pass overlapped with that step's kernel.

With ``C_f``, ``C_b`` the rank's forward and backward kernel time (its share of the node's
FLOPs over the work factor: ``(2n - 1) / n`` for causal with block skipping) spread evenly
over the ``n`` steps, ``p = send_recv_time(kv_bytes)`` one pass of the local K and V
blocks (one message: ``[k, v]`` flat) to the next rank:

    forward  = (n - 1) max(C_f / n, p) + C_f / n           (no pass after the last block)
    backward = (n - 1) max(C_b / n, 2p) + C_b / n + p      (K/V and the dK/dV accumulator
                                                             pass together; the accumulator
                                                             makes one last pass home)

Traffic per rank: forward ``(n - 1) kv_bytes``, backward ``(2n - 1) kv_bytes``.
"""

from __future__ import annotations

from autopar.cluster import Link
from autopar.cost_models.comm import send_recv_time


def ring_forward_time(forward_s: float, n: int, kv_bytes: float, link: Link) -> float:
    """Seconds of the ring forward whose kernels take ``forward_s`` on this rank."""
    if n <= 1:
        return forward_s
    p = send_recv_time(kv_bytes, link)
    return (n - 1) * max(forward_s / n, p) + forward_s / n


def ring_attention_time(
    compute_s: float, backward_factor: float, n: int, kv_bytes: float, link: Link
) -> float:
    """Seconds of ring attention's forward and backward, whose kernels take ``compute_s``
    in all (forward : backward = 1 : ``backward_factor``)."""
    if n <= 1:
        return compute_s
    forward_s = compute_s / (1.0 + backward_factor)
    backward_s = compute_s - forward_s
    p = send_recv_time(kv_bytes, link)
    backward = (n - 1) * max(backward_s / n, 2.0 * p) + backward_s / n + p
    return ring_forward_time(forward_s, n, kv_bytes, link) + backward


def ring_traffic_bytes(n: int, kv_bytes: float) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per ring attention."""
    if n <= 1:
        return 0.0, 0.0
    return (n - 1) * kv_bytes, (2 * n - 1) * kv_bytes
