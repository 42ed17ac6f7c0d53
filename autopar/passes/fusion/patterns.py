"""The fusion pass's table of (pattern, handler): what a fusable region looks like.

Patterns (``PATTERNS``: name, matcher, handler), tried in this order:

* ``add_layer_norm``: ``getitem(native_layer_norm(add(x, r), [C], w, b, eps), 0)``, with
  ``x`` and ``r`` of the same shape and dtype (no broadcast) and only output 0 of the norm
  used. The add's other users (the next residual) read output ``s`` of the fused op; a
  final norm's sum is read nowhere else, and its ``s`` gets no ``getitem`` (the kernels'
  backward then receives ``ds=None``, see ``set_materialize_grads`` in the kernels).
* ``add_rms_norm``: residual add + Llama's RMSNorm as export decomposes it,
  ``mul(type_as(s32 * rsqrt(mean(s32 ** 2, -1, keepdim) + eps)), w)`` with
  ``s32 = s.float()`` and ``s = add(x, r)`` (the casts are absent in fp32). Numerics: the
  kernel multiplies by the weight in fp32 and rounds once (one bf16 ulp from HF's order).
  Its ``s`` is handled as for LayerNorm.
* ``swiglu``: ``mul(silu(a), b)`` where ``silu`` is ``aten.silu`` or its decomposition
  ``mul(a, sigmoid(a))``, single-use, ``a`` and ``b`` of the same shape and dtype.
* ``bias_gelu``: ``gelu(view(addmm(b, x, w)))`` (GPT's MLP up-projection; the view to
  the 3-D activation optional, and keeping the last dim), ``approximate`` "none" or
  "tanh" -> ``bias_gelu(view(mm(x, w)), b, approximate)``: the addmm is swapped for an
  ``mm`` (:attr:`Match.swaps`) and the kernel adds the bias. Numerics: the bias
  is added in fp32 to the rounded matmul (addmm may add it inside the GEMM), one ulp.
* ``linear_cross_entropy``: the head and the loss, ``getitem(nll_loss_forward(
  _log_softmax(views(mm(x, permute(W, [1, 0]))), 1), t, None, mean, ii), 0)`` ->
  ``getitem(linear_cross_entropy(x, W, None, t, ii, 0.0, "sum"), 0) / sum(t != ii)`` (an
  epilogue, :attr:`Match.epilogue`): the kernel's sum is exact under any row sharding and
  the mean's divisor is the global count, so dp needs no assumption on ignored rows.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from autopar._compat import OpOverload
from autopar.passes.fusion.rewrite import Match, Pattern, emit

aten = torch.ops.aten


def _is(node: object, *targets: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _only_users(node: fx.Node, allowed: Sequence[fx.Node]) -> bool:
    return all(u in allowed for u in node.users)


def _residual_add(node: object) -> tuple[fx.Node, fx.Node] | None:
    """``(x, r)`` if ``node`` is ``add(x, r)`` of two tensors of one shape and dtype."""
    if not _is(node, aten.add.Tensor) or node.kwargs.get("alpha", 1) != 1:  # type: ignore[union-attr]
        return None
    if len(node.args) != 2:  # type: ignore[union-attr]
        return None
    x, r = node.args  # type: ignore[union-attr]
    vx, vr, vs = _val(x), _val(r), _val(node)
    if vx is None or vr is None or vs is None or vx.dim() == 0:
        return None
    if vx.shape != vr.shape or vx.shape != vs.shape or not (vx.dtype == vr.dtype == vs.dtype):
        return None
    if not vx.dtype.is_floating_point:
        return None
    return x, r  # type: ignore[return-value]


def _row_param(node: object, n_cols: int) -> bool:
    """None, or a tensor of shape (n_cols,)."""
    if node is None:
        return True
    val = _val(node)
    return val is not None and tuple(val.shape) == (n_cols,)


# ------------------------------------------------------------------ (a) add + LayerNorm


def match_add_layer_norm(node: fx.Node) -> Match | None:
    """``getitem(native_layer_norm(add(x, r), [C], w, b, eps), 0)`` -> ``add_layer_norm``."""
    if node.target is not operator.getitem or node.args[1] != 0:
        return None
    ln = node.args[0]
    if not _is(ln, aten.native_layer_norm.default):
        return None
    s, shape, weight, bias, eps = ln.args  # type: ignore[union-attr]
    xr = _residual_add(s)
    if xr is None:
        return None
    vs = _val(s)
    n_cols = vs.shape[-1]  # type: ignore[union-attr]
    if list(shape) != [n_cols] or not (_row_param(weight, n_cols) and _row_param(bias, n_cols)):
        return None
    outs = list(ln.users)  # type: ignore[union-attr]
    if outs != [node] or _val(node) is None or _val(node).dtype != vs.dtype:  # type: ignore[union-attr]
        return None
    return Match(
        replaced=[s, ln, node],  # type: ignore[list-item]
        outputs=[(node, 0), (s, 1)],  # type: ignore[list-item]
        args=(*xr, weight, bias, float(eps)),
    )


# ------------------------------------------------------------------ (c) add + RMSNorm


def _strip_cast(node: object, dtype: torch.dtype | None = None) -> object:
    """The input of ``_to_copy(x, dtype=...)`` (a pure dtype cast), else ``node``."""
    if not _is(node, aten._to_copy.default) or len(node.args) != 1:  # type: ignore[union-attr]
        return node
    if set(node.kwargs) - {"dtype"}:  # type: ignore[union-attr]
        return node
    if dtype is not None and node.kwargs.get("dtype") != dtype:  # type: ignore[union-attr]
        return node
    return node.args[0]  # type: ignore[union-attr]


def _mul_operands(node: object) -> tuple[object, object] | None:
    if not _is(node, aten.mul.Tensor) or len(node.args) != 2:  # type: ignore[union-attr]
        return None
    return node.args  # type: ignore[union-attr,return-value]


def _rms_normed(nm: object) -> tuple[fx.Node, fx.Node, float, list[fx.Node]] | None:
    """``nm = mul(s32, rsqrt(add(mean(pow(s32, 2), [-1], True), eps)))``:
    ``(s32, rsqrt, eps, chain)`` (``chain``: the statistics nodes, graph order)."""
    ops = _mul_operands(nm)
    if ops is None:
        return None
    for s32, rs in (ops, ops[::-1]):
        if not _is(rs, aten.rsqrt.default) or not isinstance(s32, fx.Node):
            continue
        e = rs.args[0]  # type: ignore[union-attr]
        if not _is(e, aten.add.Tensor) or not isinstance(e.args[1], float):  # type: ignore[union-attr]
            continue
        mean = e.args[0]  # type: ignore[union-attr]
        if not _is(mean, aten.mean.dim) or mean.kwargs.get("dtype") is not None:  # type: ignore[union-attr]
            continue
        p = mean.args[0]  # type: ignore[union-attr]
        vs = _val(s32)
        if vs is None or not _is(p, aten.pow.Tensor_Scalar) or p.args != (s32, 2):  # type: ignore[union-attr]
            continue
        dims, keep = list(mean.args[1]), (mean.args[2] if len(mean.args) > 2 else False)  # type: ignore[union-attr]
        if dims not in ([-1], [vs.dim() - 1]) or not keep:
            continue
        chain = [p, mean, e, rs]
        if all(len(n.users) == 1 for n in chain):  # type: ignore[union-attr]
            return s32, rs, float(e.args[1]), chain  # type: ignore[union-attr,return-value]
    return None


def match_add_rms_norm(node: fx.Node) -> Match | None:
    """Residual add + Llama RMSNorm (``x.float()``, ``type_as`` casts optional) ->
    ``add_rms_norm``. ``node`` is the final ``mul(normed, weight)``."""
    ops = _mul_operands(node)
    vy = _val(node)
    if ops is None or vy is None:
        return None
    for cast, weight in (ops, ops[::-1]):
        if not isinstance(weight, fx.Node) or not isinstance(cast, fx.Node):
            continue
        nm = _strip_cast(cast)
        found = _rms_normed(nm)
        if found is None:
            continue
        s32, _rs, eps, chain = found
        s = _strip_cast(s32, torch.float32)
        xr = _residual_add(s)
        if xr is None:
            continue
        vs = _val(s)
        if vs.dtype != vy.dtype or vy.shape != vs.shape or not _row_param(weight, vs.shape[-1]):  # type: ignore[union-attr]
            continue
        region = [s, *([s32] if s32 is not s else []), *chain, nm]
        region += [*([cast] if cast is not nm else []), node]
        # the fp32 copy, the statistics and the normalized value feed only the region
        if s32 is not s and not _only_users(s32, region):
            continue
        if len(nm.users) != 1 or (cast is not nm and len(cast.users) != 1):  # type: ignore[union-attr]
            continue
        return Match(
            replaced=region,  # type: ignore[arg-type]
            outputs=[(node, 0), (s, 1)],  # type: ignore[list-item]
            args=(*xr, weight, eps),
        )
    return None


# ------------------------------------------------------------------ (b) SwiGLU


def _silu_input(node: object) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(a, nodes)`` if ``node`` computes ``silu(a)`` (``nodes``: the ones it replaces)."""
    if _is(node, aten.silu.default):
        return node.args[0], [node]  # type: ignore[union-attr,return-value]
    ops = _mul_operands(node)
    if ops is None:
        return None
    for a, sig in (ops, ops[::-1]):
        if _is(sig, aten.sigmoid.default) and sig.args[0] is a and len(sig.users) == 1:  # type: ignore[union-attr]
            return a, [sig, node]  # type: ignore[list-item,return-value]
    return None


