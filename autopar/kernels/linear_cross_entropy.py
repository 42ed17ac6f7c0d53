"""Fused linear + cross-entropy over the vocabulary, chunked so ``[N, V]`` logits never exist.

Contract: ``x`` is ``[N, H]``, ``weight`` ``[V, H]``, optional ``bias`` ``[V]``, ``target``
``[N]`` int64 with values in ``[0, V)`` or ``ignore_index``. Matches::

    F.cross_entropy(x @ weight.T + bias, target, ignore_index=ignore_index,
                    label_smoothing=eps, reduction=reduction)      # "mean" or "sum"

forward and backward, including the returned dtype (``x.dtype``).

Math, per row ``i`` with logits ``z = x_i W^T + b``, ``lse = log sum_j exp(z_j)``, target
``y``, smoothing ``eps`` over ``V`` classes::

    loss_i = (1 - eps) * (lse - z_y) + eps / V * sum_j (lse - z_j)
           = lse - (1 - eps) * z_y - eps / V * sum_j z_j
    dz_j   = softmax(z)_j - eps / V - (1 - eps) * [j == y]

Ignored rows have ``loss_i = 0`` and ``dz = 0``. ``reduction="mean"`` divides by the number
of non-ignored rows ``n`` (as PyTorch does, also for the smoothing term), ``"sum"`` by 1::

    loss = sum_i loss_i / n,   dx = dz W / n,   dW = dz^T x / n,   db = sum_i dz_i / n

Algorithm (Liger-Kernel's): rows are processed in chunks of ``chunk_rows`` (default: the
chunk's logits take about ``CHUNK_LOGIT_BYTES``). Per chunk, a GEMM (torch) makes the logits;
one Triton program per row runs an online max/log-sum-exp over the vocabulary in blocks,
writes ``loss_i``, and overwrites the logits buffer in place with ``dz`` already multiplied by
the reduction's ``1/n`` (read from a device scalar: no host sync); two more GEMMs write ``dx``
for the chunk and accumulate ``dW`` (and ``db``) in fp32. So the gradients are computed during
the forward pass, and backward only multiplies them by the incoming scalar gradient. Peak
extra memory is one chunk of logits (plus a same-size temporary) and the fp32 ``[V, H]``
accumulator (kept as the saved ``grad_weight``; backward's product with the scalar is a
second ``[V, H]``), instead of about three ``[N, V]`` tensors. When gradients are not needed
(``compute_grad=False``, e.g. under ``no_grad``) only the loss is computed. Double backward
is not supported (the saved gradients are constants to autograd).

Backends: the Triton kernel when it can run on the inputs (CUDA, or CPU tensors under
``TRITON_INTERPRET=1``); otherwise :func:`_ce_rows_torch`, a pure-PyTorch version of the same
per-chunk step (same chunking, same memory profile; used for CPU runs and the CPU memory
benchmark).

Entry points: :func:`linear_cross_entropy` (the ``autopar::linear_cross_entropy`` custom op:
one graph node returning ``(loss, grad_x, grad_weight, grad_bias)``, backward = three scalar
multiplies), :func:`linear_cross_entropy_launch` (the launcher),
:func:`linear_cross_entropy_reference`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from autopar.kernels import _triton

__all__ = [
    "CHUNK_LOGIT_BYTES",
    "linear_cross_entropy",
    "linear_cross_entropy_launch",
    "linear_cross_entropy_reference",
]

Tensor = torch.Tensor

# Target size of one chunk of logits when ``chunk_rows`` is 0 (auto).
CHUNK_LOGIT_BYTES = 32 * 1024 * 1024
# Vocabulary block of the per-row loop (Liger's MAX_FUSED_SIZE is 65536 // 2).
MAX_BLOCK_V = 16384


@triton.jit
def _ce_rows_kernel(
    Z, TARGET, LOSS, SCALE, stride_row, n_cols, ignore_index, one_minus_eps, eps_over_v,
    COMPUTE_GRAD: tl.constexpr, HAS_SMOOTHING: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    """One row of logits: loss_i to LOSS, and (COMPUTE_GRAD) SCALE * dz over the logits."""
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_row
    y = tl.load(TARGET + row)
    cols = tl.arange(0, BLOCK_V)
    if y == ignore_index:
        tl.store(LOSS + row, 0.0)
        if COMPUTE_GRAD:
            for start in range(0, n_cols, BLOCK_V):
                offs = start + cols
                tl.store(z_row + offs, tl.zeros([BLOCK_V], tl.float32), mask=offs < n_cols)
        return
    # Pass 1: online max and sum of exp (and the plain sum of logits for smoothing).
    m = float("-inf")
    d = 0.0
    z_sum = 0.0
    for start in range(0, n_cols, BLOCK_V):
        offs = start + cols
        mask = offs < n_cols
        z = tl.load(z_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
    lse = m + tl.log(d)
    z_y = tl.load(z_row + y).to(tl.float32)
    tl.store(LOSS + row, lse - one_minus_eps * z_y - eps_over_v * z_sum)
    if COMPUTE_GRAD:
        # Pass 2: dz = softmax - eps/V - (1 - eps) * onehot(y), written over the logits.
        scale = tl.load(SCALE).to(tl.float32)
        for start in range(0, n_cols, BLOCK_V):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(z_row + offs, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - eps_over_v
            g = tl.where(offs == y, g - one_minus_eps, g)
            tl.store(z_row + offs, (g * scale).to(Z.dtype.element_ty), mask=mask)


def _ce_rows_triton(
    logits: Tensor,
    target: Tensor,
    loss: Tensor,
    grad_scale: Tensor,
    ignore_index: int,
    eps: float,
    grad: bool,
) -> None:
    """Launch :func:`_ce_rows_kernel` on a ``[rows, V]`` chunk (row stride may exceed V)."""
    rows, vocab = logits.shape
    block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    _ce_rows_kernel[(rows,)](
        logits, target, loss, grad_scale, logits.stride(0), vocab, ignore_index,
        1.0 - eps, eps / vocab,
        COMPUTE_GRAD=grad, HAS_SMOOTHING=eps > 0.0, BLOCK_V=block_v,
        num_warps=32 if block_v >= 16384 else 16 if block_v >= 4096 else 8,
    )  # fmt: skip


def _ce_rows_torch(
    logits: Tensor,
    target: Tensor,
    loss: Tensor,
    grad_scale: Tensor,
    ignore_index: int,
    eps: float,
    grad: bool,
) -> None:
    """Pure-PyTorch version of :func:`_ce_rows_kernel` (same math, same in-place contract).

    Uses one fp32 chunk-sized temporary (none for fp32 logits when ``grad``, which work in
    place), so the chunked algorithm keeps its memory profile without Triton.
    """
    vocab = logits.shape[1]
    z = logits.float()
    lse = torch.logsumexp(z, dim=1)
    valid = target != ignore_index
    safe_t = torch.where(valid, target, 0)
    row_loss = lse - (1.0 - eps) * z.gather(1, safe_t[:, None]).squeeze(1)
    if eps > 0.0:
        row_loss -= eps / vocab * z.sum(dim=1)
    loss.copy_(torch.where(valid, row_loss, 0.0))
    if not grad:
        return
    g = z.sub_(lse[:, None]).exp_().sub_(eps / vocab)
    g.scatter_add_(1, safe_t[:, None], torch.full_like(lse[:, None], eps - 1.0))
    g.mul_(valid[:, None] * grad_scale)
    if g.data_ptr() != logits.data_ptr():
        logits.copy_(g)


def _check(x: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor, reduction: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        shapes = f"{list(x.shape)}, {list(weight.shape)}"
        raise ValueError(f"linear_cross_entropy: x [N, H] and weight [V, H], got {shapes}")
    if target.shape != (x.shape[0],) or target.dtype not in (torch.int64, torch.int32):
        got = f"{target.dtype} {list(target.shape)}"
        raise ValueError(f"linear_cross_entropy: target must be int [N={x.shape[0]}], got {got}")
    if bias is not None and bias.shape != (weight.shape[0],):
        vocab = weight.shape[0]
        raise ValueError(f"linear_cross_entropy: bias must be [V={vocab}], got {list(bias.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction 'mean' or 'sum', got {reduction!r}")


def _triton_runs_on(t: Tensor) -> bool:
    """True when the Triton kernel can take ``t`` (CUDA, or CPU under the interpreter)."""
    if not _triton.available():
        return False
    return t.device.type == "cpu" if _triton.interpreting() else t.device.type == "cuda"


def auto_chunk_rows(n_rows: int, vocab: int, elem_size: int) -> int:
    """Rows per chunk so that one chunk of logits takes about ``CHUNK_LOGIT_BYTES``."""
    return max(1, min(n_rows, CHUNK_LOGIT_BYTES // max(1, vocab * elem_size)))


def _accumulate_chunk(
    x_c: Tensor, weight: Tensor, dz: Tensor, grads: tuple[Tensor, Tensor, Tensor | None]
) -> None:
    """Write the chunk's ``dx = dz W``; add ``dz^T x`` to ``dW`` and ``sum dz`` to ``db``."""
    grad_x_c, grad_w_acc, grad_b_acc = grads
    torch.mm(dz, weight, out=grad_x_c)
    if grad_w_acc.dtype == dz.dtype:
        grad_w_acc.addmm_(dz.T, x_c)
    else:  # low-precision GEMM, fp32 accumulation across chunks (as Liger-Kernel)
        grad_w_acc.add_(torch.mm(dz.T, x_c))
    if grad_b_acc is not None:
        grad_b_acc.add_(dz.sum(dim=0, dtype=torch.float32))


