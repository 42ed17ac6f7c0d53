"""What autograd keeps for each node of a captured graph, found by running it on meta tensors.

`probe_graph(captured) -> {node name: NodeProbe}`

Every call node runs once on meta tensors of its global shapes (no memory) with the
parameters requiring gradients, under `torch.autograd.graph.saved_tensors_hooks`: the
tensors the hooks see, matched by identity to the node's inputs and outputs, are what its
backward reads. Outputs whose `_base` is an input are views (no new storage). Two cases
follow the runtime rather than meta execution: `scaled_dot_product_attention` (kept whole
in the captured graph; its fused kernels save q, k, v, the output and a float32
logsumexp) and a `view` of a non-contiguous input (lowering copies it first, a new buffer).

A node whose op, inputs (shapes, strides, dtypes, whether each takes a gradient or is a
view) and other arguments are another's (a repeated block's) reads that one's probe, and
its outputs, new tensors of the layouts the op gave there, are made without running it
(a 32-block model's whole graph probes its distinct nodes, not its 2,400); an op that
gives a view of an input, or anything but tensors, runs each time.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar._compat import tree_flatten
from autopar.capture import Captured

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


@dataclass(frozen=True, slots=True)
class NodeProbe:
    """What autograd does for one node: inputs/outputs its backward reads, which outputs
    are views of an input, which inputs take a gradient."""

    saved_inputs: frozenset[int]  # tensor-operand positions
    saved_outputs: frozenset[int]
    view_of: dict[int, int] = field(default_factory=dict)  # output -> tensor-operand position
    grad_inputs: frozenset[int] = frozenset()
    requires_grad: bool = False
    extra_saved: float = 0.0  # more bytes saved with output 0, as a fraction of it


def probe_graph(captured: Captured) -> dict[str, NodeProbe]:
    """Run the captured graph once on meta tensors and record `NodeProbe` per call node."""
    probes: dict[str, NodeProbe] = {}
    env: dict[fx.Node, object] = {}
    seen: dict[tuple, tuple[NodeProbe, list | None]] = {}  # by `_signature`
    for n in captured.gm.graph.nodes:
        if n.op == "placeholder":
            val = n.meta["val"]
            t = torch.empty(val.shape, dtype=val.dtype, device="meta")
            trained = n.name in captured.params and val.dtype.is_floating_point
            env[n] = t.requires_grad_(trained)
        elif n.op == "call_function":
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            if n.target is operator.getitem:
                env[n] = operator.getitem(*args)
                continue
            key = _signature(n.target, args, kwargs)
            found = seen.get(key) if key is not None else None
            if found is not None and found[1] is not None:
                probes[n.name] = found[0]
                env[n] = _made(found[1])
                continue
            env[n], probes[n.name] = _probe(n.target, args, kwargs)
            if key is not None:
                seen[key] = (probes[n.name], _layouts(env[n], probes[n.name]))
    return probes


def _signature(target, args, kwargs) -> tuple | None:
    """What `_probe` reads of a call: the op, each tensor's layout, whether it takes a
    gradient or is a view, and the other arguments (None where one is not hashable)."""

    def one(a):
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), a.stride(), a.dtype, a.requires_grad, a._base is not None)
        if isinstance(a, (list, tuple)):
            return tuple(map(one, a))
        return a

    try:
        key = (target, one(args), tuple(sorted((k, one(v)) for k, v in kwargs.items())))
        hash(key)
    except TypeError:
        return None
    return key


def _layouts(out, probe: NodeProbe) -> list | None:
    """The outputs' (shape, stride, dtype, takes a gradient), to be made again without
    running the op; None where an output is a view of an input or not a tensor."""
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    if probe.view_of or not all(isinstance(o, torch.Tensor) for o in outs):
        return None
    made = [(tuple(o.shape), o.stride(), o.dtype, o.requires_grad) for o in outs]
    return [*made, isinstance(out, (tuple, list))]


def _made(layouts: list) -> object:
    """New meta tensors of `_layouts`' layouts (taking a gradient), as the op gave them."""
    *each, several = layouts
    outs = [
        torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(grad)
        for shape, stride, dtype, grad in each
    ]
    return tuple(outs) if several else outs[0]


def _probe(target, args, kwargs) -> tuple[object, NodeProbe]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    if target is _SDPA:
        return _probe_attention(args, kwargs)
    if kwargs.get("device") is not None:  # a cast naming the device (`type_as`): stay on meta
        kwargs = {**kwargs, "device": torch.device("meta")}
    if target in _VIEWS and not args[0].is_contiguous():
        # the captured graph dropped layout-only clones; lowering copies such a view's
        # input (`passes.lower._contiguous_local`): a new buffer, as here
        args = (args[0].contiguous(), *args[1:])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = target(*args, **kwargs)
    flat, _ = tree_flatten((args, kwargs))
    inputs = [a for a in flat if isinstance(a, torch.Tensor)]
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    saved_in = {i for t in saved for i, x in enumerate(inputs) if t is x}
    saved_out = {j for t in saved for j, o in enumerate(outs) if t is o}
    view_of = {}
    for j, o in enumerate(outs):
        if isinstance(o, torch.Tensor) and o._base is not None:
            base = o._base
            for i, x in enumerate(inputs):
                if x is base or x._base is base:
                    view_of[j] = i
    grad_inputs = frozenset(i for i, x in enumerate(inputs) if x.requires_grad)
    rg = any(isinstance(o, torch.Tensor) and o.requires_grad for o in outs)
    return out, NodeProbe(frozenset(saved_in), frozenset(saved_out), view_of, grad_inputs, rg)


def _probe_attention(args, kwargs) -> tuple[object, NodeProbe]:
    """sdpa is kept whole in the captured graph (meta runs its math decomposition): its
    fused kernels (flash, efficient, the CPU flash) save q, k, v, the output and the
    logsumexp (float32, one per query row and head)."""
    out = _SDPA(*args, **kwargs)
    qkv = [a for a in args[:3] if isinstance(a, torch.Tensor)]
    grad_inputs = frozenset(i for i, x in enumerate(qkv) if x.requires_grad)
    lse = 4 / (out.shape[-1] * out.dtype.itemsize)
    return out, NodeProbe(grad_inputs, frozenset({0}), {}, grad_inputs, out.requires_grad, lse)
