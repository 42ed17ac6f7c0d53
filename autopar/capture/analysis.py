"""Read-only analyses of a captured graph that the search and the stage split share.

`layer_order(captured) -> [layer]`: the repeated blocks (`layer_of`) in graph order.
`batch_dependent(captured) -> {node}`: the nodes computed from the user inputs; the rest
depends on parameters, buffers and constants only (state, not activations).
`computed_from(graph, is_source) -> {node}`: the same from any sources (a pipeline stage's
received activations too).
`layer_parts(captured) -> {node: part}`: before the first layer, each layer, after the last.
`assign_stages(captured, cuts) -> {node: stage}`: the pipeline stage of every activation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.fx as fx

from autopar.capture.export import Captured, layer_of


def layer_order(captured: Captured) -> list[str]:
    """Repeated blocks in graph order."""
    seen: list[str] = []
    for n in captured.gm.graph.nodes:
        layer = layer_of(n)
        if layer is not None and layer not in seen:
            seen.append(layer)
    return seen


def batch_dependent(captured: Captured) -> set[fx.Node]:
    """Nodes computed from the user inputs (the rest depends on weights and constants only)."""
    inputs = set(captured.user_inputs)
    return computed_from(captured.gm.graph, lambda n: n.op == "placeholder" and n.name in inputs)


def computed_from(graph: fx.Graph, is_source: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """The nodes `is_source` takes and every node computed from one of them."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if is_source(n) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def layer_parts(captured: Captured) -> dict[fx.Node, int]:
    """Each node's part of the model, as a pipeline runs it: 0 before the first layer (the
    embedding), i + 1 for layer i of `layer_order`, len(layers) + 1 after the last (final
    norm, head, loss). A computed node outside the layers runs with the layer before it,
    or with the next one where that is another stack's (between an encoder-decoder's
    stacks: the encoder's final norm, the decoder's embedding); a parameter, buffer or
    input outside the layers belongs to the part of its first reader."""
    layers = layer_order(captured)
    part = {name: i + 1 for i, name in enumerate(layers)}
    post = len(layers) + 1
    nodes = [n for n in captured.gm.graph.nodes if n.op not in ("placeholder", "output")]
    ahead: dict[fx.Node, str | None] = {}  # the layer after each node (None: none follows)
    after = None
    for n in reversed(nodes):
        after = layer_of(n) or after
        ahead[n] = after
    out: dict[fx.Node, int] = {}
    behind = None  # the layer before
    for n in nodes:
        layer = layer_of(n)
        behind = layer or behind
        if layer is not None or behind is None:
            out[n] = part[layer] if layer is not None else 0
        elif ahead[n] is None:
            out[n] = post
        else:  # between two layers: another stack's next, this one's before
            out[n] = part[ahead[n] if _stack(ahead[n]) != _stack(behind) else behind]
    for n in captured.gm.graph.nodes:
        if n.op == "placeholder":
            layer = layer_of(n)
            readers = [out[u] for u in n.users if u in out]
            out[n] = part[layer] if layer is not None else min(readers, default=0)
    return out


def _stack(layer: str) -> str:
    return layer.rpartition(".")[0]


def assign_stages(captured: Captured, cuts: list[int]) -> dict[fx.Node, int]:
    """Stage of every activation node (call_function depending on a user input): its
    part's (`layer_parts`; before the first layer, the first stage; after the last, the
    last)."""
    layers = layer_order(captured)
    stage_of_layer = [sum(1 for c in cuts[1:] if c <= i) for i in range(len(layers))]
    parts = layer_parts(captured)
    batch = batch_dependent(captured)
    last = len(layers) - 1
    return {
        n: stage_of_layer[min(max(parts[n] - 1, 0), last)] if layers else 0
        for n in captured.gm.graph.nodes
        if n.op == "call_function" and n in batch
    }
