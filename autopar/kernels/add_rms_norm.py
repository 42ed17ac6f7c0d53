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

Entry points: the launchers :func:`add_rms_norm_fwd` / :func:`add_rms_norm_bwd`, the eager
:class:`AddRMSNormFunction`, and the custom ops ``autopar::add_rms_norm`` and
``autopar::add_rms_norm_backward`` (one graph node each under make_fx / torch.export /
AOT autograd).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels._tiling import as_rows, reduction_programs, row_tiling
from autopar.kernels._triton import require

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
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"x {tuple(x.shape)}/{x.dtype} and residual "
            f"{tuple(residual.shape)}/{residual.dtype} must match"
        )
    if x.dim() == 0:
        raise ValueError("add_rms_norm needs at least one dim")
    if weight is not None and tuple(weight.shape) != (x.shape[-1],):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({x.shape[-1]},)")


def add_rms_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: returns ``(y, s)`` shaped like ``x``."""
    _check(x, residual, weight)
    require(x)
    x2, r2 = as_rows(x), as_rows(residual)
    y, s = torch.empty_like(x2), torch.empty_like(x2)
    if x2.numel() == 0:
        return y.view(x.shape), s.view(x.shape)
    t = row_tiling(*x2.shape)
    w = weight.contiguous() if weight is not None else x2
    _add_rms_norm_fwd_kernel[(t.n_tiles,)](
        x2, r2, w, y, s, t.n_rows, t.n_cols, eps,
        HAS_WEIGHT=weight is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps,
    )  # fmt: skip
    return y.view(x.shape), s.view(x.shape)


def add_rms_norm_bwd(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """Launch the backward kernel: returns ``(dx, dweight)``.

    ``dx`` is the gradient of both ``x`` and ``residual``. ``dweight`` has shape ``(N,)`` and
    the weight's dtype (``s``'s when there is no weight, in which case the caller drops it).
    """
    require(s)
    s2, dy2 = as_rows(s), as_rows(dy)
    ds2 = as_rows(ds) if ds is not None else s2
    dx = torch.empty_like(s2)
    n_rows, n_cols = s2.shape
    pdtype = weight.dtype if weight is not None else s.dtype
    if s2.numel() == 0:
        return dx.view(s.shape), s2.new_zeros(n_cols, dtype=pdtype)
    t = row_tiling(n_rows, n_cols)
    programs = reduction_programs(t, s.device)
    dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=s.device)
    w = weight.contiguous() if weight is not None else s2
    _add_rms_norm_bwd_kernel[(programs,)](
        dy2, ds2, s2, w, dx, dw_part, n_rows, n_cols, eps,
        HAS_DS=ds is not None, HAS_WEIGHT=weight is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps,
    )  # fmt: skip
    return dx.view(s.shape), dw_part.sum(0).to(pdtype)


class AddRMSNormFunction(torch.autograd.Function):
    """Eager autograd wrapper over the launchers (Liger-Kernel style)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        residual: Tensor,
        weight: Tensor | None,
        eps: float,
    ) -> tuple[Tensor, Tensor]:
        y, s = add_rms_norm_fwd(x, residual, weight, eps)
        ctx.save_for_backward(s, weight)
        ctx.eps = eps
        ctx.set_materialize_grads(False)  # ds (or dy) is None when s (or y) is unused
        return y, s

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dy: Tensor | None, ds: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        s, weight = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(s)
        dx, dw = add_rms_norm_bwd(dy, ds, s, weight, ctx.eps)
        return dx, dx, dw if weight is not None else None, None


@torch.library.custom_op("autopar::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """``(RMSNorm(x + residual), x + residual)`` as one op (see the module docstring)."""
    return add_rms_norm_fwd(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x: Tensor, residual: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    _check(x, residual, weight)
    return x.new_empty(x.shape), x.new_empty(x.shape)  # contiguous, as the kernel's


@torch.library.custom_op("autopar::add_rms_norm_backward", mutates_args=())
def add_rms_norm_backward(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """``(dx, dweight)`` of ``autopar::add_rms_norm`` from the saved ``s``."""
    return add_rms_norm_bwd(dy, ds, s, weight, eps)


@add_rms_norm_backward.register_fake
def _(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    pdtype = weight.dtype if weight is not None else s.dtype
    return s.new_empty(s.shape), s.new_empty(s.shape[-1], dtype=pdtype)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    _, _, weight, eps = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps
    # an unused output's gradient arrives as None, not as zeros: a final norm's sum is
    # read nowhere else, and materialized zeros would be a plain tensor beside DTensors
    ctx.set_materialize_grads(False)


def _backward(
    ctx: torch.autograd.function.FunctionCtx, dy: Tensor | None, ds: Tensor | None
) -> tuple[Tensor | None, ...]:
    s, weight = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(s)
    dx, dw = torch.ops.autopar.add_rms_norm_backward(dy, ds, s, weight, ctx.eps)
    return dx, dx, dw if weight is not None else None, None


add_rms_norm.register_autograd(_backward, setup_context=_setup_context)
