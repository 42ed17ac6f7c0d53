"""Equal splits as unflatten + unbind, so that a fused projection can be split column-wise.

``unflatten_equal_splits(gm)`` rewrites every ``split`` / ``split_with_sizes`` of a dim of
size ``k * n`` into ``k`` pieces of ``n`` (``qkv.split(d, dim=-1)``, ``torch.chunk``) as

    v = x.view(*shape[:dim], k, n, *shape[dim + 1:])
    pieces = v.unbind(dim)

The same views of the same memory, so every number is unchanged. What it adds is a dim
a plan can split: the fused QKV projection's output ``[B, S, 3d]`` column-split the way
Megatron does (each rank computing its heads' q, k and v) is, on the split dim,
``_StridedShard(dim, split_factor=3)`` -- a layout DTensor's ``split`` strategy gathers,
while its ``view`` turns it into ``Shard`` on the ``n`` dim of ``[B, S, 3, d]``, which
``unbind`` keeps (and in backward ``stack`` and the inverse view bring the gradients back
to the strided layout). :mod:`autopar.passes.strategies.strided` offers that layout to
the parameters that produce such a dim.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
SPLITS = (aten.split.Tensor, aten.split_with_sizes.default)


def _equal_pieces(node: fx.Node) -> tuple[int, int, int] | None:
    """``(dim, k, n)`` when ``node`` splits a dim into ``k >= 2`` pieces of ``n``."""
    if node.op != "call_function" or node.target not in SPLITS:
        return None
    val = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    dim = dim % val.ndim
    size = int(val.shape[dim])
    if node.target is aten.split.Tensor:
        n = int(node.args[1])
        sizes = [n] * (-(-size // n)) if n > 0 else []
    else:
        sizes = [int(s) for s in node.args[1]]
    if len(sizes) < 2 or len(set(sizes)) != 1 or sizes[0] * len(sizes) != size:
        return None
    if any(u.target is not operator.getitem for u in node.users):
        return None
    return dim, len(sizes), sizes[0]


def unflatten_equal_splits(gm: fx.GraphModule) -> int:
    """Rewrite the equal splits of ``gm`` in place (module docstring); how many."""
    count = 0
    for node in list(gm.graph.nodes):
        found = _equal_pieces(node)
        if found is None:
            continue
        dim, k, n = found
        x = node.args[0]
        xval = x.meta["val"]
        shape = [*xval.shape[:dim], k, n, *xval.shape[dim + 1 :]]
        with gm.graph.inserting_before(node):
            view = gm.graph.call_function(aten.view.default, (x, shape))
            unbind = gm.graph.call_function(aten.unbind.int, (view, dim))
        for new in (view, unbind):
            new.meta.update({key: node.meta[key] for key in node.meta if key != "val"})
        view.meta["val"] = xval.view(shape)
        unbind.meta["val"] = tuple(view.meta["val"].unbind(dim))
        node.replace_all_uses_with(unbind)
        gm.graph.erase_node(node)
        count += 1
    if count:
        gm.recompile()
    return count
