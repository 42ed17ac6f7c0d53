"""Fused SwiGLU gate ``silu(a) * b`` (Triton forward and backward).

Contract: ``swiglu(a, b) -> y`` for ``a`` and ``b`` of the same shape and dtype:

    sig = sigmoid(a),   y = a * sig * b

computed in fp32 and rounded once to the input dtype. Backward:

    da = dy * b * sig * (1 + a * (1 - sig))
    db = dy * a * sig

Only ``a`` and ``b`` are saved for backward (``sig`` is recomputed). The kernel walks rows of
the last dim like the other row-wise kernels (tile = ``BLOCK_M`` rows by the next power of
two of the last dim), though the op is purely elementwise.

Entry points: the launchers :func:`swiglu_fwd` / :func:`swiglu_bwd`, the eager
:class:`SwiGLUFunction`, and the custom ops ``autopar::swiglu`` and
``autopar::swiglu_backward`` (one graph node each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels._tiling import as_rows, row_tiling
from autopar.kernels._triton import require

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
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"a {tuple(a.shape)}/{a.dtype} and b {tuple(b.shape)}/{b.dtype} must match"
        )
    if a.dim() == 0:
        raise ValueError("swiglu needs at least one dim")


def _launch(kernel: triton.JITFunction, *tensors: Tensor, outputs: int) -> list[Tensor]:
    """Run ``kernel`` over the row view of ``tensors``; return ``outputs`` new tensors."""
    rows = [as_rows(t) for t in tensors]
    outs = [torch.empty_like(rows[-1]) for _ in range(outputs)]
    if rows[0].numel() > 0:
        t = row_tiling(*rows[0].shape)
        kernel[(t.n_tiles,)](
            *rows, *outs, t.n_rows, t.n_cols,
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, num_warps=t.num_warps,
        )  # fmt: skip
    return [o.view(tensors[-1].shape) for o in outs]


def swiglu_fwd(a: Tensor, b: Tensor) -> Tensor:
    """Launch the forward kernel: ``silu(a) * b``."""
    _check(a, b)
    require(a)
    return _launch(_swiglu_fwd_kernel, a, b, outputs=1)[0]


def swiglu_bwd(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Launch the backward kernel: returns ``(da, db)``."""
    _check(a, b)
    require(a)
    da, db = _launch(_swiglu_bwd_kernel, dy, a, b, outputs=2)
    return da, db


class SwiGLUFunction(torch.autograd.Function):
    """Eager autograd wrapper over the launchers (Liger-Kernel style)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        return swiglu_fwd(a, b)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple[Tensor, Tensor]:
        a, b = ctx.saved_tensors
        return swiglu_bwd(dy, a, b)


@torch.library.custom_op("autopar::swiglu", mutates_args=())
def swiglu(a: Tensor, b: Tensor) -> Tensor:
    """``silu(a) * b`` as one op (see the module docstring)."""
    return swiglu_fwd(a, b)


@swiglu.register_fake
def _(a: Tensor, b: Tensor) -> Tensor:
    _check(a, b)
    return a.new_empty(a.shape)  # contiguous, as the kernel's


@torch.library.custom_op("autopar::swiglu_backward", mutates_args=())
def swiglu_backward(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """``(da, db)`` of ``autopar::swiglu`` from the saved ``a`` and ``b``."""
    return swiglu_bwd(dy, a, b)


@swiglu_backward.register_fake
def _(dy: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    return a.new_empty(a.shape), b.new_empty(b.shape)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: torch.autograd.function.FunctionCtx, dy: Tensor) -> tuple[Tensor, Tensor]:
    a, b = ctx.saved_tensors
    return torch.ops.autopar.swiglu_backward(dy, a, b)


swiglu.register_autograd(_backward, setup_context=_setup_context)