def match_swiglu(node: fx.Node) -> Match | None:
    """``mul(silu(a), b)`` (either order) with a single-use silu -> ``swiglu(a, b)``."""
    ops = _mul_operands(node)
    vy = _val(node)
    if ops is None or vy is None:
        return None
    for silu, b in (ops, ops[::-1]):
        found = _silu_input(silu)
        if found is None or not isinstance(b, fx.Node) or len(silu.users) != 1:  # type: ignore[union-attr]
            continue
        a, nodes = found
        va, vb = _val(a), _val(b)
        if va is None or vb is None or va.dim() == 0 or not va.dtype.is_floating_point:
            continue
        if not (va.shape == vb.shape == vy.shape and va.dtype == vb.dtype == vy.dtype):
            continue
        return Match(replaced=[*nodes, node], outputs=[(node, None)], args=(a, b))
    return None


# ------------------------------------------------------------------ (d) bias + GELU

_VIEWS = (aten.view.default, aten._unsafe_view.default)


def match_bias_gelu(node: fx.Node) -> Match | None:
    """``gelu(addmm(b, x, w))`` (a view between the two allowed) ->
    ``bias_gelu(mm(x, w), b)``: the linear layer keeps its matmul, the kernel adds the
    bias. The view must keep the last dim (the bias's), single-use addmm and view."""
    if not _is(node, aten.gelu.default) or len(node.args) != 1:
        return None
    approximate = node.kwargs.get("approximate", "none")
    view, mm = None, node.args[0]
    if _is(mm, *_VIEWS) and len(mm.users) == 1:  # type: ignore[union-attr]
        view, mm = mm, mm.args[0]  # type: ignore[union-attr]
    if not _is(mm, aten.addmm.default) or mm.kwargs or len(mm.users) != 1:  # type: ignore[union-attr]
        return None
    bias, a, b = mm.args  # type: ignore[union-attr]
    vb, vmm, vy = _val(bias), _val(mm), _val(node)
    if approximate not in ("none", "tanh") or vb is None or vmm is None or vy is None:
        return None
    if vb.dim() != 1 or vmm.dim() != 2 or not vb.dtype.is_floating_point:
        return None
    if vb.shape[0] != vmm.shape[-1] or vy.shape[-1] != vmm.shape[-1] or vb.dtype != vy.dtype:
        return None
    x = view if view is not None else mm
    return Match(
        replaced=[node],
        outputs=[(node, None)],
        args=(x, bias, approximate),
        swaps=[(mm, aten.mm.default, (a, b))],  # type: ignore[list-item]
    )


