"""MoE token permute (dispatch by expert) and unpermute (weighted combine), with backward.

Contract: ``tokens`` ``[N, H]``, ``expert_idx`` ``[N, k]`` integer in ``[0, E)`` (the top-k
router choice), ``gate_weights`` ``[N, k]``. Flat slot ``f = n * k + j`` sends token ``n`` to
expert ``expert_idx[n, j]``. Slots are ordered by expert id, stably (ties keep slot order),
and ``row_id_map[n, j]`` is the row of slot ``(n, j)`` in that order::

    permute:    out[row_id_map[n, j]] = tokens[n]                       out: [N * k, H]
                counts[e] = #{(n, j) : expert_idx[n, j] == e}           counts: [E] int64
    unpermute:  y[n] = sum_j w[n, j] * expert_out[row_id_map[n, j]]     y: [N, H]

so expert ``e`` owns rows ``[sum(counts[:e]), sum(counts[:e + 1]))`` of ``out``. Without
gate weights, ``w = 1``. Backward (``g`` the incoming gradient)::

    permute:    dtokens[n] = sum_j g[row_id_map[n, j]]         (= unpermute with w = 1)
    unpermute:  dexpert_out[row_id_map[n, j]] = w[n, j] * g[n]
                dw[n, j] = <g[n], expert_out[row_id_map[n, j]]>

The sort that builds ``row_id_map`` and the counts are torch ops (``argsort(stable=True)``,
``scatter_add``); the data movement is one Triton program per token, looping over ``H`` in
blocks, accumulating in fp32 and storing in the destination dtype. Out-of-range expert ids
raise on CPU (``scatter_add``); dropped tokens (id -1) are not supported.

Entry points: :func:`moe_permute` / :func:`moe_unpermute` (custom ops ``autopar::moe_permute``,
``autopar::moe_unpermute``, ``autopar::moe_unpermute_backward``: one graph node each), the
launchers ``*_launch``, and ``*_reference`` (the PyTorch computations they replace; no
pattern of :mod:`autopar.passes.fusion` matches them yet).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autopar.kernels import _triton

__all__ = [
    "moe_permute",
    "moe_permute_launch",
    "moe_permute_reference",
    "moe_unpermute",
    "moe_unpermute_backward_launch",
    "moe_unpermute_launch",
    "moe_unpermute_reference",
]

Tensor = torch.Tensor

MAX_BLOCK_H = 4096


@triton.jit
def _permute_kernel(X, ROW_MAP, OUT, n_cols, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Token n: copy its row to each of its k destination rows."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    for start in range(0, n_cols, BLOCK_H):
        offs = start + cols
        mask = offs < n_cols
        x = tl.load(X + n * n_cols + offs, mask=mask)
        for j in tl.static_range(K):
            dst = tl.load(ROW_MAP + n * K + j)
            tl.store(OUT + dst * n_cols + offs, x.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_kernel(
    Y, ROW_MAP, W, OUT, n_cols,
    K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Token n: fp32 (weighted) sum of its k expert-output rows."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    for start in range(0, n_cols, BLOCK_H):
        offs = start + cols
        mask = offs < n_cols
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            src = tl.load(ROW_MAP + n * K + j)
            y = tl.load(Y + src * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                y = y * tl.load(W + n * K + j).to(tl.float32)
            acc += y
        tl.store(OUT + n * n_cols + offs, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _unpermute_bwd_kernel(
    G, Y, ROW_MAP, W, DY, DW, n_cols,
    K: tl.constexpr, HAS_WEIGHTS: tl.constexpr, GATE_GRAD: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Token n: scatter w * g[n] to its k rows; (GATE_GRAD) dw[n, j] = <g[n], y[row]>."""
    n = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    for j in tl.static_range(K):
        src = tl.load(ROW_MAP + n * K + j)
        w = 1.0
        if HAS_WEIGHTS:
            w = tl.load(W + n * K + j).to(tl.float32)
        dot = 0.0
        for start in range(0, n_cols, BLOCK_H):
            offs = start + cols
            mask = offs < n_cols
            g = tl.load(G + n * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(DY + src * n_cols + offs, (w * g).to(DY.dtype.element_ty), mask=mask)
            if GATE_GRAD:
                y = tl.load(Y + src * n_cols + offs, mask=mask, other=0.0).to(tl.float32)
                dot += tl.sum(g * y, axis=0)
        if GATE_GRAD:
            tl.store(DW + n * K + j, dot.to(DW.dtype.element_ty))


def _block_h(n_cols: int) -> int:
    return min(triton.next_power_of_2(max(n_cols, 1)), MAX_BLOCK_H)


def _check_map(row_id_map: Tensor, n_rows: int | None = None) -> None:
    if row_id_map.dim() != 2 or row_id_map.dtype != torch.int64:
        got = f"{row_id_map.dtype} {list(row_id_map.shape)}"
        raise ValueError(f"moe: row_id_map must be int64 [N, k], got {got}")
    if n_rows is not None and n_rows != row_id_map.numel():
        slots = row_id_map.numel()
        raise ValueError(f"moe: expert outputs have {n_rows} rows, row_id_map has {slots} slots")


def _check_weights(weights: Tensor | None, row_id_map: Tensor) -> None:
    if weights is not None and weights.shape != row_id_map.shape:
        want, got = list(row_id_map.shape), list(weights.shape)
        raise ValueError(f"moe: gate_weights must be {want}, got {got}")


def _row_id_map(expert_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """``(counts [E], row_id_map [N, k])`` of the stable sort of slots by expert id."""
    flat = expert_idx.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    row_id_map = torch.empty_like(flat)
    row_id_map.scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts, row_id_map.view(expert_idx.shape)


def moe_permute_launch(
    tokens: Tensor, expert_idx: Tensor, num_experts: int
) -> tuple[Tensor, Tensor, Tensor]:
    """``(permuted [N * k, H], counts [E] int64, row_id_map [N, k] int64)``."""
    if tokens.dim() != 2 or expert_idx.dim() != 2 or expert_idx.shape[0] != tokens.shape[0]:
        got = f"{list(tokens.shape)}, {list(expert_idx.shape)}"
        raise ValueError(f"moe_permute: tokens [N, H] and expert_idx [N, k], got {got}")
    if expert_idx.is_floating_point() or expert_idx.is_complex() or num_experts < 1:
        raise ValueError("moe_permute: expert_idx must be integer and num_experts >= 1")
    _triton.require(tokens, expert_idx)
    counts, row_id_map = _row_id_map(expert_idx, num_experts)
    n_tokens, n_cols = tokens.shape
    k = expert_idx.shape[1]
    out = torch.empty(n_tokens * k, n_cols, dtype=tokens.dtype, device=tokens.device)
    if out.numel():
        x = tokens.contiguous()
        _permute_kernel[(n_tokens,)](x, row_id_map, out, n_cols, K=k, BLOCK_H=_block_h(n_cols))
    return out, counts, row_id_map


def moe_unpermute_launch(
    expert_out: Tensor, row_id_map: Tensor, gate_weights: Tensor | None = None
) -> Tensor:
    """``y [N, H]``: the (gate-weighted) sum of each token's k expert-output rows."""
    _check_map(row_id_map, expert_out.shape[0] if expert_out.dim() == 2 else None)
    _check_weights(gate_weights, row_id_map)
    _triton.require(expert_out, row_id_map)
    n_tokens, k = row_id_map.shape
    n_cols = expert_out.shape[1]
    out = torch.empty(n_tokens, n_cols, dtype=expert_out.dtype, device=expert_out.device)
    if out.numel():
        w = gate_weights.contiguous() if gate_weights is not None else row_id_map
        _unpermute_kernel[(n_tokens,)](
            expert_out.contiguous(), row_id_map.contiguous(), w, out, n_cols,
            K=k, HAS_WEIGHTS=gate_weights is not None, BLOCK_H=_block_h(n_cols),
        )  # fmt: skip
    return out


def moe_unpermute_backward_launch(
    grad_out: Tensor,
    expert_out: Tensor,
    row_id_map: Tensor,
    gate_weights: Tensor | None,
    gate_grad: bool,
) -> tuple[Tensor, Tensor]:
    """``(d expert_out [N * k, H], d gate_weights [N, k] or empty)`` of :func:`moe_unpermute`."""
    _check_map(row_id_map, expert_out.shape[0])
    _check_weights(gate_weights, row_id_map)
    _triton.require(grad_out, row_id_map)
    gate_grad = gate_grad and gate_weights is not None
    n_tokens, k = row_id_map.shape
    n_cols = grad_out.shape[1]
    d_y = torch.empty(expert_out.shape, dtype=expert_out.dtype, device=expert_out.device)
    d_w = grad_out.new_empty(0)
    if gate_grad:
        d_w = torch.empty(row_id_map.shape, dtype=gate_weights.dtype, device=grad_out.device)
    if d_y.numel():
        w = gate_weights.contiguous() if gate_weights is not None else row_id_map
        _unpermute_bwd_kernel[(n_tokens,)](
            grad_out.contiguous(), expert_out.contiguous(), row_id_map.contiguous(), w, d_y,
            d_w if gate_grad else d_y, n_cols,
            K=k, HAS_WEIGHTS=gate_weights is not None, GATE_GRAD=gate_grad,
            BLOCK_H=_block_h(n_cols),
        )  # fmt: skip
    elif gate_grad:
        d_w.zero_()
    return d_y, d_w


def moe_permute_reference(
    tokens: Tensor, expert_idx: Tensor, num_experts: int
) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch version: gather by the stable argsort of the flattened expert ids."""
    k = expert_idx.shape[1]
    flat = expert_idx.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    row_id_map = torch.argsort(order).view(expert_idx.shape)
    return tokens[order // k], counts, row_id_map


def moe_unpermute_reference(
    expert_out: Tensor, row_id_map: Tensor, gate_weights: Tensor | None = None
) -> Tensor:
    """PyTorch version: gather each token's k rows and (weighted) sum them."""
    rows = expert_out[row_id_map]  # [N, k, H]
    if gate_weights is not None:
        rows = rows * gate_weights.unsqueeze(-1).to(rows.dtype)
    return rows.sum(dim=1)


@torch.library.custom_op("autopar::moe_permute", mutates_args=())
def _moe_permute_op(
    tokens: Tensor, expert_idx: Tensor, num_experts: int
) -> tuple[Tensor, Tensor, Tensor]:
    return moe_permute_launch(tokens, expert_idx, num_experts)


@_moe_permute_op.register_fake
def _moe_permute_fake(
    tokens: Tensor, expert_idx: Tensor, num_experts: int
) -> tuple[Tensor, Tensor, Tensor]:
    n_tokens, k = expert_idx.shape
    out = tokens.new_empty(n_tokens * k, tokens.shape[1])
    counts = expert_idx.new_empty(num_experts, dtype=torch.int64)
    return out, counts, expert_idx.new_empty(n_tokens, k, dtype=torch.int64)


@torch.library.custom_op("autopar::moe_unpermute", mutates_args=())
def _moe_unpermute_op(
    expert_out: Tensor, row_id_map: Tensor, gate_weights: Tensor | None
) -> Tensor:
    return moe_unpermute_launch(expert_out, row_id_map, gate_weights)


@_moe_unpermute_op.register_fake
def _moe_unpermute_fake(
    expert_out: Tensor, row_id_map: Tensor, gate_weights: Tensor | None
) -> Tensor:
    _check_map(row_id_map, expert_out.shape[0])
    _check_weights(gate_weights, row_id_map)
    return expert_out.new_empty(row_id_map.shape[0], expert_out.shape[1])


@torch.library.custom_op("autopar::moe_unpermute_backward", mutates_args=())
def _moe_unpermute_backward_op(
    grad_out: Tensor,
    expert_out: Tensor,
    row_id_map: Tensor,
    gate_weights: Tensor | None,
    gate_grad: bool,
) -> tuple[Tensor, Tensor]:
    return moe_unpermute_backward_launch(grad_out, expert_out, row_id_map, gate_weights, gate_grad)


@_moe_unpermute_backward_op.register_fake
def _moe_unpermute_backward_fake(
    grad_out: Tensor,
    expert_out: Tensor,
    row_id_map: Tensor,
    gate_weights: Tensor | None,
    gate_grad: bool,
) -> tuple[Tensor, Tensor]:
    d_w = grad_out.new_empty(0)
    if gate_grad and gate_weights is not None:
        d_w = gate_weights.new_empty(row_id_map.shape)
    return expert_out.new_empty(expert_out.shape), d_w


def _permute_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[2])


def _permute_backward(ctx, grad_out, _counts, _map):
    (row_id_map,) = ctx.saved_tensors
    return torch.ops.autopar.moe_unpermute(grad_out, row_id_map, None), None, None


def _unpermute_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)
    ctx.has_weights = inputs[2] is not None


def _unpermute_backward(ctx, grad_out):
    expert_out, row_id_map, gate_weights = ctx.saved_tensors
    gate_grad = ctx.has_weights and ctx.needs_input_grad[2]
    d_y, d_w = torch.ops.autopar.moe_unpermute_backward(
        grad_out, expert_out, row_id_map, gate_weights, gate_grad
    )
    return d_y, None, d_w if gate_grad else None


_moe_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup_context)
_moe_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup_context)


def moe_permute(
    tokens: Tensor, expert_idx: Tensor, num_experts: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Dispatch (``autopar::moe_permute``): ``(permuted [N*k, H], counts [E], row_map [N, k])``."""
    return torch.ops.autopar.moe_permute(tokens, expert_idx, num_experts)


def moe_unpermute(
    expert_out: Tensor, row_id_map: Tensor, gate_weights: Tensor | None = None
) -> Tensor:
    """Combine: ``y [N, H]`` from expert outputs ``[N * k, H]`` (``autopar::moe_unpermute``)."""
    return torch.ops.autopar.moe_unpermute(expert_out, row_id_map, gate_weights)
