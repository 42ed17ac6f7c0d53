"""autopar::rope: Triton (interpreter) vs a float64 PyTorch reference over irregular shapes.

The reference is :func:`rope_reference` in float64 on the same (rounded) inputs, so the
tolerances measure the kernel's fp32 arithmetic and one rounding of the output: fp32 1e-5,
bf16 2e-2 (one bf16 ulp is 2^-8 relative; values are O(1)). Head dims are small and odd
multiples of 2 (2, 6, 18) and sequence lengths 7..33 so that every block is masked.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported (ENVIRONMENT.md)

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from autopar.kernels.rope import rope, rope_reference  # noqa: E402

# (B, H, Hkv, T, D)
SHAPES = [(2, 4, 2, 7, 6), (1, 3, 1, 33, 18), (3, 1, 1, 13, 2)]
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2e-2, 2e-2)]
OP = torch.ops.autopar.rope


def _tables(seq_len: int, dim: int, random: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-style cos/sin tables [T, D] (or arbitrary ones, to test the general formula)."""
    if random:
        g = torch.Generator().manual_seed(2)
        return torch.randn(seq_len, dim, generator=g), torch.randn(seq_len, dim, generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _qk(shape, dtype: torch.dtype, strided: bool) -> tuple[torch.Tensor, torch.Tensor]:
    b, h, hkv, t, d = shape
    g = torch.Generator().manual_seed(0)
    if strided:  # q as the transpose of a [B, T, H, D] projection output
        q = torch.randn(b, t, h, d, generator=g).to(dtype).transpose(1, 2)
    else:
        q = torch.randn(b, h, t, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, t, d, generator=g).to(dtype)
    return q.requires_grad_(), k.requires_grad_()


def _check(fn, shape, dtype, atol, rtol, strided=False, random_tables=False) -> None:
    q, k = _qk(shape, dtype, strided)
    cos, sin = _tables(shape[3], shape[4], random_tables)
    q_out, k_out = fn(q, k, cos, sin)
    assert q_out.dtype == k_out.dtype == dtype and q_out.is_contiguous()
    g = torch.Generator().manual_seed(1)
    dq = torch.randn(q_out.shape, generator=g).to(dtype)
    dk = torch.randn(k_out.shape, generator=g).to(dtype)
    got = torch.autograd.grad((q_out, k_out), (q, k), (dq, dk))
    q64, k64 = (t.detach().double().requires_grad_() for t in (q, k))
    ref = rope_reference(q64, k64, cos.double(), sin.double())
    want = torch.autograd.grad(ref, (q64, k64), (dq.double(), dk.double()))
    for a, e in zip((q_out, k_out, *got), (*ref, *want), strict=True):
        torch.testing.assert_close(a.double(), e, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rope_matches_reference(shape, dtype, atol, rtol) -> None:
    _check(rope, shape, dtype, atol, rtol)


@pytest.mark.parametrize("dtype,atol,rtol", DTYPES)
def test_rope_strided_q(dtype, atol, rtol) -> None:
    for shape in SHAPES[:2]:
        _check(rope, shape, dtype, atol, rtol, strided=True)


def test_rope_general_tables() -> None:
    """cos/sin halves that differ: the backward is the transpose, not just a -theta rotation."""
    _check(rope, SHAPES[0], torch.float32, 1e-5, 1e-5, random_tables=True)


def test_rope_broadcast_tables_and_errors() -> None:
    q, k = _qk(SHAPES[0], torch.float32, False)
    cos, sin = _tables(7, 6)
    a, b = rope(q, k, cos[None, None], sin[None, None])
    ra, rb = rope_reference(q, k, cos, sin)
    torch.testing.assert_close((a, b), (ra, rb))
    with pytest.raises(ValueError, match="even"):
        rope(q[..., :5], k[..., :5], cos[:, :5], sin[:, :5])
    with pytest.raises(ValueError, match="cos"):
        rope(q, k, cos[:3], sin)


def test_rope_is_one_node_in_forward_and_joint_graphs() -> None:
    q, k = _qk(SHAPES[0], torch.float32, False)
    cos, sin = _tables(7, 6)

    def joint(q, k, cos, sin, dq, dk):
        outs = rope(q, k, cos, sin)
        return outs, torch.autograd.grad(outs, (q, k), (dq, dk))

    fwd = make_fx(rope, tracing_mode="fake")(q, k, cos, sin)
    calls = [n.target for n in fwd.graph.nodes if n.op == "call_function"]
    assert calls.count(OP.default) == 1
    assert all(t == OP.default or "getitem" in str(t) for t in calls), calls
    gm = make_fx(joint, tracing_mode="fake")(q, k, cos, sin, q.detach(), k.detach())
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(OP.default) == 1
    assert targets.count(torch.ops.autopar.rope_backward.default) == 1


def test_rope_opcheck() -> None:
    q, k = _qk((1, 2, 1, 3, 4), torch.float32, False)
    cos, sin = _tables(3, 4)
    torch.library.opcheck(OP, (q, k, cos, sin))
