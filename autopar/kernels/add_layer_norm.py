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

Entry points: the launchers :func:`add_layer_norm_fwd` / :func:`add_layer_norm_bwd`, the eager
:class:`AddLayerNormFunction`, and the custom ops ``autopar::add_layer_norm`` and
``autopar::add_layer_norm_backward`` (one graph node each under make_fx / torch.export /
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
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(
            f"x {tuple(x.shape)}/{x.dtype} and residual "
            f"{tuple(residual.shape)}/{residual.dtype} must match"
        )
    if x.dim() == 0:
        raise ValueError("add_layer_norm needs at least one dim")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (x.shape[-1],):
            raise ValueError(f"{name} shape {tuple(p.shape)} != ({x.shape[-1]},)")


def add_layer_norm_fwd(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel: returns ``(y, s)`` shaped like ``x``."""
    _check(x, residual, weight, bias)
    require(x)
    x2, r2 = as_rows(x), as_rows(residual)
    y, s = torch.empty_like(x2), torch.empty_like(x2)
    if x2.numel() == 0:
        return y.view(x.shape), s.view(x.shape)
    t = row_tiling(*x2.shape)
    w = weight.contiguous() if weight is not None else x2
    b = bias.contiguous() if bias is not None else x2
    _add_layer_norm_fwd_kernel[(t.n_tiles,)](
        x2, r2, w, b, y, s, t.n_rows, t.n_cols, eps,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps,
    )  # fmt: skip
    return y.view(x.shape), s.view(x.shape)


def add_layer_norm_bwd(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the backward kernel: returns ``(dx, dweight, dbias)``.

    ``dx`` is the gradient of both ``x`` and ``residual``. ``dweight``/``dbias`` have shape
    ``(N,)`` and the weight's dtype (``s``'s when there is no weight); they are computed
    even when the op had no weight or bias (the caller drops them).
    """
    require(s)
    s2, dy2 = as_rows(s), as_rows(dy)
    ds2 = as_rows(ds) if ds is not None else s2
    dx = torch.empty_like(s2)
    n_rows, n_cols = s2.shape
    pdtype = weight.dtype if weight is not None else s.dtype
    if s2.numel() == 0:
        zeros = s2.new_zeros(n_cols, dtype=pdtype)
        return dx.view(s.shape), zeros, zeros.clone()
    t = row_tiling(n_rows, n_cols)
    programs = reduction_programs(t, s.device)
    dw_part = torch.empty(programs, n_cols, dtype=torch.float32, device=s.device)
    db_part = torch.empty_like(dw_part)
    w = weight.contiguous() if weight is not None else s2
    _add_layer_norm_bwd_kernel[(programs,)](
        dy2, ds2, s2, w, dx, dw_part, db_part, n_rows, n_cols, eps,
        HAS_DS=ds is not None, HAS_WEIGHT=weight is not None,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps,
    )  # fmt: skip
    return dx.view(s.shape), dw_part.sum(0).to(pdtype), db_part.sum(0).to(pdtype)


class AddLayerNormFunction(torch.autograd.Function):
    """Eager autograd wrapper over the launchers (Liger-Kernel style)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        residual: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        eps: float,
    ) -> tuple[Tensor, Tensor]:
        y, s = add_layer_norm_fwd(x, residual, weight, bias, eps)
        ctx.save_for_backward(s, weight)
        ctx.eps, ctx.has_bias = eps, bias is not None
        ctx.set_materialize_grads(False)  # ds (or dy) is None when s (or y) is unused
        return y, s

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, dy: Tensor | None, ds: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        s, weight = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(s)
        dx, dw, db = add_layer_norm_bwd(dy, ds, s, weight, ctx.eps)
        return dx, dx, dw if weight is not None else None, db if ctx.has_bias else None, None


@torch.library.custom_op("autopar::add_layer_norm", mutates_args=())
def add_layer_norm(
    x: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """``(LayerNorm(x + residual), x + residual)`` as one op (see the module docstring)."""
    return add_layer_norm_fwd(x, residual, weight, bias, eps)


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
    """``(dx, dweight, dbias)`` of ``autopar::add_layer_norm`` from the saved ``s``."""
    return add_layer_norm_bwd(dy, ds, s, weight, eps)


@add_layer_norm_backward.register_fake
def _(
    dy: Tensor, ds: Tensor | None, s: Tensor, weight: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    pdtype = weight.dtype if weight is not None else s.dtype
    n_cols = s.shape[-1]
    return (
        s.new_empty(s.shape),
        s.new_empty(n_cols, dtype=pdtype),
        s.new_empty(n_cols, dtype=pdtype),
    )


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:
    _, _, weight, bias, eps = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps, ctx.has_bias = eps, bias is not None
    # an unused output's gradient arrives as None, not as zeros: a final norm's sum is
    # read nowhere else, and materialized zeros would be a plain tensor beside DTensors
    ctx.set_materialize_grads(False)


def _backward(
    ctx: torch.autograd.function.FunctionCtx, dy: Tensor | None, ds: Tensor | None
) -> tuple[Tensor | None, ...]:
    s, weight = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(s)
    dx, dw, db = torch.ops.autopar.add_layer_norm_backward(dy, ds, s, weight, ctx.eps)
    return dx, dx, dw if weight is not None else None, db if ctx.has_bias else None, None


add_layer_norm.register_autograd(_backward, setup_context=_setup_context)
