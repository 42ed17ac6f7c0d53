"""autopar::add_rms_norm: Triton (interpreter) vs a float64 PyTorch reference.

The reference runs in float64 on the same (rounded) inputs. Since the contract says ``y``
normalizes the returned ``s`` (``x + residual`` rounded to the input dtype), the reference
normalizes the kernel's ``s`` through a straight-through estimator, and ``s`` itself is
compared with ``x + residual``: the tolerances then measure the kernel's fp32 arithmetic and
output rounding, not the backend's rounding mode (Triton's interpreter truncates
fp32 -> bf16 where a GPU rounds to nearest even). bf16: 2e-2 (one bf16 ulp is 2^-8
relative; every output is rounded once from fp32).

dweight is a sum over rows, whose fp32 rounding error grows like sqrt(rows): its atol is
``max(atol, 1e-5 * sqrt(rows))`` (4.3e-4 at 1823 rows), as for add_layer_norm.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (ENVIRONMENT.md)

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from autopar.kernels import _rowwise  # noqa: E402

SHAPES = [(1823, 781), (3, 7, 129), (5, 1)]
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]
EPS = 1e-6
OP = torch.ops.autopar.add_rms_norm
BACKWARD = torch.ops.autopar.add_rms_norm_backward


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, weight: bool = True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype) if weight else None
    return [t.requires_grad_() if t is not None else None for t in (x, r, w)]


def _reference(x, r, w, s_kernel: torch.Tensor):
    s = x + r
    s = s + (s_kernel.double() - s).detach()  # normalize the kernel's rounded s
    y = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + EPS)
    return (y * w if w is not None else y), s


def _check(fn, shape, dtype, atol, rtol, weight=True, with_ds=True) -> None:
    inputs = _inputs(shape, dtype, weight)
    y, s = fn(*inputs, EPS)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(shape, generator=g).to(dtype)
    ds = torch.randn(shape, generator=g).to(dtype)
    outs, grads = ((y, s), (dy, ds)) if with_ds else ((y,), (dy,))
    got = torch.autograd.grad(outs, [t for t in inputs if t is not None], grads)
    ref_in = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    y_ref, s_ref = _reference(*ref_in, s.detach())
    ref_outs = (y_ref, s_ref)[: len(outs)]
    ref_grads = [t.double() for t in grads]
    want = torch.autograd.grad(ref_outs, [t for t in ref_in if t is not None], ref_grads)
    assert y.dtype == s.dtype == dtype
    reduced_atol = max(atol, 1e-5 * math.sqrt(math.prod(shape[:-1])))
    s_exact = (ref_in[0] + ref_in[1]).detach()
    for i, (a, e) in enumerate(zip((y, s, *got), (y_ref, s_exact, *want), strict=True)):
        tol = reduced_atol if i >= 4 else atol  # dweight: a sum over rows
        torch.testing.assert_close(a.double(), e, atol=tol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, atol, rtol) -> None:
    _check(OP, shape, dtype, atol, rtol)


def test_no_weight() -> None:
    _check(OP, (3, 7, 129), torch.float32, 1e-5, 1e-5, weight=False)


def test_llama_rounding_within_one_ulp() -> None:
    """HF Llama rounds x_hat to bf16 before the weight multiply; we round once."""
    x, r, w = (t.detach() for t in _inputs((3, 7, 129), torch.bfloat16))
    y, s = OP(x, r, w, EPS)
    h = s.float()
    llama = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(torch.bfloat16)
    torch.testing.assert_close(y, llama, atol=2e-2, rtol=2e-2)


def test_only_y_used() -> None:
    """s unused downstream (autograd hands the op None); ds=None skips the load."""
    _check(OP, (3, 7, 129), torch.float32, 1e-5, 1e-5, with_ds=False)
    x, r, w = (t.detach() for t in _inputs((3, 7, 129), torch.float32))
    dy = torch.randn_like(x)
    with_none = BACKWARD(dy, None, x + r, w, EPS)
    with_zeros = BACKWARD(dy, torch.zeros_like(x), x + r, w, EPS)
    for a, e in zip(with_none, with_zeros, strict=True):
        torch.testing.assert_close(a, e, atol=0, rtol=0)


def test_unused_sum_gradient_is_not_materialized() -> None:
    """A final norm's sum is read nowhere else: its gradient reaches the backward op as
    None (no zeros tensor, which under DTensor would be a plain tensor beside DTensors)."""
    x, r, w = _inputs((3, 5, 17), torch.float32)[:3]

    def only_y(x, r, w):
        y, _ = OP(x, r, w, EPS)
        return torch.autograd.grad((y.sum(),), (x, r, w))

    gm = make_fx(only_y)(x, r, w)
    (bwd,) = [n for n in gm.graph.nodes if n.target is BACKWARD.default]
    assert bwd.args[1] is None
    assert not any("zeros" in str(n.target) for n in gm.graph.nodes)


def test_one_output_used() -> None:
    """Either output alone: only ``y`` matches the op with both used and ``ds = 0``; only
    ``s`` gives ``dx = dresidual = ds`` and no weight gradient."""
    x, r, w = _inputs((3, 5, 17), torch.float32)[:3]
    y, s = OP(x, r, w, EPS)
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y,), (x, r, w), (dy,))
    y, s = OP(x, r, w, EPS)
    want = torch.autograd.grad((y, s), (x, r, w), (dy, torch.zeros_like(s)))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, atol=0, rtol=0)
    y, s = OP(x, r, w, EPS)
    ds = torch.randn_like(s)
    dx, dr, dw = torch.autograd.grad((s,), (x, r, w), (ds,), allow_unused=True)
    torch.testing.assert_close(dx, ds, atol=0, rtol=0)
    torch.testing.assert_close(dr, ds, atol=0, rtol=0)
    assert dw is None or not dw.any()


def test_gpu_tiling(monkeypatch) -> None:
    """The GPU's smaller tiles (several tiles per persistent backward program)."""
    monkeypatch.setattr(_rowwise, "INTERPRETER_TILE_ELEMS", _rowwise.TILE_ELEMS)
    assert _rowwise.row_tiling(67, 781).block_m == 4
    _check(OP, (67, 781), torch.float32, 1e-5, 1e-5)


def test_rejects_mismatched_inputs() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="must match"):
        OP(x, x.bfloat16(), None, EPS)
    with pytest.raises(ValueError, match="weight shape"):
        OP(x, x, torch.randn(9), EPS)


def test_one_graph_node_each_way() -> None:
    x, r, w = _inputs((3, 5, 17), torch.float32)

    def step(x, r, w):
        y, s = OP(x, r, w, EPS)
        return torch.autograd.grad((y.sum() + s.square().sum(),), (x, r, w))

    gm = make_fx(step)(x, r, w)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.autopar.add_rms_norm.default) == 1
    assert targets.count(torch.ops.autopar.add_rms_norm_backward.default) == 1
    assert torch.ops.aten.rsqrt.default not in targets


def test_opcheck() -> None:
    x, r, w = _inputs((2, 3, 5), torch.float32)
    torch.library.opcheck(OP, (x, r, w, EPS))
    torch.library.opcheck(OP, (x, r, None, EPS))
