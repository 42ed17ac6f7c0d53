"""autopar::moe_permute / moe_unpermute: Triton (interpreter) vs PyTorch references.

Permute is a copy: its output, counts and row map must equal the reference exactly in every
dtype, and its backward (a sum of k rows) is checked like unpermute. Unpermute and all
backwards are compared with float64 references on the same (rounded) inputs: fp32 1e-5,
bf16 2e-2 (fp32 accumulation of k <= 4 products, one rounding of an O(1) output).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (ENVIRONMENT.md)

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from autopar.kernels.moe_permute import (  # noqa: E402
    MAX_BLOCK_H,
    moe_permute,
    moe_permute_reference,
    moe_unpermute,
    moe_unpermute_reference,
)

# (N tokens, top-k, E experts, H)
SHAPES = [(29, 2, 5, 33), (7, 1, 3, 1), (40, 4, 9, 130)]
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]
PERMUTE = torch.ops.autopar.moe_permute
UNPERMUTE = torch.ops.autopar.moe_unpermute


def _inputs(shape, dtype: torch.dtype, idx_dtype: torch.dtype = torch.int64):
    n, k, e, h = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    # distinct experts per token; expert e - 1 never chosen when k < e - 1 (an empty expert)
    pool = e - 1 if k < e - 1 else e
    idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(n)]).to(idx_dtype)
    w = torch.softmax(torch.randn(n, k, generator=g), dim=-1).requires_grad_()
    return x, idx, w


def _close(got, want, atol, rtol) -> None:
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_permute_matches_reference(shape, dtype, atol, rtol, idx_dtype) -> None:
    x, idx, _ = _inputs(shape, dtype, idx_dtype)
    out, counts, row_id_map = moe_permute(x, idx, shape[2])
    ref_out, ref_counts, ref_map = moe_permute_reference(x, idx, shape[2])
    assert torch.equal(out, ref_out) and torch.equal(counts, ref_counts)
    assert torch.equal(row_id_map, ref_map) and counts.sum() == idx.numel()
    slot_expert = torch.empty(idx.numel(), dtype=torch.int64)
    slot_expert[row_id_map.view(-1)] = idx.view(-1).long()
    assert bool((slot_expert[1:] >= slot_expert[:-1]).all())  # grouped by expert id
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    (got,) = torch.autograd.grad(out, x, g)
    x64 = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(moe_permute_reference(x64, idx, shape[2])[0], x64, g.double())
    _close((got,), (want,), atol, rtol)


def _check_unpermute(fn, shape, dtype, atol, rtol, weighted: bool, w_dtype) -> None:
    x, idx, w = _inputs(shape, dtype)
    w = w.detach().to(w_dtype).requires_grad_() if weighted else None
    _, _, row_id_map = moe_permute(x, idx, shape[2])
    g = torch.Generator().manual_seed(2)
    y = torch.randn(idx.numel(), shape[3], generator=g).to(dtype).requires_grad_()
    out = fn(y, row_id_map, w)
    assert out.dtype == dtype and out.shape == (shape[0], shape[3])
    live = [y] if w is None else [y, w]
    dout = torch.randn(out.shape, generator=g).to(dtype)
    got = torch.autograd.grad(out, live, dout)
    ref_in = [t.detach().double().requires_grad_() for t in live]
    ref = moe_unpermute_reference(ref_in[0], row_id_map, ref_in[1] if w is not None else None)
    want = torch.autograd.grad(ref, ref_in, dout.double())
    _close((out, *got), (ref, *want), atol, rtol)


@pytest.mark.parametrize("weighted", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_unpermute_matches_reference(shape, dtype, atol, rtol, weighted) -> None:
    _check_unpermute(moe_unpermute, shape, dtype, atol, rtol, weighted, torch.float32)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_same_dtype_gates_and_permute_backward(dtype, atol, rtol) -> None:
    _check_unpermute(moe_unpermute, SHAPES[0], dtype, atol, rtol, True, dtype)
    x, idx, _ = _inputs(SHAPES[0], dtype)
    out, counts, row_id_map = moe_permute(x, idx, SHAPES[0][2])
    assert torch.equal(out, moe_permute_reference(x, idx, SHAPES[0][2])[0])
    (dx,) = torch.autograd.grad(out, x, torch.ones_like(out))
    torch.testing.assert_close(dx, torch.full_like(x, SHAPES[0][1]))


def test_hidden_wider_than_one_block() -> None:
    """H > MAX_BLOCK_H: the kernels loop over column blocks (and the gate-grad dot too)."""
    shape = (3, 2, 3, MAX_BLOCK_H + 5)
    _check_unpermute(moe_unpermute, shape, torch.float32, 1e-5, 1e-5, True, torch.float32)
    x, idx, _ = _inputs(shape, torch.float32)
    assert torch.equal(moe_permute(x, idx, 3)[0], moe_permute_reference(x, idx, 3)[0])


def test_round_trip_and_errors() -> None:
    x, idx, w = _inputs(SHAPES[0], torch.float32)
    out, _, row_id_map = moe_permute(x, idx, SHAPES[0][2])
    torch.testing.assert_close(moe_unpermute(out, row_id_map, w), x * w.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="gate_weights"):
        moe_unpermute(out, row_id_map, w[:, :1])
    with pytest.raises(ValueError, match="rows"):
        moe_unpermute(out[1:], row_id_map)


def test_ops_are_one_node_in_forward_and_joint_graphs() -> None:
    x, idx, w = _inputs(SHAPES[0], torch.float32)
    e = SHAPES[0][2]

    def layer(x, idx, w):
        out, _, row_id_map = moe_permute(x, idx, e)
        return moe_unpermute(out * 2.0, row_id_map, w)

    def joint(x, idx, w):
        y = layer(x, idx, w)
        return y, torch.autograd.grad(y, (x, w), torch.ones_like(y))

    fwd = make_fx(layer, tracing_mode="fake")(x, idx, w)
    calls = [n.target for n in fwd.graph.nodes if n.op == "call_function"]
    assert calls.count(PERMUTE.default) == 1 and calls.count(UNPERMUTE.default) == 1
    gm = make_fx(joint, tracing_mode="fake")(x, idx, w)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(torch.ops.autopar.moe_unpermute_backward.default) == 1
    assert calls.count(UNPERMUTE.default) == 2  # forward combine + permute's backward
    assert not any("index" in str(c) or "sort" in str(c) for c in calls), calls


def test_opcheck() -> None:
    x, idx, w = _inputs((6, 2, 3, 5), torch.float32)
    torch.library.opcheck(PERMUTE, (x, idx, 3))
    _, _, row_id_map = moe_permute(x, idx, 3)
    y = torch.randn(12, 5, requires_grad=True)
    torch.library.opcheck(UNPERMUTE, (y, row_id_map, w))
    torch.library.opcheck(UNPERMUTE, (y, row_id_map, None))
