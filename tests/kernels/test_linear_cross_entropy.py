"""autopar::linear_cross_entropy: Triton (interpreter) vs a float64 PyTorch reference.

The reference is ``F.cross_entropy(F.linear(x, W, b), t, ...)`` in float64 on the same
(rounded) inputs. Not fp32: over a 50257-word vocabulary torch's own fp32 path is ~2e-5
(relative to the largest entry) from float64 in dx, the fused kernel ~3e-6.

Tolerances: ``atol`` is relative to the largest magnitude of each reference tensor, because
the gradients are O(1/n) ("mean") or O(rows) ("sum") rather than O(1); fp32 1e-5, bf16 2e-2
(the logits themselves are rounded to bf16 before the softmax, as in the unfused graph, and
dz is stored in bf16 for the dx / dW GEMMs).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (ENVIRONMENT.md)

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from autopar.kernels import linear_cross_entropy as lce  # noqa: E402
from autopar.kernels.linear_cross_entropy import (  # noqa: E402
    linear_cross_entropy,
    linear_cross_entropy_reference,
)

DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]
OP = torch.ops.autopar.linear_cross_entropy
# (label_smoothing, reduction, bias, chunk_rows); chunk_rows 0 = auto (a single chunk here)
OPTIONS = [(0.0, "mean", False, 0), (0.1, "sum", True, 8), (0.25, "mean", True, 5)]


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, bias: bool, ignore_every: int = 4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(v, generator=g)).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[1::ignore_every] = -100
    return x, w, b, t


def _check(fn, n, h, v, dtype, atol, rtol, smoothing, reduction, bias, chunk) -> None:
    x, w, b, t = _inputs(n, h, v, dtype, bias)
    live = [p for p in (x, w, b) if p is not None]
    loss = fn(x, w, t, b, smoothing, reduction, chunk)
    assert loss.dtype == dtype and loss.shape == ()
    got = torch.autograd.grad(3.0 * loss, live)
    ref_in = [p.detach().double().requires_grad_() for p in live]
    x64, w64, b64 = ref_in if bias else (*ref_in, None)
    ref = linear_cross_entropy_reference(x64, w64, t, b64, -100, smoothing, reduction)
    want = torch.autograd.grad(3.0 * ref, ref_in)
    for a, e in zip((loss, *got), (ref, *want), strict=True):
        scale = e.abs().max().item()
        torch.testing.assert_close(a.double(), e, atol=atol * scale, rtol=rtol)


def _op(x, w, t, b, smoothing, reduction, chunk):
    return linear_cross_entropy(
        x, w, t, b, label_smoothing=smoothing, reduction=reduction, chunk_rows=chunk
    )


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("smoothing,reduction,bias,chunk", OPTIONS)
def test_full_gpt2_vocab(smoothing, reduction, bias, chunk, dtype, atol, rtol) -> None:
    assert lce._triton_runs_on(torch.empty(1))  # the Triton kernel, not the fallback
    _check(_op, 37, 19, 50257, dtype, atol, rtol, smoothing, reduction, bias, chunk)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("n,h,v,chunk", [(5, 3, 7, 2), (64, 8, 1000, 16), (1, 1, 2, 0)])
def test_irregular_shapes(n, h, v, chunk, dtype, atol, rtol) -> None:
    _check(_op, n, h, v, dtype, atol, rtol, 0.1, "mean", True, chunk)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_pytorch_fallback_matches(monkeypatch, dtype, atol, rtol) -> None:
    """The pure-PyTorch chunk step (used without Triton) computes the same thing."""
    monkeypatch.setattr(lce, "_triton_runs_on", lambda t: False)
    for smoothing, reduction, bias, chunk in OPTIONS:
        _check(_op, 29, 11, 3001, dtype, atol, rtol, smoothing, reduction, bias, chunk)


def test_no_grad_and_leading_dims() -> None:
    x, w, b, t = _inputs(12, 5, 33, torch.float32, True)
    with torch.no_grad():
        loss = linear_cross_entropy(x.view(3, 4, 5), w, t.view(3, 4), b)
    torch.testing.assert_close(loss, linear_cross_entropy_reference(x, w, t, b))
    _, gx, gw, gb = OP(x, w, b, t, -100, 0.0, "mean", False, 0)
    assert gx.numel() == gw.numel() == gb.numel() == 0
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(x, w, t, reduction="none")


def test_frozen_weight_gets_no_grad() -> None:
    x, w, _, t = _inputs(9, 5, 33, torch.float32, False)
    w.requires_grad_(False)
    linear_cross_entropy(x, w, t).backward()
    assert w.grad is None
    (want,) = torch.autograd.grad(linear_cross_entropy_reference(x, w, t), x)
    torch.testing.assert_close(x.grad, want)


def test_is_one_node_in_forward_and_joint_graphs() -> None:
    x, w, _, t = _inputs(6, 5, 33, torch.float32, False)

    def joint(x, w, t):
        loss = linear_cross_entropy(x, w, t)
        return loss, torch.autograd.grad(loss, (x, w))

    fwd = make_fx(lambda x, w, t: linear_cross_entropy(x, w, t), tracing_mode="fake")(x, w, t)
    calls = [n.target for n in fwd.graph.nodes if n.op == "call_function"]
    assert calls.count(OP.default) == 1
    assert not any("mm" in str(c) or "log_softmax" in str(c) for c in calls), calls
    gm = make_fx(joint, tracing_mode="fake")(x, w, t)
    calls = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert calls.count(OP.default) == 1
    assert not any("mm" in str(c) for c in calls), calls  # backward = scalar multiplies


def test_opcheck() -> None:
    x, w, b, t = _inputs(6, 5, 33, torch.float32, True)
    torch.library.opcheck(OP, (x, w, b, t, -100, 0.1, "mean", True, 4))
