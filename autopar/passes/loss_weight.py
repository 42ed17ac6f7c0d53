"""A mean NLL loss over a batch sharded across ranks: its value, and its count of targets.

`global_mean_loss(graph) -> int` (run by `passes.comm.optimize_comm` on every lowered
program and every pipeline stage's, whatever the communication options)

DTensor's rule for `nll_loss_forward` on rows sharded across ranks makes each rank's mean a
`Partial("avg")`: the mean of the ranks' means, which is the batch's mean only where every
rank counts as many targets. Where it does not (padding, `ignore_index` targets spread
unevenly over the rows), the loss a step returned was not the single-device loss, though
its gradients were (the backward divides by the all-reduced count). This rewrites the
reduction as the batch's mean: each rank's mean times its count (its `total_weight`; a
class-weighted loss's weight sum; 0 where it counts none, whose mean is 0/0), summed over
the ranks, divided by the summed count.

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
_ALL_TO_ALL = (_F.all_to_all_single.default,)
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
    if not placeholders or any(n.target in _ALL_TO_ALL for n in graph.nodes):
        return 0  # not beside gloo's all-to-all (a rank crashed once in it: see the note)
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


def global_mean_loss(graph: fx.Graph) -> int:
    """Every mean NLL loss averaged over ranks made the batch's mean (module doc); returns
    how many were rewritten. A loss over several mesh axes is averaged over each in turn
    (one all-reduce per axis, its count summed so too)."""
    rewritten = 0
    for loss in [n for n in graph.nodes if n.op == "call_function" and n.target in _LOSSES]:
        value = _chain(_reduced_output(loss, 0, "avg"), "avg")
        if loss.args[3] != _MEAN or not value:
            continue
        count = _chain(_reduced_output(loss, 1, "sum"), "sum")
        groups = [r.args[2] for r in value]
        if not count:  # a pipeline stage's forward: the count is reduced in its backward
            count = _count_chain(graph, loss, groups)
        if [r.args[2] for r in count] != groups:
            continue
        local = count[0].args[0]
        if local.target is not aten.clone.default:  # the count is reduced in place: a copy
            with graph.inserting_before(count[0]):
                copy = graph.call_function(aten.clone.default, (local,))
            copy.meta.update(local.meta)
            count[0].replace_input_with(local, copy)
        else:
            local = local.args[0]
        # the count's reductions (its copy first) issued and waited before the value's
        moved = [count[0].args[0]] + [n for r in count for n in (r, *r.users)]
        for n in moved:
            value[0].prepend(n)
        mean = value[0].args[0]
        with graph.inserting_before(value[0]):  # a rank without targets adds 0, not 0/0
            product = graph.call_function(aten.mul.Tensor, (mean, local))
            counted = graph.call_function(aten.gt.Scalar, (local, 0))
            total = graph.call_function(aten.where.ScalarOther, (counted, product, 0.0))
        for n in (product, total):
            n.meta.update(mean.meta)
        value[0].update_arg(0, total)
        for r in value:
            r.update_arg(1, "sum")
        (value_wait,), (count_wait,) = value[-1].users, count[-1].users
        with graph.inserting_after(value_wait):
            batch_mean = graph.call_function(aten.div.Tensor, (value_wait, count_wait))
        batch_mean.meta.update(value_wait.meta)
        for user in [u for u in value_wait.users if u is not batch_mean]:
            user.replace_input_with(value_wait, batch_mean)
        rewritten += 1
    return rewritten


def _chain(first: fx.Node | None, op: str) -> list[fx.Node]:
    """`first` and the all-reduces (`op`) that each read the one before's wait alone."""
    chain = []
    r = first
    while r is not None and len(r.users) == 1:
        chain.append(r)
        (wait,) = r.users
        nxt = list(wait.users)
        r = nxt[0] if len(nxt) == 1 and nxt[0].target in _ALL_REDUCES else None
        if r is not None and r.args[1] != op:
            r = None
    return chain


def _count_chain(graph: fx.Graph, loss: fx.Node, groups: list[str]) -> list[fx.Node]:
    """Sum all-reduces of `loss`'s count over `groups` in turn, each waited (a pipeline
    stage's forward program: the count's own reductions are in its backward)."""
    local = next((g for g in loss.users if g.target is operator.getitem and g.args[1] == 1), None)
    if local is None:
        with graph.inserting_after(loss):
            local = graph.call_function(operator.getitem, (loss, 1))
        local.meta["val"] = loss.meta["val"][1]
    chain, x = [], local
    for group in groups:
        with graph.inserting_after(x):
            reduce = graph.call_function(_F.all_reduce_.default, (x, "sum", group))
        reduce.meta["val"] = local.meta.get("val")
        with graph.inserting_after(reduce):
            x = graph.call_function(_F.wait_tensor.default, (reduce,))
        x.meta["val"] = local.meta.get("val")
        chain.append(reduce)
    return chain


def _reduced_output(loss: fx.Node, index: int, op: str) -> fx.Node | None:
    """The all-reduce (`op`) of `loss`'s output `index` (a copy of it), if any."""
    for g in loss.users:
        if g.target is operator.getitem and g.args[1] == index:
            copies = [c for c in g.users if c.target is aten.clone.default]
            for r in [u for x in (g, *copies) for u in x.users]:
                if r.target in _ALL_REDUCES and r.args[1] == op:
                    return r
    return None


def _counted_all_reduce(loss: fx.Node) -> fx.Node | None:
    """The sum all-reduce of `loss`'s count (`total_weight`, output 1), if the loss is an
    unweighted mean or sum; else None."""
    _, _, weight, reduction, *_ = loss.args
    if weight is not None or reduction not in (_MEAN, _SUM):
        return None
    return _reduced_output(loss, 1, "sum")


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
