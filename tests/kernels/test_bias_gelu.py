"""autopar::bias_gelu: Triton (interpreter) vs a float64 PyTorch reference.

The reference is ``F.gelu(x + bias, approximate=...)`` in float64 on the same (rounded)
inputs, so the tolerances measure the kernel's fp32 arithmetic and its single output rounding.
bf16: 2e-2 (one bf16 ulp is 2^-8 relative). dbias is a sum over rows, whose fp32 rounding
error grows like sqrt(rows): its atol is ``max(atol, 1e-5 * sqrt(rows))`` (4.3e-4 at 1823
rows).
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
APPROXIMATE = ["none", "tanh"]
OP = torch.ops.autopar.bias_gelu


def _inputs(shape: tuple[int, ...], dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(shape, generator=g)).to(dtype)  # reaches GELU's curved region
    b = (0.5 * torch.randn(shape[-1], generator=g)).to(dtype)
    return x.requires_grad_(), b.requires_grad_()


def _check(fn, shape, dtype, atol, rtol, approximate) -> None:
    x, b = _inputs(shape, dtype)
    y = fn(x, b, approximate)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = torch.autograd.grad(y, (x, b), dy)
    x64, b64 = (t.detach().double().requires_grad_() for t in (x, b))
    y_ref = F.gelu(x64 + b64, approximate=approximate)
    want = torch.autograd.grad(y_ref, (x64, b64), dy.double())
    assert y.dtype == dtype and got[1].dtype == b.dtype
    reduced_atol = max(atol, 1e-5 * math.sqrt(math.prod(shape[:-1])))
    for i, (a, e) in enumerate(zip((y, *got), (y_ref, *want), strict=True)):
        tol = reduced_atol if i == 2 else atol  # dbias: a sum over rows
        torch.testing.assert_close(a.double(), e, atol=tol, rtol=rtol)


@pytest.mark.parametrize("approximate", APPROXIMATE)
@pytest.mark.parametrize(("dtype", "atol", "rtol"), DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, atol, rtol, approximate) -> None:
    _check(OP, shape, dtype, atol, rtol, approximate)


def test_gpu_tiling(monkeypatch) -> None:
    """The GPU's smaller tiles (several tiles per persistent backward program)."""
    monkeypatch.setattr(_rowwise, "INTERPRETER_TILE_ELEMS", _rowwise.TILE_ELEMS)
    assert _rowwise.row_tiling(67, 781).block_m == 4
    _check(OP, (67, 781), torch.float32, 1e-5, 1e-5, "none")


def test_rejects_bad_arguments() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="approximate"):
        OP(x, torch.randn(8), "sigmoid")
    with pytest.raises(ValueError, match="bias shape"):
        OP(x, torch.randn(4, 8))


def test_one_graph_node_each_way() -> None:
    x, b = _inputs((3, 5, 17), torch.float32)

    def step(x, b):
        return torch.autograd.grad((OP(x, b, "tanh").sum(),), (x, b))

    gm = make_fx(step)(x, b)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.autopar.bias_gelu.default) == 1
    assert targets.count(torch.ops.autopar.bias_gelu_backward.default) == 1
    assert not any("gelu" in str(t) and "autopar" not in str(t) for t in targets)


@pytest.mark.parametrize("approximate", APPROXIMATE)
def test_opcheck(approximate) -> None:
    x, b = _inputs((2, 3, 5), torch.float32)
    torch.library.opcheck(OP, (x, b, approximate))
