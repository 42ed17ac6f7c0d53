"""autopar::swiglu: Triton (interpreter) vs a float64 PyTorch reference.

The reference is ``F.silu(a) * b`` in float64 on the same (rounded) inputs, so the
tolerances measure the kernel's fp32 arithmetic and its single output rounding. bf16: 2e-2
(one bf16 ulp is 2^-8 relative). No output is a reduction over rows.
"""

from __future__ import annotations

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
OP = torch.ops.autopar.swiglu


def _inputs(shape: tuple[int, ...], dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    a = (2 * torch.randn(shape, generator=g)).to(dtype)
    b = torch.randn(shape, generator=g).to(dtype)
    return a.requires_grad_(), b.requires_grad_()


def _check(fn, shape, dtype, atol, rtol) -> None:
    a, b = _inputs(shape, dtype)
    y = fn(a, b)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(y, (a, b), dy)
    a64, b64 = (t.detach().double().requires_grad_() for t in (a, b))
    y_ref = F.silu(a64) * b64
    want = torch.autograd.grad(y_ref, (a64, b64), dy.double())
    assert y.dtype == dtype
    for got_t, want_t in zip((y, *got), (y_ref, *want), strict=True):
        torch.testing.assert_close(got_t.double(), want_t, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, atol, rtol) -> None:
    _check(OP, shape, dtype, atol, rtol)


def test_gpu_tiling(monkeypatch) -> None:
    """The GPU's smaller tiles (many programs, masked last tile)."""
    monkeypatch.setattr(_rowwise, "INTERPRETER_TILE_ELEMS", _rowwise.TILE_ELEMS)
    assert _rowwise.row_tiling(67, 781).block_m == 4
    _check(OP, (67, 781), torch.float32, 1e-5, 1e-5)


def test_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match="must match"):
        OP(torch.randn(4, 8), torch.randn(4, 9))


def test_one_graph_node_each_way() -> None:
    a, b = _inputs((3, 5, 17), torch.float32)

    def step(a, b):
        return torch.autograd.grad((OP(a, b).sum(),), (a, b))

    gm = make_fx(step)(a, b)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.autopar.swiglu.default) == 1
    assert targets.count(torch.ops.autopar.swiglu_backward.default) == 1
    assert torch.ops.aten.sigmoid.default not in targets


def test_opcheck() -> None:
    a, b = _inputs((2, 3, 5), torch.float32)
    torch.library.opcheck(OP, (a, b))
    strided = torch.randn(2, 3, 10)[..., ::2]  # non-contiguous: outputs are contiguous
    torch.library.opcheck(OP, (strided, strided.mT.contiguous().mT))
