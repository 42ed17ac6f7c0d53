"""Fused residual-add + LayerNorm over the last dim (Triton forward and backward).

Contract: ``add_layer_norm(x, residual, weight, bias, eps) -> (y, s)`` with

    s = x + residual                                (returned: the next residual stream)
    mu = mean(s),  var = mean((s - mu)^2),  rstd = 1 / sqrt(var + eps)
    x_hat = (s - mu) * rstd
    y = x_hat * weight + bias                       (weight, bias optional: 1 and 0)

per row of N = ``x.shape[-1]`` elements; rows = product of the leading dims. ``x`` and
``residual`` share shape and dtype; ``y`` and ``s`` have that dtype. The sum is added in fp32
and rounded to the input dtype first (so ``y`` normalizes exactly the ``s`` returned, as the
unfused graph does); the statistics and ``y`` are computed in fp32.

Backward, with g = dy * weight and row means <.>:

    dx = dresidual = rstd * (g - <g> - x_hat * <g * x_hat>) + ds
    dweight = sum_rows(dy * x_hat),   dbias = sum_rows(dy)

Only ``s`` and ``weight`` are saved for backward: ``mu`` and ``rstd`` are recomputed from the
row of ``s`` the backward kernel loads anyway (no per-row statistics tensors are stored).
``x`` and ``residual`` receive the same gradient tensor.

Entry points: the custom ops ``autopar::add_layer_norm`` and
``autopar::add_layer_norm_backward`` (one graph node each under make_fx / torch.export /
AOT autograd); the first is differentiable through the second.
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
def _add_layer_norm_fwd_kernel(
    X, R, W, B, Y, S, n_rows, n_cols, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
    mean = tl.sum(s, axis=1) / n_cols
    xc = tl.where(mask, s - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    y = xc * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _add_layer_norm_bwd_kernel(
    DY, DS, S, W, DX, DW_PART, DB_PART, n_rows, n_cols, eps,
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
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        s = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(s, axis=1) / n_cols
        xc = tl.where(mask, s - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
        x_hat = xc * rstd[:, None]
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        g = dy * w[None, :]
        c_g = tl.sum(g, axis=1) / n_cols
        c_gx = tl.sum(g * x_hat, axis=1) / n_cols
        dx = (g - c_g[:, None] - x_hat * c_gx[:, None]) * rstd[:, None]
        if HAS_DS:
            dx += tl.load(DS + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        dw_acc += dy * x_hat
        db_acc += dy
    tl.store(DW_PART + pid * n_cols + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    tl.store(DB_PART + pid * n_cols + cols, tl.sum(db_acc, axis=0), mask=col_mask)


def _check(x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None) -> None:
    check_rows("add_layer_norm", x=x, residual=residual)
    check_params("add_layer_norm", x.shape[-1], weight=weight, bias=bias)


@torch.library.custom_op("autopar::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """``(LayerNorm(x + residual), x + residual)`` as one op (see the module docstring)."""
    _check(x, residual, weight, bias)
    (y, s), _ = launch(
        _add_layer_norm_fwd_kernel, (x, residual), (weight, bias), like=x, outputs=2,
        scalars=(eps,), HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
    )  # fmt: skip
    return y, s


@add_layer_norm.register_fake
def _(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    _check(x, residual, weight, bias)
    return x.new_empty(x.shape), x.new_empty(x.shape)  # contiguous, as the kernel's


@torch.library.custom_op("autopar::add_layer_norm_backward", mutates_args=())
def add_layer_norm_backward(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dx, dweight, dbias)`` of ``autopar::add_layer_norm`` from the saved ``s``.

    ``dx`` is the gradient of both ``x`` and ``residual``; ``dweight``/``dbias`` are computed
    even when the op had no weight or bias (autograd drops them).
    """
    pdtype = param_dtype(weight, s)
    (dx,), (dw, db) = launch(
        _add_layer_norm_bwd_kernel, (dy, ds, s), (weight,), like=s,
        reductions=(pdtype, pdtype), scalars=(eps,),
        HAS_DS=ds is not None, HAS_WEIGHT=weight is not None,
    )  # fmt: skip
    return dx, dw, db


@add_layer_norm_backward.register_fake
def _(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    pdtype = param_dtype(weight, s)
    n_cols = s.shape[-1]
    return (
        s.new_empty(s.shape),
        s.new_empty(n_cols, dtype=pdtype),
        s.new_empty(n_cols, dtype=pdtype),
    )


def _backward(
    dy: Tensor | None, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor | None, ...]:
    if dy is None:  # only s is read downstream
        dy = torch.zeros_like(s)
    dx, dw, db = add_layer_norm_backward(dy, ds, s, weight, eps)
    return dx, dx, dw, db, None


register_autograd(
    add_layer_norm,
    _backward,
    save=lambda inputs, output: (output[1], inputs[2], inputs[4]),  # s, weight, eps
    unused_grads_as_none=True,
)
