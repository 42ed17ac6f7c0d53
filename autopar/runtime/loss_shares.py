"""Each microbatch's share of a batch's mean loss: its rows, or its counted targets.

`loss_shares(rows, counters, runs) -> tensor` (`runtime.pipeline_model`)

A pipeline (or gradient accumulation) runs the loss on each microbatch and weights the
microbatch's mean by its share of the batch, so that the losses and gradients sum to the
batch's mean. For a mean over rows that share is the microbatch's rows / the batch's. A
mean cross-entropy (`nll_loss_forward`, unweighted) divides by its targets that are not
`ignore_index`: where padding spreads unevenly over the microbatches, rows give the wrong
weights (the GPT sample on a padded batch: gradients off by up to 1.4x their largest
entry, `tests/test_padded_loss.py`).
There the share is the microbatch's count / the batch's: `target_counter(captured, known)`
counts a microbatch's targets by running, on the user's inputs, the ops of `captured` that
make the loss's target from them (views, a shift by `pad`: whatever reads no parameter),
then `sum(target != ignore_index)`. A class-weighted mean (`cross_entropy(weight=w)`)
divides by its targets' weights, `sum(w[target])` over those counted: its weight is read
from `known` (the captured buffers and constants by placeholder name: a loss module's
`weight` buffer; never a parameter or a buffer the step mutates, whose value moves).
Every rank holds the whole batch and those tensors, so each counts alike without
communication, before the schedule runs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from autopar.capture import Captured
from autopar.passes.loss_weight import _LOSSES, _MEAN

aten = torch.ops.aten
_RELABEL = (aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.detach.default)
Counter = Callable[[Sequence[torch.Tensor]], torch.Tensor]
# a traced `view` may read a value its trace took as viewable that is not (Hugging Face's
# shifted labels, `view(-1)` of a slice): replayed as `reshape`, the same values
_REPLAY = {aten.view.default: aten.reshape.default, aten._unsafe_view.default: aten.reshape.default}


def target_counter(
    captured: Captured, known: Mapping[str, torch.Tensor] | None = None
) -> Counter | None:
    """A function of a microbatch's user inputs (in `captured.user_inputs` order) giving
    what its mean NLL loss divides by (its counted targets, or their class weights' sum);
    None where the loss is not such a mean or its target or weight reads more than the
    user's inputs and the `known` buffers and constants (a parameter, a random op)."""
    loss = _loss_node(captured.gm.graph)
    if loss is None:
        return None
    _, target, weight, reduction, ignore_index = loss.args
    if reduction != _MEAN or not isinstance(target, fx.Node):
        return None
    if weight is not None and not isinstance(weight, fx.Node):
        return None
    fixed = {
        name: t
        for name, t in (known or {}).items()
        if (name in captured.buffers or name in captured.constants)
        and name not in captured.mutated_buffers
    }
    needed = upstream(target) | (upstream(weight) if weight is not None else set())
    inputs = {n.name for n in captured.placeholders() if n.name in captured.user_inputs}
    for n in needed:
        if n.op == "placeholder" and n.name not in inputs and n.name not in fixed:
            return None
        if n.op not in ("placeholder", "call_function") or _nondeterministic(n):
            return None
    order = [n for n in captured.gm.graph.nodes if n in needed]

    def count(batch: Sequence[torch.Tensor]) -> torch.Tensor:
        values: dict[fx.Node, object] = {}
        given = dict(zip(captured.user_inputs, batch, strict=True))
        device = batch[0].device if batch else None
        for n in order:
            if n.op == "placeholder":
                values[n] = given[n.name] if n.name in given else fixed[n.name].to(device)
                continue
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: values[a])
            values[n] = _REPLAY.get(n.target, n.target)(*args, **kwargs)
        t = values[target]
        kept = t != ignore_index
        if weight is None:
            return kept.sum()
        w = values[weight]
        return torch.where(kept, w[torch.where(kept, t, 0)], 0).sum(dtype=torch.float64)

    return count


def weighted_mean_loss(captured: Captured) -> bool:
    """Whether the graph's loss is a class-weighted mean NLL (`cross_entropy(weight=w)`)."""
    loss = _loss_node(captured.gm.graph)
    return loss is not None and loss.args[2] is not None and loss.args[3] == _MEAN


def loss_shares(
    rows: Sequence[int], counters: Sequence[Counter | None], runs: Sequence[Sequence[Sequence]]
) -> torch.Tensor:
    """Each microbatch's share of the batch's mean (float32): counted targets where every
    run has a counter and the batch counts any, else rows. `runs[r]`: run r's microbatches,
    each its user inputs (whole rows, as every rank holds them)."""
    rows_share = torch.tensor(rows, dtype=torch.float32) / sum(rows)
    if not runs or any(c is None for c in counters):
        return rows_share
    counts = [float(c(mb)) for c, mbs in zip(counters, runs, strict=True) for mb in mbs]
    total = sum(counts)
    if total <= 0:  # nothing counted anywhere: the single-device loss is NaN either way
        return rows_share
    return torch.tensor(counts, dtype=torch.float32) / total


def _loss_node(graph: fx.Graph) -> fx.Node | None:
    """The NLL loss whose output 0 is the graph's loss (its first output, through views)."""
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    x = out[0] if isinstance(out, (tuple, list)) and out else out
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _RELABEL:
        x = x.args[0]
    if not (isinstance(x, fx.Node) and x.target is operator.getitem and x.args[1] == 0):
        return None
    loss = x.args[0]
    return loss if isinstance(loss, fx.Node) and loss.target in _LOSSES else None


def upstream(node: fx.Node) -> set[fx.Node]:
    """`node` and every node it reads, transitively."""
    seen, todo = {node}, list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen


def _nondeterministic(n: fx.Node) -> bool:
    tags = getattr(n.target, "tags", ())
    return torch.Tag.nondeterministic_seeded in tags
