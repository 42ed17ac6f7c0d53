"""The loss's normalizer, counted from the targets and all-reduced at the program's start.

`hoist_loss_weight(graph) -> int` (run by `passes.comm.optimize_comm` before scheduling)

A mean cross-entropy over a batch sharded across ranks divides by the number of targets
counted on all of them: `nll_loss_forward` returns that count on this rank's rows (its
`total_weight`), the lowered program all-reduces it, and `nll_loss_backward` reads the sum.
As traced, the all-reduce is issued after the forward's last op and waited at the
backward's first: every rank stops there until the slowest has finished its forward, a
synchronisation in the middle of each step that DDP (a local mean, gradients averaged) does
not have. The count depends on the targets alone, so this counts them again from the
targets at the program's start (`sum(target != ignore_index)` in the loss's dtype: the
kernel's own value, an exact integer rounded once) and issues the all-reduce there, ahead of
every other collective of the program (each rank's program is rewritten alike, so the
issue order stays one on all ranks); its wait stays at the backward's first op, by then long
complete. Only the unweighted mean and sum are rewritten (a class-weighted count is a float
sum whose order the kernel decides).
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
_F = torch.ops._c10d_functional
_ALL_REDUCES = (_F.all_reduce.default, _F.all_reduce_.default)
_LOSSES = (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
_MEAN, _SUM = 1, 2
# what may stand between a program input and the loss's targets: re-labelings of the input
_RELABEL = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.alias.default,
    aten.detach.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.squeeze.dim,
    aten.unsqueeze.default,
    aten.expand.default,
    aten.clone.default,
    aten.contiguous.default,
}


def hoist_loss_weight(graph: fx.Graph) -> int:
    """Count every unweighted NLL loss's targets at the program's start and all-reduce the
    count there (module doc); returns how many counts were hoisted."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not placeholders:
        return 0
    cursor = placeholders[-1]
    hoisted = 0
    for loss in [n for n in graph.nodes if n.op == "call_function" and n.target in _LOSSES]:
        reduce = _counted_all_reduce(loss)
        chain = _relabel_chain(loss.args[1])
        if reduce is None or chain is None:
            continue
        cursor = _count_at(graph, cursor, loss, chain, reduce)
        hoisted += 1
    return hoisted


def _counted_all_reduce(loss: fx.Node) -> fx.Node | None:
    """The sum all-reduce of `loss`'s count (`total_weight`, output 1), if the loss is an
    unweighted mean or sum; else None."""
    _, _, weight, reduction, *_ = loss.args
    if weight is not None or reduction not in (_MEAN, _SUM):
        return None
    for g in loss.users:
        if g.target is operator.getitem and g.args[1] == 1:
            for r in g.users:
                if r.target in _ALL_REDUCES and r.args[0] is g and r.args[1] == "sum":
                    return r
    return None


def _relabel_chain(target: object) -> list[fx.Node] | None:
    """The nodes from a program input to `target`, input first, if each only re-labels the
    one before (`_RELABEL`); None otherwise (the targets are computed: not hoisted)."""
    chain: list[fx.Node] = []
    x = target
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _RELABEL:
        if any(a is not x.args[0] for a in x.all_input_nodes):
            return None
        chain.append(x)
        x = x.args[0]
    if not (isinstance(x, fx.Node) and x.op == "placeholder"):
        return None
    return [x, *reversed(chain)]


def _count_at(graph: fx.Graph, cursor: fx.Node, loss, chain, reduce) -> fx.Node:
    """Insert after `cursor`: a copy of the targets' chain, their count in the loss's dtype,
    and `reduce` reading it; returns the last node inserted."""
    count_val = reduce.args[0].meta.get("val")
    ignore_index = loss.args[4]
    made = {chain[0]: chain[0]}

    def place(node: fx.Node) -> fx.Node:
        nonlocal cursor
        cursor.append(node)
        cursor = node
        return node

    for node in chain[1:]:
        made[node] = place(graph.node_copy(node, lambda a: made[a]))
    targets = made[chain[-1]]
    valid = place(graph.call_function(aten.ne.Scalar, (targets, ignore_index)))
    total = place(graph.call_function(aten.sum.default, (valid,)))
    dtype = count_val.dtype if isinstance(count_val, torch.Tensor) else torch.float32
    count = place(graph.call_function(aten._to_copy.default, (total,), {"dtype": dtype}))
    tval = chain[-1].meta.get("val")
    if isinstance(tval, torch.Tensor):
        with getattr(tval, "fake_mode", None) or contextlib.nullcontext():
            valid.meta["val"] = tval != ignore_index
            total.meta["val"] = valid.meta["val"].sum()
    count.meta["val"] = count_val
    old = reduce.args[0]
    reduce.replace_input_with(old, count)
    place(reduce)
    for n in (valid, total, count):
        n.meta.setdefault("custom", reduce.meta.get("custom"))
    if not old.users:
        graph.erase_node(old)
    return reduce
