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

Causal attention (``T == S``, top-left mask ``key <= query``) is load-balanced inside the
op (q, k, v and the output stay contiguous ``Shard(seq)`` outside it). The sequence is cut
into ``2n`` half-chunks; rank ``r`` holds halves ``2r`` and ``2r + 1``. It pairs with
``p = n - 1 - r`` (the middle rank of an odd ring with itself) and the pair swaps their high
query halves, so rank ``r`` computes the query halves ``2r`` and ``2p + 1 = 2n - 1 - 2r``
(:func:`query_halves`, ``c_low + c_high = 2n - 1``). Each K/V block is two key halves; query
half ``c`` against key half ``c'`` is full attention if ``c' < c``, the kernel's own causal
diagonal if ``c' == c`` (the two halves have the same rows), skipped if ``c' > c``
(:func:`key_spans`); each query half keeps its own running ``(O, L)``. Every rank thus
computes ``c_low + c_high + 1 = 2n`` quarter blocks (``n / 2`` blocks, an even share:
``attention.work_factor`` 1). After the last block the pair swaps the partner's ``(O, L)``
back: each rank returns its own rows. Backward swaps the high halves of q, dO, O, L (the
final ones), runs the flash backward per (query half, key span), adds both key halves'
dK/dV into the travelling accumulator, and swaps the partner's dq back. The swaps (all
ranks at once, one message each way) are waited at once, not overlapped.

Full activation checkpointing re-runs the forward's collectives where backward first needs
their results, which depends on the rank's spans; so each collective's input depends on the
one before: ``autopar::ring_skip`` copies K/V after the q swap for the first pass, the
passes chain by themselves, and the lent half's ``(O, L)`` is copied after the last pass
for the swap back. Every rank then re-runs every collective, in one order (no step needs
its own ``ring_skip``: the swap back depends on every pass). A ring whose ranks hold one
row (``t = 1``) is not split: it skips wholly masked blocks (rank ``n - 1`` computing
``n - 1/2`` blocks, :func:`balanced`), a ``ring_skip`` standing for each skipped block's
merge so that the result depends on every pass.

