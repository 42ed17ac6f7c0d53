"""Read-only analyses of a captured graph that the search and the stage split share.

`layer_order(captured) -> [layer]`: the repeated blocks (`layer_of`) in graph order.
`batch_dependent(captured) -> {node}`: the nodes computed from the user inputs; the rest
depends on parameters, buffers and constants only (state, not activations).
"""

from __future__ import annotations

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
    out: set[fx.Node] = set()
    for n in captured.gm.graph.nodes:
        if (n.op == "placeholder" and n.name in captured.user_inputs) or any(
            a in out for a in n.all_input_nodes
        ):
            out.add(n)
    return out
