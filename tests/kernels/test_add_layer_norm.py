"""autopar::add_layer_norm: Triton (interpreter) vs a float64 PyTorch reference.

The reference runs in float64 on the same (rounded) inputs. Since the contract says ``y``
normalizes the returned ``s`` (``x + residual`` rounded to the input dtype), the reference
normalizes the kernel's ``s`` through a straight-through estimator, and ``s`` itself is
compared with ``x + residual``: the tolerances then measure the kernel's fp32 arithmetic and
output rounding, not the backend's rounding mode (Triton's interpreter truncates
fp32 -> bf16 where a GPU rounds to nearest even). bf16: 2e-2 (one bf16 ulp is 2^-8
relative; every output is rounded once from fp32).

dweight and dbias are sums over rows, whose fp32 rounding error grows like sqrt(rows): their
atol is ``max(atol, 1e-5 * sqrt(rows))`` (4.3e-4 at 1823 rows). On (1823, 781) fp32 the
kernel is 3e-5 from float64 there, torch's own fp32 LayerNorm backward 1.6e-4.
"""

from __future__ import annotations

import math
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (ENVIRONMENT.md)

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from autopar.kernels import _rowwise  # noqa: E402

SHAPES = [(1823, 781), (3, 7, 129), (5, 1)]
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]
EPS = 1e-5
OP = torch.ops.autopar.add_layer_norm
BACKWARD = torch.ops.autopar.add_layer_norm_backward


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, affine: tuple[bool, bool] = (True, True)):
    g = torch.Generator().manual_seed(0)
    n = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(n, generator=g)).to(dtype) if affine[0] else None
    b = (0.2 * torch.randn(n, generator=g)).to(dtype) if affine[1] else None
    return [t.requires_grad_() if t is not None else None for t in (x, r, w, b)]


def _rows(shape: tuple[int, ...]) -> int:
    return math.prod(shape[:-1])


def _reference(x, r, w, b, s_kernel: torch.Tensor):
    s = x + r
    s = s + (s_kernel.double() - s).detach()  # normalize the kernel's rounded s
    return F.layer_norm(s, (x.shape[-1],), w, b, EPS), s


def _check(fn, shape, dtype, atol, rtol, affine=(True, True), with_ds=True) -> None:
    inputs = _inputs(shape, dtype, affine)
    y, s = fn(*inputs, EPS)
    g = torch.Generator().manual_seed(1)
    dy = torch.randn(shape, generator=g).to(dtype)
    ds = torch.randn(shape, generator=g).to(dtype) if with_ds else None
    live = [t for t in inputs if t is not None]
    outs, grads = ((y, s), (dy, ds)) if with_ds else ((y,), (dy,))
    got = torch.autograd.grad(outs, live, grads)
    ref_in = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    y_ref, s_ref = _reference(*ref_in, s.detach())
    ref_outs = (y_ref, s_ref) if with_ds else (y_ref,)
    ref_grads = [t.double() for t in grads]
    want = torch.autograd.grad(ref_outs, [t for t in ref_in if t is not None], ref_grads)
    assert y.dtype == s.dtype == dtype
    reduced_atol = max(atol, 1e-5 * math.sqrt(_rows(shape)))
    s_exact = (ref_in[0] + ref_in[1]).detach()
    for i, (a, e) in enumerate(zip((y, s, *got), (y_ref, s_exact, *want), strict=True)):
        tol = reduced_atol if i >= 4 else atol  # dweight, dbias: sums over rows
        torch.testing.assert_close(a.double(), e, atol=tol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, atol, rtol) -> None:
    _check(OP, shape, dtype, atol, rtol)


@pytest.mark.parametrize("affine", [(False, False), (True, False), (False, True)])
def test_optional_weight_bias(affine) -> None:
    _check(OP, (3, 7, 129), torch.float32, 1e-5, 1e-5, affine=affine)


def test_only_y_used() -> None:
    """s unused downstream (autograd hands the op None); ds=None skips the load."""
    _check(OP, (3, 7, 129), torch.float32, 1e-5, 1e-5, with_ds=False)
    x, r, w, _ = (t.detach() for t in _inputs((3, 7, 129), torch.float32))
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
        y, _ = OP(x, r, w, None, EPS)
        return torch.autograd.grad((y.sum(),), (x, r, w))

    gm = make_fx(only_y)(x, r, w)
    (bwd,) = [n for n in gm.graph.nodes if n.target is BACKWARD.default]
    assert bwd.args[1] is None
    assert not any("zeros" in str(n.target) for n in gm.graph.nodes)


def test_one_output_used() -> None:
    """Either output alone: only ``y`` matches the op with both used and ``ds = 0``; only
    ``s`` gives ``dx = dresidual = ds`` and no weight gradient."""
    x, r, w = _inputs((3, 5, 17), torch.float32)[:3]
    y, s = OP(x, r, w, None, EPS)
    dy = torch.randn_like(y)
    got = torch.autograd.grad((y,), (x, r, w), (dy,))
    y, s = OP(x, r, w, None, EPS)
    want = torch.autograd.grad((y, s), (x, r, w), (dy, torch.zeros_like(s)))
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, atol=0, rtol=0)
    y, s = OP(x, r, w, None, EPS)
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
        OP(x, torch.randn(4, 9), None, None, EPS)
    with pytest.raises(ValueError, match="weight shape"):
        OP(x, x, torch.randn(9), None, EPS)
    with pytest.raises(ValueError, match="bias shape"):
        OP(x, x, None, torch.randn(8, 1), EPS)


def test_no_rows() -> None:
    """Zero rows: empty outputs, and zero (not uninitialized) weight and bias gradients."""
    x, r, w, b = _inputs((0, 3, 17), torch.bfloat16)
    y, s = OP(x, r, w, b, EPS)
    assert y.shape == s.shape == x.shape and y.dtype == torch.bfloat16
    dx, dr, dw, db = torch.autograd.grad((y, s), (x, r, w, b), (y, s))
    assert dx.shape == dr.shape == x.shape
    assert dw.dtype == db.dtype == torch.bfloat16 and not dw.any() and not db.any()


def test_one_graph_node_each_way() -> None:
    x, r, w, b = _inputs((3, 5, 17), torch.float32)

    def step(x, r, w, b):
        y, s = OP(x, r, w, b, EPS)
        return torch.autograd.grad((y.sum() + s.square().sum(),), (x, r, w, b))

    gm = make_fx(step)(x, r, w, b)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.autopar.add_layer_norm.default) == 1
    assert targets.count(torch.ops.autopar.add_layer_norm_backward.default) == 1
    assert not any("layer_norm" in str(t) and "autopar" not in str(t) for t in targets)


class _Block(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(n)

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return OP(x, r, self.norm.weight, self.norm.bias, EPS)


def test_export_keeps_one_node() -> None:
    ep = torch.export.export(_Block(17), (torch.randn(2, 17), torch.randn(2, 17)), strict=False)
    ops = [n.target for n in ep.run_decompositions().graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.autopar.add_layer_norm.default) == 1
    assert all(t is torch.ops.autopar.add_layer_norm.default or "getitem" in str(t) for t in ops)


def test_opcheck() -> None:
    x, r, w, b = _inputs((2, 3, 5), torch.float32)
    torch.library.opcheck(OP, (x, r, w, b, EPS))
    torch.library.opcheck(OP, (x, r, None, None, EPS))
    strided = torch.randn(2, 3, 10)[..., ::2]  # non-contiguous: outputs are contiguous
    torch.library.opcheck(OP, (strided, strided.clone(), w, b, EPS))