# ------------------------------------------------------------------ (e) linear + cross-entropy


def _logits_mm(logits: object) -> tuple[fx.Node, list[fx.Node]] | None:
    """``(mm, views)`` if ``logits`` is single-use views of ``mm(x, permute(W, [1, 0]))``
    keeping its 2-D shape (``views``: from the logits back to the mm)."""
    views, z = [], logits
    while _is(z, *_VIEWS) and len(z.users) == 1:  # type: ignore[union-attr]
        views.append(z)
        z = z.args[0]  # type: ignore[union-attr]
    if not _is(z, aten.mm.default) or len(z.users) != 1 or _val(z) is None:  # type: ignore[union-attr]
        return None
    if _val(z).shape != _val(logits).shape:  # type: ignore[union-attr]
        return None
    wt = z.args[1]  # type: ignore[union-attr]
    if not _is(wt, aten.permute.default) or list(wt.args[1]) != [1, 0] or len(wt.users) != 1:  # type: ignore[union-attr]
        return None
    return z, views  # type: ignore[return-value]


def match_linear_cross_entropy(node: fx.Node) -> Match | None:
    """``getitem(nll_loss_forward(_log_softmax(views(mm(x, W^T)), 1), t, None, mean, ii), 0)``
    -> ``getitem(linear_cross_entropy(x, W, None, t, ii, 0, "sum"), 0) / sum(t != ii)``.

    The kernel sums (its gradients are per-row, unscaled) and the mean's division stays a
    graph op: when rows are sharded the kernel's sum is a ``Partial`` and the divisor the
    global count of counted rows, so value and gradients are exact for any sharding."""
    if node.target is not operator.getitem or node.args[1] != 0:
        return None
    nll = node.args[0]
    if not _is(nll, aten.nll_loss_forward.default) or list(nll.users) != [node]:  # type: ignore[union-attr]
        return None
    logp, target, weight, reduction, ignore_index = nll.args  # type: ignore[union-attr]
    if weight is not None or reduction != 1 or not _is(logp, aten._log_softmax.default):
        return None
    logits, dim, half_to_float = logp.args  # type: ignore[union-attr]
    vz, vt = _val(logits), _val(target)
    if vz is None or vt is None or vz.dim() != 2 or dim not in (1, -1) or half_to_float:
        return None
    found = _logits_mm(logits)
    if found is None or len(logp.users) != 1 or vt.shape != vz.shape[:1]:  # type: ignore[union-attr]
        return None
    mm, views = found
    x, wt = mm.args
    if _val(x) is None or _val(x).dtype != vz.dtype:  # type: ignore[union-attr]
        return None

    def mean(graph: fx.Graph, total: fx.Node) -> fx.Node:
        counted = emit(graph, aten.ne.Scalar, (target, ignore_index), node)
        count = emit(graph, aten.sum.default, (counted,), node)
        return emit(graph, aten.div.Tensor, (total, count), node)

    return Match(
        replaced=[wt, mm, *reversed(views), logp, nll, node],  # type: ignore[list-item]
        outputs=[(node, 0)],
        args=(x, wt.args[0], None, target, ignore_index, 0.0, "sum", True, 0),  # type: ignore[union-attr]
        epilogue=mean,
    )


def _op(name: str) -> Callable[[], OpOverload]:
    return lambda: getattr(torch.ops.autopar, name).default


PATTERNS: list[Pattern] = [
    Pattern("add_layer_norm", match_add_layer_norm, _op("add_layer_norm")),
    Pattern("add_rms_norm", match_add_rms_norm, _op("add_rms_norm")),
    Pattern("swiglu", match_swiglu, _op("swiglu")),
    Pattern("bias_gelu", match_bias_gelu, _op("bias_gelu")),
    Pattern("linear_cross_entropy", match_linear_cross_entropy, _op("linear_cross_entropy")),
]
