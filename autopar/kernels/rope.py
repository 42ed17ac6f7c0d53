"""Rotary position embedding (RoPE) on q and k in one Triton kernel, with backward.

Contract: ``q`` is ``[B, H, T, D]``, ``k`` is ``[B, Hkv, T, D]`` (any strides), ``cos`` and
``sin`` are ``[T, D]`` (or any shape with ``T * D`` elements ending in ``[T, D]``, e.g.
``[1, 1, T, D]``), ``D`` even. Returns new contiguous ``(q_rot, k_rot)`` in the input dtypes;
the kernel reads each input element once and writes each output element once, with no
temporaries (this is the "in place" of the fusion issue: a functional op cannot alias).

Math ("rotate half" convention, as in Llama/HF): split the last dim into halves
``x = [x1, x2]`` and ``cos = [c1, c2]``, ``sin = [s1, s2]``; ``rotate_half(x) = [-x2, x1]``::

    y  = x * cos + rotate_half(x) * sin
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2

The map is linear in ``x``; its transpose gives the backward (for the usual tables with
``c1 == c2`` and ``s1 == s2`` it is the rotation by ``-theta``)::

    dx1 = dy1 * c1 + dy2 * s2
    dx2 = dy2 * c2 - dy1 * s1

``cos``/``sin`` are treated as constants (buffers): no gradient flows to them. Arithmetic is
in fp32; outputs are stored in the input dtype.

Entry points: :func:`rope` (the ``autopar::rope`` custom op, one graph node under
make_fx/torch.export, backward is the ``autopar::rope_backward`` op), :func:`rope_launch`
(the launcher), :func:`rope_reference` (the PyTorch computation it replaces; no pattern of
:mod:`autopar.passes.fusion` matches it yet).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels import _triton

__all__ = ["rope", "rope_backward", "rope_launch", "rope_reference"]


@triton.jit
def _rotate_store(
    src_ptr, dst_ptr, s_b, s_h, s_t, s_d, b, t, seq_len, n_heads, half, c1, c2, s1, s2,
    BACKWARD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """Rotate every head of (b, t) from ``src`` (strided) into ``dst`` (contiguous)."""
    heads = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]  # int64: offsets can pass 2**31
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < n_heads) & (cols < half)
    src = src_ptr + b * s_b + t * s_t + heads * s_h + cols * s_d
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half * s_d, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    dst = dst_ptr + ((b * n_heads + heads) * seq_len + t) * (2 * half) + cols
    tl.store(dst, y1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, y2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_half(ptr, t, s_t, s_d, start, half, BLOCK_HALF: tl.constexpr):
    """Row t, columns [start, start + half) of a cos/sin table, as fp32 [1, BLOCK_HALF]."""
    cols = tl.arange(0, BLOCK_HALF)
    v = tl.load(ptr + t * s_t + (start + cols) * s_d, mask=cols < half, other=0.0)
    return v.to(tl.float32)[None, :]


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sc_t, sc_d, ss_t, ss_d,
    n_q_heads, n_k_heads, seq_len, half,
    BACKWARD: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """One program per (batch, position): loads the cos/sin row once, rotates q and k heads."""
    pid = tl.program_id(0).to(tl.int64)
    b = pid // seq_len
    t = pid % seq_len
    c1 = _load_half(cos_ptr, t, sc_t, sc_d, 0, half, BLOCK_HALF)
    c2 = _load_half(cos_ptr, t, sc_t, sc_d, half, half, BLOCK_HALF)
    s1 = _load_half(sin_ptr, t, ss_t, ss_d, 0, half, BLOCK_HALF)
    s2 = _load_half(sin_ptr, t, ss_t, ss_d, half, half, BLOCK_HALF)
    _rotate_store(q_ptr, qo_ptr, sq_b, sq_h, sq_t, sq_d, b, t, seq_len, n_q_heads, half,
                  c1, c2, s1, s2, BACKWARD, BLOCK_QH, BLOCK_HALF)  # fmt: skip
    _rotate_store(k_ptr, ko_ptr, sk_b, sk_h, sk_t, sk_d, b, t, seq_len, n_k_heads, half,
                  c1, c2, s1, s2, BACKWARD, BLOCK_KH, BLOCK_HALF)  # fmt: skip


def _as_table(table: torch.Tensor, seq_len: int, head_dim: int, name: str) -> torch.Tensor:
    """View a cos/sin table as ``[T, D]`` (accepts leading broadcast dims of size 1)."""
    if table.numel() != seq_len * head_dim or tuple(table.shape[-2:]) != (seq_len, head_dim):
        raise ValueError(
            f"rope: {name} must be [T, D] = [{seq_len}, {head_dim}], got {list(table.shape)}"
        )
    return table.reshape(seq_len, head_dim)


def _check(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"rope: q and k must be [B, H, T, D], got {list(q.shape)}, {list(k.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"rope: q {list(q.shape)} and k {list(k.shape)} disagree on B, T or D")
    if q.shape[3] % 2:
        raise ValueError(f"rope: head dim must be even, got {q.shape[3]}")


def rope_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel: ``backward=False`` rotates by theta, ``True`` applies the transpose."""
    _check(q, k)
    _triton.require(q, k, cos, sin)
    batch, n_q, seq_len, head_dim = q.shape
    n_k = k.shape[1]
    cos = _as_table(cos, seq_len, head_dim, "cos")
    sin = _as_table(sin, seq_len, head_dim, "sin")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.numel() == 0 and k.numel() == 0:
        return q_out, k_out
    half = head_dim // 2
    _rope_kernel[(batch * seq_len,)](
        q, k, cos, sin, q_out, k_out,
        *q.stride(), *k.stride(), *cos.stride(), *sin.stride(),
        n_q, n_k, seq_len, half,
        BACKWARD=backward,
        BLOCK_QH=triton.next_power_of_2(max(n_q, 1)),
        BLOCK_KH=triton.next_power_of_2(max(n_k, 1)),
        BLOCK_HALF=triton.next_power_of_2(half),
    )  # fmt: skip
    return q_out, k_out


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The PyTorch pattern (HF ``apply_rotary_pos_emb``) that :func:`rope` computes."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@torch.library.custom_op("autopar::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_launch(q, k, cos, sin)


