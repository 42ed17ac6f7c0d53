"""Read-only analyses of a captured graph that the search and the stage split share.

`layer_order(captured) -> [layer]`: the repeated blocks (`layer_of`) in graph order.
`batch_dependent(captured) -> {node}`: the nodes computed from the user inputs; the rest
depends on parameters, buffers and constants only (state, not activations).
`computed_from(graph, is_source) -> {node}`: the same from any sources (a pipeline stage's
received activations too).
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


def assign_stages(captured: Captured, cuts: list[int]) -> dict[fx.Node, int]:
    """Stage of every activation node (call_function depending on a user input)."""
    layers = layer_order(captured)
    first_layer = {layer: i for i, layer in enumerate(layers)}
    stage_of_layer = [sum(1 for c in cuts[1:] if c <= i) for i in range(len(layers))]
    stages: dict[fx.Node, int] = {}
    current = 0
    batch = batch_dependent(captured)
    for n in captured.gm.graph.nodes:
        if n.op != "call_function" or n not in batch:
            continue
        layer = layer_of(n)
        if layer is not None:
            current = stage_of_layer[first_layer[layer]]
        stages[n] = current
    return stages
