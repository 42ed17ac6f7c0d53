"""Fused bias-add + GELU (Triton forward and backward), erf or tanh form.

Contract: ``bias_gelu(x, bias, approximate) -> y`` with ``bias`` of shape ``(N,)``,
N = ``x.shape[-1]``, broadcast over the leading dims (rows), and

    z = x + bias                                          (fp32, never stored)
    "none":  y = z * Phi(z),   Phi(z) = (1 + erf(z / sqrt(2))) / 2
    "tanh":  y = z * (1 + t) / 2,   t = tanh(u),   u = sqrt(2/pi) * (z + 0.044715 z^3)

computed in fp32 and rounded once to ``x``'s dtype. Backward (gz = dy * y'(z)):

    "none":  y'(z) = Phi(z) + z * exp(-z^2 / 2) / sqrt(2 pi)
    "tanh":  y'(z) = (1 + t) / 2 + z (1 - t^2) / 2 * sqrt(2/pi) * (1 + 3 * 0.044715 z^2)
    dx = gz,   dbias = sum_rows(gz)

Only ``x`` and ``bias`` are saved for backward (``z`` is recomputed in the kernel).
``tanh`` is computed as ``2 sigmoid(2u) - 1`` (Triton has no portable tanh); its absolute
error is ~1e-7, far inside the fp32 tolerance.

Entry points: the custom ops ``autopar::bias_gelu`` and ``autopar::bias_gelu_backward`` (one
graph node each); the first is differentiable through the second.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels._rowwise import check_params, check_rows, launch, register_autograd

Tensor = torch.Tensor
APPROXIMATIONS = ("none", "tanh")

# Constants are literals inside the jit functions: a tl.constexpr global on the left of a
# tensor product yields a constexpr-wrapped tensor that tl.sigmoid/tl.exp reject.
# 0.7071067811865476 = 1/sqrt(2), 0.7978845608028654 = sqrt(2/pi),
# 0.3989422804014327 = 1/sqrt(2 pi), 0.044715 = the tanh form's cubic coefficient.


@triton.jit
def _tanh(u):
    return 2.0 * tl.sigmoid(2.0 * u) - 1.0


@triton.jit
def _gelu(z, APPROX_TANH: tl.constexpr):
    if APPROX_TANH:
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        y = 0.5 * z * (1.0 + t)
    else:
        y = 0.5 * z * (1.0 + tl.math.erf(0.7071067811865476 * z))
    return y


@triton.jit
def _gelu_grad(z, APPROX_TANH: tl.constexpr):
    if APPROX_TANH:
        t = _tanh(0.7978845608028654 * (z + 0.044715 * z * z * z))
        du = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
        d = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * du
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(0.7071067811865476 * z))
        d = cdf + 0.3989422804014327 * z * tl.exp(-0.5 * z * z)
    return d


@triton.jit
def _bias_gelu_fwd_kernel(
    X, B, Y, n_rows, n_cols,
    APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = _gelu(x + b[None, :], APPROX_TANH)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    DY, X, B, DX, DB_PART, n_rows, n_cols,
    APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), tl.num_programs(0)):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        gz = dy * _gelu_grad(x + b[None, :], APPROX_TANH)
        tl.store(DX + offs, gz.to(DX.dtype.element_ty), mask=mask)
        db_acc += gz
    tl.store(DB_PART + pid * n_cols + cols, tl.sum(db_acc, axis=0), mask=col_mask)


def _check(x: Tensor, bias: Tensor, approximate: str) -> None:
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {APPROXIMATIONS}, got {approximate!r}")
    check_rows("bias_gelu", x=x)
    check_params("bias_gelu", x.shape[-1], bias=bias)


@torch.library.custom_op("autopar::bias_gelu", mutates_args=())
def bias_gelu(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    """``gelu(x + bias, approximate)`` as one op (see the module docstring)."""
    _check(x, bias, approximate)
    (y,), _ = launch(
        _bias_gelu_fwd_kernel, (x,), (bias,), like=x, APPROX_TANH=approximate == "tanh"
    )
    return y


@bias_gelu.register_fake
def _(x: Tensor, bias: Tensor, approximate: str = "none") -> Tensor:
    _check(x, bias, approximate)
    return x.new_empty(x.shape)  # contiguous, as the kernel's


@torch.library.custom_op("autopar::bias_gelu_backward", mutates_args=())
def bias_gelu_backward(
    dy: Tensor, x: Tensor, bias: Tensor, approximate: str = "none"
) -> tuple[Tensor, Tensor]:
    """``(dx, dbias)`` of ``autopar::bias_gelu`` from the saved ``x`` and ``bias``."""
    _check(x, bias, approximate)
    (dx,), (db,) = launch(
        _bias_gelu_bwd_kernel, (dy, x), (bias,), like=x, reductions=(bias.dtype,),
        APPROX_TANH=approximate == "tanh",
    )  # fmt: skip
    return dx, db


@bias_gelu_backward.register_fake
def _(dy: Tensor, x: Tensor, bias: Tensor, approximate: str = "none") -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), bias.new_empty(bias.shape)


def _backward(dy: Tensor, x: Tensor, bias: Tensor, approximate: str) -> tuple[Tensor | None, ...]:
    return (*bias_gelu_backward(dy, x, bias, approximate), None)


register_autograd(bias_gelu, _backward, save=lambda inputs, output: inputs)
