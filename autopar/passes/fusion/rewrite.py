"""The rewriting machinery of the fusion pass: a matched region becomes one fused call.

`rewrite(gm, pattern, match)` inserts ``pattern.handler()(*match.args)`` after the latest of
its inputs, rewires every output of the region to a ``getitem`` of the fused call (or the
call itself, or an epilogue built on it), swaps the nodes ``match.swaps`` names and erases
the region. New nodes get ``meta["val"]`` from the op's fake implementation and the layer
metadata of the last node they replace. What to match lives in
:mod:`autopar.passes.fusion.patterns`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.fx as fx

from autopar._compat import OpOverload, detect_fake_mode


@dataclass
class Match:
    """A matched region.

    ``replaced``: every node the fused op makes dead (erased after rewiring); ``outputs``:
    (node, index) pairs, the uses of ``node`` then read output ``index`` of the fused op
    (``None``: the op returns a single tensor); ``args``: the fused op's arguments;
    ``swaps``: ``(node, op, args)``, a node of the region that stays but becomes another op
    with the same output (``addmm`` -> ``mm`` when the bias moves into the kernel); ``args``
    may name it and then read the new node; ``epilogue(graph, out)``: builds nodes after the
    fused op's (single) output ``out`` and returns the one the region's users then read.
    """

    replaced: list[fx.Node]
    outputs: list[tuple[fx.Node, int | None]]
    args: tuple
    swaps: list[tuple[fx.Node, OpOverload, tuple]] = field(default_factory=list)
    epilogue: Callable[[fx.Graph, fx.Node], fx.Node] | None = None


class Pattern(NamedTuple):
    """``matcher(node)`` is tried on every call_function node (the region's last op) and
    returns a :class:`Match` or None; ``handler()`` gives the fused custom op."""

    name: str
    matcher: Callable[[fx.Node], Match | None]
    handler: Callable[[], OpOverload]


def emit(graph: fx.Graph, op: OpOverload, args: tuple, like: fx.Node) -> fx.Node:
    """A new ``op(*args)`` node with its fake value and ``like``'s layer metadata."""
    new = graph.create_node("call_function", op, args, name=op.overloadpacket.__name__)
    _copy_meta(new, like, _fake_val(op, args))
    return new


def _fake_val(op: OpOverload, args: tuple) -> object:
    """The op's output for the inputs' fake values (its registered fake implementation)."""
    vals = fx.node.map_arg(args, lambda n: n.meta["val"])
    mode = detect_fake_mode(vals)
    if mode is None:  # plain meta values: run on meta
        return op(*fx.node.map_aggregate(vals, _to_meta))
    with mode:
        return op(*vals)


def _to_meta(v: object) -> object:
    return v.to("meta") if isinstance(v, torch.Tensor) else v


def _copy_meta(dst: fx.Node, src: fx.Node, val: object) -> None:
    dst.meta["val"] = val
    for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node"):
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def rewrite(gm: fx.GraphModule, pattern: Pattern, match: Match) -> fx.Node | None:
    """Insert the fused call, rewire the region's outputs, erase the region.

    The call goes right after the latest of its inputs and the region's first node; it is
    skipped (None) when an outside user of an output comes before that point.
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = [a for a in match.args if isinstance(a, fx.Node)]
    first = min(match.replaced, key=order.__getitem__)
    point = max([first, *inputs], key=order.__getitem__)
    region = set(match.replaced)
    for out, _ in match.outputs:
        if any(u not in region and order[u] <= order[point] for u in out.users):
            return None
    op = pattern.handler()
    last = max(match.replaced, key=order.__getitem__)
    swapped = _swap(graph, match.swaps)
    args = fx.node.map_arg(match.args, lambda n: swapped.get(n, n))
    val = _fake_val(op, args)
    with graph.inserting_after(swapped.get(point, point)):
        fused = graph.create_node("call_function", op, args, name=pattern.name)
    _copy_meta(fused, last, val)
    anchor = fused
    for out, index in match.outputs:
        if all(u in region for u in out.users) and index is not None:
            continue  # read only inside the region (a final norm's sum): no getitem
        if index is None:
            new = fused
        else:
            with graph.inserting_after(anchor):
                new = graph.call_function(operator.getitem, (fused, index))
            _copy_meta(new, last, val[index])  # type: ignore[index]
            anchor = new
        if match.epilogue is not None:
            with graph.inserting_before(anchor.next):
                new = match.epilogue(graph, new)
        out.replace_all_uses_with(new)
    for node in sorted(match.replaced, key=order.__getitem__, reverse=True):
        graph.erase_node(node)
    return fused


def _swap(graph: fx.Graph, swaps: Sequence[tuple]) -> dict[fx.Node, fx.Node]:
    """Replace each ``(node, op, args)`` by a new ``op(*args)`` node right after it (same
    output, hence the same metadata); returns old -> new."""
    out = {}
    for old, op, args in swaps:
        with graph.inserting_after(old):
            new = graph.create_node("call_function", op, args, name=op.overloadpacket.__name__)
        _copy_meta(new, old, old.meta["val"])
        old.replace_all_uses_with(new)
        graph.erase_node(old)
        out[old] = new
    return out
