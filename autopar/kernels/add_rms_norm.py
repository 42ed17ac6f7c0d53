"""Fused residual-add + RMSNorm over the last dim (Triton forward and backward).

Contract: ``add_rms_norm(x, residual, weight, eps) -> (y, s)`` with

    s = x + residual                                (returned: the next residual stream)
    rstd = 1 / sqrt(mean(s^2) + eps)
    x_hat = s * rstd
    y = x_hat * weight                              (weight optional: 1)

per row of N = ``x.shape[-1]`` elements; rows = product of the leading dims. ``x`` and
``residual`` share shape and dtype; ``y`` and ``s`` have that dtype. The sum is added in fp32
and rounded to the input dtype (``y`` normalizes exactly the ``s`` returned). As in Llama's
RMSNorm the statistics are computed in fp32; unlike HF Llama, which rounds ``x_hat`` to the
input dtype before multiplying by the weight, ``x_hat * weight`` is also fp32 and rounded
once (a difference of at most one bf16 ulp).

Backward, with g = dy * weight and row means <.>:

    dx = dresidual = rstd * (g - x_hat * <g * x_hat>) + ds
    dweight = sum_rows(dy * x_hat)

Only ``s`` and ``weight`` are saved for backward; ``rstd`` is recomputed from the row of
``s`` the backward kernel loads anyway. ``x`` and ``residual`` receive the same gradient.

Entry points: the custom ops ``autopar::add_rms_norm`` and ``autopar::add_rms_norm_backward``
(one graph node each under make_fx / torch.export / AOT autograd); the first is
differentiable through the second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels._rowwise import (
    check_params,
    check_rows,
    launch,
    param_dtype,
    register_autograd,
)

Tensor = torch.Tensor


@triton.jit
def _add_rms_norm_fwd_kernel(
    X, R, W, Y, S, n_rows, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0)
    r = tl.load(R + offs, mask=mask, other=0.0)
    s = (x.to(tl.float32) + r.to(tl.float32)).to(S.dtype.element_ty)
    tl.store(S + offs, s, mask=mask)
    s = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / n_cols + eps)
    y = s * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_bwd_kernel(
    DY, DS, S, W, DX, DW_PART, n_rows, n_cols, eps,
    HAS_DS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.full((BLOCK_N,), 1.0, tl.float32)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        s = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / n_cols + eps)
        x_hat = s * rstd[:, None]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy * w[None, :]
        c_gx = tl.sum(g * x_hat, axis=1) / n_cols
        dx = (g - x_hat * c_gx[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
    tl.store(DW_PART + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)


def _check(x: Tensor, residual: Tensor, weight: Tensor | None) -> None:
    check_rows("add_rms_norm", x=x, residual=residual)
    check_params("add_rms_norm", x.shape[-1], weight=weight)


@torch.library.custom_op("autopar::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """``(RMSNorm(x + residual), x + residual)`` as one op (see the module docstring)."""
    _check(x, residual, weight)
    (y, s), _ = launch(
        _add_rms_norm_fwd_kernel, (x, residual), (weight,), like=x, outputs=2,
        scalars=(eps,), HAS_WEIGHT=weight is not None,
    )  # fmt: skip
    return y, s


@add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    _check(x, residual, weight)
    return x.new_empty(x.shape), x.new_empty(x.shape)  # contiguous, as the kernel's


@torch.library.custom_op("autopar::add_rms_norm_backward", mutates_args=())
def add_rms_norm_backward(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of ``autopar::add_rms_norm`` from the saved ``s``.

    ``dx`` is the gradient of both ``x`` and ``residual``; ``dweight`` is computed even when
    the op had no weight (autograd drops it).
    """
    pdtype = param_dtype(weight, s)
    (dx,), (dw,) = launch(
        _add_rms_norm_bwd_kernel, (dy, ds, s), (weight,), like=s, reductions=(pdtype,),
        scalars=(eps,), HAS_DS=ds is not None, HAS_WEIGHT=weight is not None,
    )  # fmt: skip
    return dx, dw


@add_rms_norm_backward.register_fake
def _(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    return s.new_empty(s.shape), s.new_empty(s.shape[-1], dtype=param_dtype(weight, s))


def _backward(
    dy: Tensor | None, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor | None, ...]:
    if dy is None:  # only s is read downstream
        dy = torch.zeros_like(s)
    dx, dw = add_rms_norm_backward(dy, ds, s, weight, eps)
    return dx, dx, dw, None


register_autograd(
    add_rms_norm,
    _backward,
    save=lambda inputs, output: (output[1], inputs[2], inputs[3]),  # s, weight, eps
    unused_grads_as_none=True,
)