Communication: each rotation is one ``_c10d_functional.all_to_all_single`` of the flat
``[k, v]`` (or ``[dk, dv]``) whose only non-empty splits are "to ``r + 1``" and "from
``r - 1``", i.e. a send/recv pair, on the mesh axis's process group (any backend); a swap
is the same with the partner (tensors of several dtypes travel as bytes). The rotation for
step ``s + 1`` is issued before step ``s``'s kernel and waited after it, so it overlaps the
kernel wherever the backend runs collectives asynchronously; the cost model prices it so
(``cost_models.ring``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from autopar.capture.ring_merge import RING_MERGE, RING_SKIP

SEQ = 2  # q, k, v [B, H, T, D]; out [B, H, T, D]; logsumexp [B, H, T]
_F = torch.ops._c10d_functional

Pending = tuple[Tensor, tuple[Tensor, ...]]
Span = tuple[int, int, bool]  # (first key half, number of halves, causal)


class HalfBytes(NamedTuple):
    """Bytes of one rank's high half of q, of the output and of the logsumexp (what the
    balanced causal ring swaps with its partner)."""

    q: float
    out: float
    lse: float


class Ring:
    """One rank's place on the ring: ``rank`` of ``size`` in process group ``group_name``."""

    __slots__ = ("group_name", "rank", "size")

    def __init__(self, rank: int, size: int, group_name: str) -> None:
        assert 0 <= rank < size, (rank, size)
        self.rank, self.size, self.group_name = rank, size, group_name

    @property
    def partner(self) -> int:
        """The rank this one swaps query halves with in the balanced causal split."""
        return self.size - 1 - self.rank

    def send(self, tensors: Sequence[Tensor]) -> Pending:
        """Issue the pass of ``tensors`` to rank + 1 (receiving rank - 1's); returns the
        pending flat buffer and the templates to unpack it with :meth:`wait`."""
        to, source = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        return self._exchange(_flatten(tensors), to, source), tuple(tensors)

    def swap(self, tensors: Sequence[Tensor]) -> Pending:
        """Issue the exchange of ``tensors`` with the partner (itself in the middle of an
        odd ring); every rank of the group calls it alike."""
        return self._exchange(_flatten(tensors), self.partner, self.partner), tuple(tensors)

    def wait(self, pending: Pending) -> list[Tensor]:
        """The tensors of a :meth:`send` or :meth:`swap`, as received (contiguous, same
        shapes and dtypes)."""
        flat, templates = pending
        return _unflatten(self._received(flat), templates)

    def _exchange(self, flat: Tensor, to: int, source: int) -> Tensor:
        """One all-to-all on the group: ``flat`` to rank ``to``, as many from ``source``."""
        out_splits, in_splits = [0] * self.size, [0] * self.size
        in_splits[to] = out_splits[source] = flat.numel()
        return _F.all_to_all_single(flat, out_splits, in_splits, self.group_name)

    def _received(self, flat: Tensor) -> Tensor:
        return _F.wait_tensor(flat)


def _flatten(tensors: Sequence[Tensor]) -> Tensor:
    """One flat buffer of ``tensors``: as they are if they share a dtype, else as bytes."""
    if len({t.dtype for t in tensors}) == 1:
        return torch.cat([t.reshape(-1) for t in tensors])
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def _unflatten(flat: Tensor, templates: Sequence[Tensor]) -> list[Tensor]:
    itemsize = flat.element_size()
    sizes = [t.numel() * t.element_size() // itemsize for t in templates]
    parts = flat.split(sizes)
    return [p.view(t.dtype).view(t.shape) for p, t in zip(parts, templates, strict=True)]


def balanced(causal: bool, rows: int, size: int) -> bool:
    """Whether ring attention of ``rows`` local rows on a ring of ``size`` runs the
    load-balanced causal split (module docstring)."""
    return causal and size > 1 and rows > 1


def query_halves(rank: int, size: int) -> tuple[int, int]:
    """The half-chunks of the sequence whose queries ``rank`` computes in the balanced
    split: its own low half ``2r`` and its partner's high half ``2n - 1 - 2r``."""
    return 2 * rank, 2 * (size - 1 - rank) + 1


def key_spans(c: int, j: int) -> list[Span]:
    """What query half ``c`` computes against K/V block ``j`` (key halves ``2j``,
    ``2j + 1``): the halves wholly below it as one full-attention span, then the diagonal
    half (causal); nothing for halves above it."""
    below = min(max(c - 2 * j, 0), 2)
    spans = [(0, below, False)] if below else []
    if below < 2 and 2 * j + below == c:
        spans.append((below, 1, True))
    return spans


@cache
def causal_step_work(size: int) -> np.ndarray:
    """Blocks of kernel work each rank does at each step of the balanced causal ring (a
    quarter block per full half by half, half that on the diagonal): ``[rank][step]``,
    every rank's sum ``size / 2``. What query half ``c`` computes against block ``j``
    (`key_spans`) depends on ``c - 2j`` alone (nothing below 0, both halves from 2 on):
    each rank's and step's work is read off those three, for every rank at once (an
    array, read-only: it is cached)."""
    per_offset = [sum(n / (8 if diag else 4) for _, n, diag in key_spans(d, 0)) for d in range(3)]
    table = np.array([0.0, *per_offset])  # offset -1 (and below): nothing
    rank = np.arange(size)[:, None]
    j = (rank - np.arange(size)[None, :]) % size  # the block each rank holds at each step
    work = sum(table[np.clip(c - 2 * j, -1, 2) + 1] for c in query_halves(rank, size))
    work.setflags(write=False)
    return work


def _half_sizes(rows: int) -> list[int]:
    return [rows - rows // 2, rows // 2]


def _key_rows(x: Tensor, sizes: Sequence[int], span: Span) -> Tensor:
    first, count, _ = span
    return x.narrow(SEQ, sum(sizes[:first]), sum(sizes[first : first + count]))


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
    if balanced(causal, q.shape[SEQ], ring.size):
        return _balanced_forward(kernel, q, k, v, scale, ring)
    out, lse = kernel(q, k, v, 0.0, causal, scale=scale)  # step 0: the own (diagonal) block
    pending = ring.send((k, v)) if ring.size > 1 else None
    for s in range(1, ring.size):
        assert pending is not None
        k, v = ring.wait(pending)
        pending = ring.send((k, v)) if s < ring.size - 1 else None
        if causal and (ring.rank - s) % ring.size > ring.rank:  # wholly masked block
            out, lse = RING_SKIP(out, lse, k)  # no kernel; the result still depends on it
            continue
        o, lse_j = kernel(q, k, v, 0.0, False, scale=scale)
        out, lse = RING_MERGE(out, lse, o, lse_j)  # one op: kept, not recomputed
    return out, lse


def _balanced_forward(
    kernel: Callable[..., tuple[Tensor, Tensor]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None,
    ring: Ring,
) -> tuple[Tensor, Tensor]:
    sizes = _half_sizes(q.shape[SEQ])
    own, lent = q.split(sizes, SEQ)
    (borrowed,) = ring.wait(ring.swap((lent,)))
    queries = tuple(zip(query_halves(ring.rank, ring.size), (own, borrowed), strict=True))
    states: list[tuple[Tensor, Tensor] | None] = [None, None]  # (out, lse) per query half
    k, v = RING_SKIP(k, v, borrowed)  # the first pass after the swap (module docstring)
    pending: Pending | None = ring.send((k, v))
    for s in range(ring.size):
        if s:
            assert pending is not None
            k, v = ring.wait(pending)
            pending = ring.send((k, v)) if s < ring.size - 1 else None
        j = (ring.rank - s) % ring.size
        for i, (c, rows) in enumerate(queries):
            for span in key_spans(c, j):
                ks, vs = _key_rows(k, sizes, span), _key_rows(v, sizes, span)
                o, lse_j = kernel(rows, ks, vs, 0.0, span[2], scale=scale)
                state = states[i]
                states[i] = (o, lse_j) if state is None else RING_MERGE(*state, o, lse_j)
    (own_out, own_lse), lent_state = states  # type: ignore[misc]
    # the swap back after the last pass (module docstring)
    lent_state = RING_SKIP(*lent_state, k)  # type: ignore[misc]
    back_out, back_lse = ring.wait(ring.swap(lent_state))  # type: ignore[arg-type]
    return torch.cat((own_out, back_out), SEQ), torch.cat((own_lse, back_lse), SEQ)


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
    if balanced(causal, q.shape[SEQ], ring.size):
        return _balanced_backward(kernel, dout, q, k, v, out, lse, scale, ring)
    dq, dk, dv = kernel(dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    if ring.size == 1:
        return dq, dk, dv
    kv = ring.send((k, v))
    acc = ring.send((dk, dv))
    for s in range(1, ring.size):
        k, v = ring.wait(kv)
        if s < ring.size - 1:
            kv = ring.send((k, v))
        if causal and (ring.rank - s) % ring.size > ring.rank:
            acc = ring.send(ring.wait(acc))
            continue
        gq, gk, gv = kernel(dout, q, k, v, out, lse, 0.0, False, scale=scale)
        dq = dq + gq
        dk, dv = ring.wait(acc)
        acc = ring.send((dk + gk, dv + gv))
    dk, dv = ring.wait(acc)  # back at its owner: every rank's share summed
    return dq, dk, dv


def _add_key_grads(block: Tensor, grads: Sequence[tuple[Span, Tensor]], sizes: list[int]) -> Tensor:
    """``block`` (a K or V block's gradient) plus the gradients of key spans of it."""
    halves = list(block.split(sizes, SEQ))
    for (first, count, _), grad in grads:
        parts = grad.split(sizes[first : first + count], SEQ)
        for h, part in zip(range(first, first + count), parts, strict=True):
            halves[h] = halves[h] + part
    return torch.cat(halves, SEQ)


def _balanced_backward(
    kernel: Callable[..., tuple[Tensor, Tensor, Tensor]],
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float | None,
    ring: Ring,
) -> tuple[Tensor, Tensor, Tensor]:
    sizes = _half_sizes(q.shape[SEQ])
    own, lent = zip(*(x.split(sizes, SEQ) for x in (dout, q, out, lse)), strict=True)
    borrowed = ring.wait(ring.swap(lent))
    rows = tuple(zip(query_halves(ring.rank, ring.size), (own, borrowed), strict=True))
    dq: list[Tensor | None] = [None, None]  # per query half
    kv: Pending | None = ring.send((k, v))
    acc: Pending | None = None
    for s in range(ring.size):
        if s:
            assert kv is not None
            k, v = ring.wait(kv)
            kv = ring.send((k, v)) if s < ring.size - 1 else None
        j = (ring.rank - s) % ring.size
        dk_grads: list[tuple[Span, Tensor]] = []
        dv_grads: list[tuple[Span, Tensor]] = []
        for i, (c, (do, qc, oc, lc)) in enumerate(rows):
            for span in key_spans(c, j):
                ks, vs = _key_rows(k, sizes, span), _key_rows(v, sizes, span)
                gq, gk, gv = kernel(do, qc, ks, vs, oc, lc, 0.0, span[2], scale=scale)
                dq[i] = gq if dq[i] is None else dq[i] + gq
                dk_grads.append((span, gk))
                dv_grads.append((span, gv))
        held = (torch.zeros_like(k), torch.zeros_like(v)) if acc is None else ring.wait(acc)
        if dk_grads:
            held = (
                _add_key_grads(held[0], dk_grads, sizes),
                _add_key_grads(held[1], dv_grads, sizes),
            )
        acc = ring.send(held)
    assert acc is not None
    dk, dv = ring.wait(acc)  # back at its owner: every rank's share summed
    own_dq, lent_dq = dq
    (back_dq,) = ring.wait(ring.swap((lent_dq,)))  # type: ignore[arg-type]
    return torch.cat((own_dq, back_dq), SEQ), dk, dv  # type: ignore[arg-type]
