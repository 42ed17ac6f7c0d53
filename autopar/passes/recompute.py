"""Activation checkpointing and FSDP reshard-after-forward as one rewrite of the lowered step.

`recompute_activations(gm, memory, activation_inputs) -> gm`

The lowered program (`autopar.passes.lower`) is one FX graph of forward + backward. While
it is traced, every forward node is tagged with the captured graph's layer it came from
(`tag_layer`) and every backward node as backward (`backward_phase`), in
`node.meta["custom"]`. The pass re-emits, just before its first backward reader, every
forward value a backward node reads that the layer's policy does not keep, and points the
backward readers at the copy. The forward value then has no reader after the forward, and
FX's generated code drops it (`x = None`) after its last forward use: its memory is free
from there until the recomputation, which happens when backward reaches the layer.

What is kept (read by backward from the forward) and what is recomputed, per forward node
of a layer L with policy p = `memory.recompute_of(L)`:

    kept        placeholders; nodes outside every layer; L's outputs (a node some forward
                node of another layer, or of none, reads: the next layer's inputs); random
                ops (`recompute_policy.RANDOM`); and every node where
                `recompute_policy.recomputed(p, op)` is False (selective: matmuls,
                attention, collectives; none: everything)
    recomputed  the other nodes of L, from kept values, recursively (a getitem follows the
                multi-output op it reads); under full this includes L's collectives (FSDP
                all-gathers, TP all-reduces), which backward then runs a second time
    reshard     for L in `memory.reshard_after_forward`, also every node of L computed from
                parameters and buffers only (no user input upstream): the all-gather of a
                weight shard and the views/casts of the gathered weight are re-run in
                backward instead of keeping the gathered copy alive (FSDP2's reshard)

Recomputing only re-runs deterministic ops on the same inputs, so losses, gradients and
updated parameters are bit-for-bit those of the program without recompute.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch.fx as fx
import torch.fx.traceback as fx_traceback

from autopar.capture.recompute_policy import RANDOM, recomputed
from autopar.plan import MemoryPlan

LAYER = "autopar_layer"  # node.meta["custom"] key: the captured graph's layer (forward)
PHASE = "autopar_phase"  # node.meta["custom"] key: "backward" on backward nodes
RECOMPUTED = "autopar_recomputed"  # set on the copies this pass emits
# AOTAutograd's forward tag and checkpoint policy: a copy runs in backward, as it is
_FORWARD_ONLY_META = ("partitioner_tag", "recompute", "ac_graph_id")


def tag_layer(layer: str | None) -> None:
    """Inside `fx.Interpreter.run_node` while tracing under `preserve_node_meta`: the nodes
    traced now belong to `layer` (the meta being traced from is a copy: nothing leaks back)."""
    if not fx_traceback.has_preserved_node_meta():
        return
    meta = fx_traceback.get_current_meta()
    meta["custom"] = {**(meta.get("custom") or {}), LAYER: layer}


def backward_phase():
    """Context under which the traced nodes are tagged as backward (around autograd.grad)."""
    marker = fx.Graph().placeholder("autopar_backward")
    marker.meta["custom"] = {PHASE: "backward"}
    return fx_traceback.set_current_meta(marker)


def recomputed_nodes(gm: fx.GraphModule) -> int:
    """How many nodes of `gm` this pass re-emitted in backward."""
    return sum(bool((n.meta.get("custom") or {}).get(RECOMPUTED)) for n in gm.graph.nodes)


def layer_of(node: fx.Node) -> str | None:
    return (node.meta.get("custom") or {}).get(LAYER)


def is_backward(node: fx.Node) -> bool:
    return (node.meta.get("custom") or {}).get(PHASE) == "backward"


def recompute_activations(
    gm: fx.GraphModule,
    memory: MemoryPlan,
    activation_inputs: Iterable[str],
    backward_start: int | None = None,
) -> fx.GraphModule:
    """Rewrite `gm` in place so backward recomputes what `memory` does not keep.

    `activation_inputs` names the placeholders that carry the batch (everything computed
    without them is weight-derived, which reshard-after-forward re-gathers).
    `backward_start`: the index of the first backward node (default: the first node tagged
    by `backward_phase`); AOTAutograd's joint graphs say it their own way."""
    graph = gm.graph
    nodes = list(graph.nodes)
    start = backward_start
    if start is None:
        start = next((i for i, n in enumerate(nodes) if is_backward(n)), len(nodes))
    forward = set(nodes[:start])
    decide = _Decider(nodes[:start], memory, set(activation_inputs))
    if not decide.any_lever():
        return gm
    clones: dict[fx.Node, fx.Node] = {}

    def materialize(u: fx.Node, before: fx.Node) -> fx.Node:
        if u not in forward or not decide(u):
            return u
        if u not in clones:
            args = fx.map_arg(u.args, lambda a: materialize(a, before))
            kwargs = fx.map_arg(u.kwargs, lambda a: materialize(a, before))
            with graph.inserting_before(before):
                copy = graph.call_function(u.target, args, kwargs)
            copy.meta = {k: v for k, v in u.meta.items() if k not in _FORWARD_ONLY_META}
            custom = {**(u.meta.get("custom") or {}), RECOMPUTED: True, PHASE: "backward"}
            copy.meta["custom"] = custom
            clones[u] = copy
        return clones[u]

    for b in nodes[start:]:
        if b.op != "call_function":
            continue  # the output returns forward values (the loss) as they are
        b.args = fx.map_arg(b.args, lambda a, b=b: materialize(a, b))
        b.kwargs = fx.map_arg(b.kwargs, lambda a, b=b: materialize(a, b))
    graph.lint()
    gm.recompile()
    return gm


class _Decider:
    """Whether a forward node is recomputed in backward (the table in the module docstring)."""

    def __init__(self, forward: list[fx.Node], memory: MemoryPlan, activation_inputs: set[str]):
        self.memory = memory
        self.reshard = set(memory.reshard_after_forward)
        self.memo: dict[fx.Node, bool] = {}
        self.activation: set[fx.Node] = set()  # forward nodes with a batch input upstream
        for n in forward:  # in graph order
            if n.op == "placeholder" and n.name in activation_inputs:
                self.activation.add(n)
            elif any(a in self.activation for a in n.all_input_nodes):
                self.activation.add(n)
        self.forward = set(forward)

    def any_lever(self) -> bool:
        return bool(self.reshard) or any(p != "none" for _, p in self.memory.recompute)

    def __call__(self, u: fx.Node) -> bool:
        if u not in self.memo:
            self.memo[u] = self._decide(u)
        return self.memo[u]

    def _decide(self, u: fx.Node) -> bool:
        layer = layer_of(u)
        if u.op != "call_function" or layer is None:
            return False
        if u.target is operator.getitem:
            return self(u.args[0])  # type: ignore[arg-type]
        if u.target in RANDOM or _is_layer_output(u, layer, self.forward):
            return False
        if recomputed(self.memory.recompute_of(layer), u.target):
            return True
        return layer in self.reshard and u not in self.activation


def _is_layer_output(u: fx.Node, layer: str, forward: set[fx.Node]) -> bool:
    """Read in the forward by a node of another layer (or of none): that layer's input."""
    return any(r in forward and layer_of(r) != layer for r in u.users)
