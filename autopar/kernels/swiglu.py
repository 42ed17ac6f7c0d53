"""Fused SwiGLU gate ``silu(a) * b`` (Triton forward and backward).

Contract: ``swiglu(a, b) -> y`` for ``a`` and ``b`` of the same shape and dtype:

    sig = sigmoid(a),   y = a * sig * b

computed in fp32 and rounded once to the input dtype. Backward:

    da = dy * b * sig * (1 + a * (1 - sig))
    db = dy * a * sig

Only ``a`` and ``b`` are saved for backward (``sig`` is recomputed). The kernel walks rows of
the last dim like the other row-wise kernels (tile = ``BLOCK_M`` rows by the next power of
two of the last dim), though the op is purely elementwise.

Entry points: the custom ops ``autopar::swiglu`` and ``autopar::swiglu_backward`` (one graph
node each); the first is differentiable through the second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels._rowwise import check_rows, launch, register_autograd

Tensor = torch.Tensor


@triton.jit
def _swiglu_fwd_kernel(
    A, B, Y, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DY, A, B, DA, DB, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(a)
    silu = a * sig
    da = dy * b * sig * (1.0 + a * (1.0 - sig))
    tl.store(DA + offs, da.to(DA.dtype.element_ty), mask=mask)
    tl.store(DB + offs, (dy * silu).to(DB.dtype.element_ty), mask=mask)


def _check(a: Tensor, b: Tensor) -> None:
    check_rows("swiglu", a=a, b=b)


@torch.library.custom_op("autopar::swiglu", mutates_args=())
def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b`` as one op (see the module docstring)."""
    _check(a, b)
    (y,), _ = launch(_swiglu_fwd_kernel, (a, b), like=a)
    return y


@swiglu.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    _check(a, b)
    return a.new_empty(a.shape)  # contiguous, as the kernel's


@torch.library.custom_op("autopar::swiglu_backward", mutates_args=())
def swiglu_backward(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(da, db)`` of ``autopar::swiglu`` from the saved ``a`` and ``b``."""
    _check(a, b)
    (da, db), _ = launch(_swiglu_bwd_kernel, (dy, a, b), like=a, outputs=2)
    return da, db


@swiglu_backward.register_fake
def _(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return a.new_empty(a.shape), b.new_empty(b.shape)


register_autograd(swiglu, swiglu_backward, save=lambda inputs, output: inputs)
