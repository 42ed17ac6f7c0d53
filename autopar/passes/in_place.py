"""All-reduces into their own input where nothing else reads it.

`reduce_in_place(graph) -> int` (run by `passes.comm.optimize_comm` last)

A functional `all_reduce` is out of place: it clones its input and reduces the clone
(`_c10d_functional::all_reduce` = `clone` + `all_reduce_`). A gradient bucket's input is
the flat concatenation made for it, and a row-parallel matmul's partial product is read
by its all-reduce only: the clone copies the whole buffer once more per step for nothing
(a 12 MB bucket cost 20 ms of copying per step on 4 gloo processes, more than DDP's whole
exposed communication). Where the input is a fresh tensor (an op whose result aliases none
of its inputs) read by the all-reduce alone, the all-reduce becomes `all_reduce_` on it:
the same values in the same buffer that the clone would have had, one copy less. A
`view` of such a value that alone reads it counts as fresh (tensor parallelism's
row-parallel product, reshaped to the activation's shape before its all-reduce).

`torch.compile` functionalizes a program and cannot take the in-place collective
(an aliasing custom op); `out_of_place(gm)` turns them back before a program is handed to
it (`runtime.inductor`), and inductor re-inplaces by itself.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

_F = torch.ops._c10d_functional
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def reduce_in_place(graph: fx.Graph) -> int:
    """Rewrite every out-of-place all-reduce of a fresh, otherwise unread tensor into the
    in-place one; returns how many were rewritten."""
    rewritten = 0
    for n in graph.nodes:
        if reducible_in_place(n):
            n.target = _F.all_reduce_.default
            rewritten += 1
    return rewritten


def reducible_in_place(n: fx.Node) -> bool:
    """`n` is an out-of-place all-reduce of a fresh, contiguous, otherwise unread tensor."""
    if n.op != "call_function" or n.target is not _F.all_reduce.default:
        return False
    x = n.args[0]
    if not isinstance(x, fx.Node) or len(x.users) != 1 or not _fresh(x):
        return False
    val = x.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_contiguous()


def out_of_place(gm: fx.GraphModule) -> fx.GraphModule:
    """Undo `reduce_in_place` on `gm` (in place; returned for chaining)."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is _F.all_reduce_.default:
            n.target, changed = _F.all_reduce.default, True
    if changed:
        gm.recompile()
    return gm


def _fresh(x: fx.Node) -> bool:
    """`x` is a tensor an op made anew (no view or alias of another value), or a view of
    one that nothing else reads."""
    if x.op != "call_function":
        return False
    if x.target in _VIEWS:
        base = x.args[0]
        return isinstance(base, fx.Node) and len(base.users) == 1 and _fresh(base)
    index = 0
    if x.target is operator.getitem:
        x, index = x.args[0], x.args[1]
        if not isinstance(x, fx.Node) or x.op != "call_function":
            return False
    schema = getattr(x.target, "_schema", None)
    if schema is None or schema.is_mutable or index >= len(schema.returns):
        return False
    ret = schema.returns[index]
    return ret.alias_info is None and str(ret.type) == "Tensor"
