"""Which stored tensors may be split as ``_StridedShard``: the weights of fused projections.

A fused projection computes several tensors in one matmul and splits them apart after:
GPT's ``c_attn`` makes ``[B, S, 3d]`` and splits q, k and v off its last dim; a fused
gate/up projection splits two halves. Capture rewrites such an equal split into a view that
unflattens the dim into ``(k, n)`` pieces (:mod:`autopar.capture.splits`). Splitting the
``n`` dim over an axis -- Megatron's column-parallel QKV, each rank computing its heads' q,
k and v -- is, on the fused ``k * n`` dim and on every tensor it comes from (the matmul's
output, the transposed weight, the weight, the bias), DTensor's ``_StridedShard(dim,
split_factor=k)``: rank ``r`` holds rows ``r`` of each of the ``k`` pieces.

:func:`strided_hints` walks up from every such unflattening view, through the ops that
carry the dim unchanged (views that keep it, transposes, the output columns of
``mm``/``addmm`` back to the weight's and the bias's, pointwise ops and casts), to the
placeholders, and returns ``{node: {(dim, k)}}`` for every tensor on the way: the
strided storage specs the strategy stage adds to those placeholders
(:func:`~autopar.passes.strategies.enumerate.storage_specs`). Ops between them get
strided strategies from DTensor's own rules, a rule's shards instantiated as strided ones
where an input is offered one (:func:`autopar.passes.strategies.from_dtensor.
single_dim_strategies`), and from its strategy functions (views follow their input).
:func:`kept` drops every other strategy with a strided spec (DTensor's view strategy
also makes some of its own, e.g. where a batch shard is unflattened): only these tensors
get the extra choices, so the search grows by a few strategies per fused projection.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.fx as fx

from autopar._compat import OpOverload, StridedShard
from autopar.passes.strategies.spec import NodeStrategy, tensor_inputs

aten = torch.ops.aten
Hints = dict[fx.Node, set[tuple[int, int]]]
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
_MAX_DEPTH = 16  # ops walked up from one view


def _shape(n: object) -> tuple[int, ...] | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def unflattened(node: fx.Node) -> tuple[int, int] | None:
    """``(dim, k)`` when ``node`` is a view splitting its input's ``dim`` into ``(k, n)``,
    ``k >= 2``, every other dim unchanged, whose pieces are then unbound (an equal split,
    :mod:`autopar.capture.splits`). Other unflattening views (tokens back into batch and
    sequence, heads out of the hidden dim) are left to DTensor's view strategy."""
    if node.op != "call_function" or node.target not in _VIEWS:
        return None
    if not node.users or any(u.target is not aten.unbind.int for u in node.users):
        return None
    src, out = _shape(node.args[0]), _shape(node)
    if src is None or out is None or len(out) != len(src) + 1:
        return None
    for d in range(len(src)):
        if src[:d] == out[:d] and src[d + 1 :] == out[d + 2 :] and out[d] >= 2:
            if out[d] * out[d + 1] == src[d]:
                return d, out[d]
    return None


def _view_source_dim(node: fx.Node, dim: int) -> int | None:
    src, out = _shape(node.args[0]), _shape(node)
    assert src is not None and out is not None
    before = math.prod(out[:dim])
    for d in range(len(src)):
        if math.prod(src[:d]) == before and src[d] == out[dim]:
            return d
    return None


def _sources(node: fx.Node, dim: int) -> Iterator[tuple[fx.Node, int]]:
    """The ``(input, its dim)`` pairs that ``node``'s output ``dim`` comes from, unchanged."""
    target, args = node.target, node.args
    if target in _VIEWS:
        d = _view_source_dim(node, dim)
        if d is not None:
            yield args[0], d
    elif target is aten.t.default:
        yield args[0], 1 - dim
    elif target is aten.permute.default:
        yield args[0], list(args[1])[dim] % len(args[1])
    elif target is aten.transpose.int:
        ndim = len(_shape(node) or ())
        a, b = args[1] % ndim, args[2] % ndim
        yield args[0], b if dim == a else a if dim == b else dim
    elif target in (aten.mm.default, aten.addmm.default):
        *bias, a, b = args[:3] if target is aten.addmm.default else args[:2]
        yield (b, 1) if dim == 1 else (a, 0)
        yield from _broadcast(node, dim, bias)
    elif isinstance(target, OpOverload) and torch.Tag.pointwise in target.tags:
        yield from _broadcast(node, dim, args)


def _broadcast(node: fx.Node, dim: int, inputs) -> Iterator[tuple[fx.Node, int]]:
    """Inputs broadcast against ``node``'s output whose own dim is ``dim``, right-aligned."""
    out = _shape(node)
    assert out is not None
    for inp in inputs:
        shape = _shape(inp)
        if shape is None:
            continue
        d = dim - (len(out) - len(shape))
        if d >= 0 and shape[d] == out[dim]:
            yield inp, d


def strided_hints(gm: fx.GraphModule) -> Hints:
    """``{node: {(dim, k)}}``: the tensors that may be ``SS(dim:k)`` (module docstring)."""
    hints: Hints = {}
    for node in gm.graph.nodes:
        found = unflattened(node)
        if found is None:
            continue
        dim, k = found
        frontier, seen = [(node.args[0], dim)], set()
        for _ in range(_MAX_DEPTH):
            nxt = []
            for n, d in frontier:
                if (n, d) in seen or not isinstance(n, fx.Node):
                    continue
                seen.add((n, d))
                hints.setdefault(n, set()).add((d, k))
                if n.op == "call_function":
                    nxt.extend(_sources(n, d))
            frontier = nxt
    return hints


def _strided(spec) -> bool:
    return spec is not None and any(type(p) is StridedShard for p in spec)


def _allowed(spec, allowed: set[tuple[int, int]]) -> bool:
    return all((p.dim, p.split_factor) in allowed for p in spec if type(p) is StridedShard)


def kept(node: fx.Node, strategies: list[NodeStrategy], hints: Hints) -> list[NodeStrategy]:
    """``strategies`` less those placing a strided shard where ``hints`` do not allow one:
    on ``node``'s outputs unless ``node`` is hinted, on an input unless its producer is."""
    if not any(_strided(sp) for s in strategies for sp in (*s.inputs, *s.outputs)):
        return strategies
    none: set[tuple[int, int]] = set()
    outs, ins = hints.get(node, none), [hints.get(p, none) for p in tensor_inputs(node)]
    return [
        s
        for s in strategies
        if all(not _strided(sp) or _allowed(sp, outs) for sp in s.outputs)
        and all(not _strided(sp) or _allowed(sp, a) for sp, a in zip(s.inputs, ins, strict=True))
    ]