@torch.library.custom_op("autopar::rope_backward", mutates_args=())
def _rope_backward_op(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_launch(grad_q, grad_k, cos, sin, backward=True)


@_rope_op.register_fake
@_rope_backward_op.register_fake
def _rope_fake(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    _check(q, k)
    _as_table(cos, q.shape[2], q.shape[3], "cos")
    _as_table(sin, q.shape[2], q.shape[3], "sin")
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rope_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[2], inputs[3])


def _rope_op_backward(ctx, grad_q, grad_k):
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.autopar.rope_backward(grad_q, grad_k, cos, sin)
    return dq, dk, None, None


def _rope_backward_op_backward(ctx, grad_q, grad_k):
    # The backward map is linear; its transpose is the forward rotation.
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.autopar.rope(grad_q, grad_k, cos, sin)
    return dq, dk, None, None


_rope_op.register_autograd(_rope_op_backward, setup_context=_rope_setup_context)
_rope_backward_op.register_autograd(_rope_backward_op_backward, setup_context=_rope_setup_context)


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply RoPE to q and k: the ``autopar::rope`` op (traceable, differentiable in q, k)."""
    return torch.ops.autopar.rope(q, k, cos, sin)


def rope_backward(
    grad_q: torch.Tensor, grad_k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient of :func:`rope` w.r.t. q and k: the ``autopar::rope_backward`` op."""
    return torch.ops.autopar.rope_backward(grad_q, grad_k, cos, sin)