def linear_cross_entropy_launch(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    compute_grad: bool = True,
    chunk_rows: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Return ``(loss, grad_x, grad_weight, grad_bias)``; the grads are for ``d loss = 1``.

    Grads that are not computed (``compute_grad=False``, or no bias) are empty tensors.
    """
    _check(x, weight, bias, target, reduction)
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"linear_cross_entropy: label_smoothing {label_smoothing} not in [0, 1)")
    n_rows, vocab = x.shape[0], weight.shape[0]
    rows = chunk_rows if chunk_rows > 0 else auto_chunk_rows(n_rows, vocab, x.element_size())
    step = _ce_rows_triton if _triton_runs_on(x) else _ce_rows_torch
    target = target.to(torch.int64)
    n_valid = (target != ignore_index).sum()
    # dz is scaled by d loss / d loss_i (1/n for "mean") where it is made, from a device
    # scalar: no host sync, and dx, dW, db come out of the GEMMs final.
    grad_scale = 1.0 / n_valid.float() if reduction == "mean" else torch.ones_like(n_valid.float())
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    grad_x, grad_w, grad_b = _grad_buffers(x, weight, bias, compute_grad)
    for start in range(0, n_rows, rows):
        x_c = x[start : start + rows]
        z = x_c @ weight.T if bias is None else torch.addmm(bias, x_c, weight.T)
        t_c = target[start : start + rows]
        loss_c = loss_rows[start : start + rows]
        step(z, t_c, loss_c, grad_scale, ignore_index, label_smoothing, compute_grad)
        if compute_grad:
            _accumulate_chunk(x_c, weight, z, (grad_x[start : start + rows], grad_w, grad_b))
        del z  # free this chunk's logits before the next GEMM allocates them again
    loss = loss_rows.sum()
    loss = loss / n_valid if reduction == "mean" else loss
    grad_w = grad_w.to(weight.dtype)
    grad_b = grad_b.to(bias.dtype) if grad_b is not None and bias is not None else x.new_empty(0)
    return loss.to(x.dtype), grad_x, grad_w, grad_b


def _grad_buffers(
    x: Tensor, weight: Tensor, bias: Tensor | None, compute_grad: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``grad_x`` (x dtype), fp32 ``dW``/``db`` accumulators; empty / None when not needed."""
    if not compute_grad:
        return x.new_empty(0), x.new_empty(0), None
    grad_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    grad_b = None if bias is None else torch.zeros_like(bias, dtype=torch.float32)
    return grad_x, grad_w, grad_b


def linear_cross_entropy_reference(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> Tensor:
    """The unfused PyTorch computation (materializes ``[N, V]`` logits)."""
    logits = F.linear(x, weight, bias)
    return F.cross_entropy(
        logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing,
        reduction=reduction,
    )  # fmt: skip


def _scaled_grads(
    grad_loss: Tensor, grads: tuple[Tensor, ...], needs: tuple[bool, ...]
) -> list[Tensor | None]:
    """``grad_loss * g`` for each saved gradient whose input needs one (else None)."""
    out: list[Tensor | None] = []
    for g, need in zip(grads, needs, strict=True):
        if not need:
            out.append(None)
        elif g.numel() == 0:
            raise RuntimeError("linear_cross_entropy: forward ran with compute_grad=False")
        else:
            out.append(g * grad_loss.to(g.dtype))
    return out


@torch.library.custom_op("autopar::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    compute_grad: bool,
    chunk_rows: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return linear_cross_entropy_launch(
        x, weight, bias, target, ignore_index, label_smoothing, reduction, compute_grad,
        chunk_rows,
    )  # fmt: skip


@_linear_cross_entropy_op.register_fake
def _linear_cross_entropy_fake(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    compute_grad: bool,
    chunk_rows: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check(x, weight, bias, target, reduction)
    grad_x = x.new_empty(x.shape) if compute_grad else x.new_empty(0)
    grad_w = weight.new_empty(weight.shape) if compute_grad else x.new_empty(0)
    grad_b = bias.new_empty(bias.shape) if compute_grad and bias is not None else x.new_empty(0)
    return x.new_empty(()), grad_x, grad_w, grad_b


def _lce_setup_context(ctx, inputs, output) -> None:
    # The gradient outputs are constants to autograd; without this it would materialize a
    # zero [V, H] "gradient" for grad_weight in backward (a full extra copy of W).
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output[1:])
    ctx.has_bias = inputs[2] is not None


def _lce_backward(ctx, grad_loss, _gx, _gw, _gb):
    needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias)
    gx, gw, gb = _scaled_grads(grad_loss, ctx.saved_tensors, needs)
    return gx, gw, gb, None, None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_lce_backward, setup_context=_lce_setup_context)


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    chunk_rows: int = 0,
) -> Tensor:
    """``F.cross_entropy(F.linear(x, weight, bias), target, ...)`` without ``[N, V]`` logits.

    ``x`` may be ``[..., H]`` with ``target`` ``[...]``. Gradients are computed in the forward
    pass only when autograd will need them. Records one ``autopar::linear_cross_entropy`` node.
    """
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias)
    )
    loss, _, _, _ = torch.ops.autopar.linear_cross_entropy(
        x.reshape(-1, x.shape[-1]), weight, bias, target.reshape(-1), ignore_index,
        float(label_smoothing), reduction, grad, chunk_rows,
    )  # fmt: skip
    return loss
