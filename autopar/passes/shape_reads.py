"""Readers of a collective's result that need only its shape: made without it.

`unchain_shape_reads(graph) -> int` (run by `passes.comm.optimize_comm` before scheduling)

A lowered program seeds its backward with `ones_like(loss)`; where the loss is reduced
across ranks (a data-parallel mean), that reads the all-reduce's result, so the scheduler
(`passes.comm._schedule`) must wait on the loss's all-reduce right after issuing it, in the
middle of the step: a blocking collective in every forward that DDP never runs. A `*_like`
factory reads only its input's shape, dtype and device: this rewrites each one whose input
comes from a collective's wait (through views) into `aten.full` of the traced value's
shape, dtype and device (the same values: a contiguous result's strides are the default
ones), and the wait sinks to the value's real readers (the loss returned at the end).
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
_F = torch.ops._c10d_functional
# a functional collective's wait (`passes.comm` reads the same)
WAITS = (_F.wait_tensor.default, torch.ops.c10d_functional.wait_tensor.default)
# factory -> the fill value it makes (`empty_like`'s values are undefined: zeros do)
FILLS = {aten.ones_like.default: 1, aten.zeros_like.default: 0, aten.empty_like.default: 0}
# ops that re-label the result they read (between a wait and a factory)
_RELABEL = (
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.alias.default,
    aten.detach.default,
)


def unchain_shape_reads(graph: fx.Graph) -> int:
    """Rewrite every `*_like` factory reading (through views) a collective's wait into a
    `full` of the same shape, dtype and device; returns how many were rewritten."""
    rewritten = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in FILLS or not _from_wait(n.args[0]):
            continue
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_contiguous():
            continue
        with graph.inserting_before(n):
            full = graph.call_function(
                aten.full.default,
                (list(val.shape), FILLS[n.target]),
                {"dtype": val.dtype, "layout": torch.strided, "device": val.device},
            )
        full.meta.update(n.meta)
        n.replace_all_uses_with(full)
        graph.erase_node(n)
        rewritten += 1
    return rewritten


def _from_wait(x: object) -> bool:
    while isinstance(x, fx.Node) and x.op == "call_function" and x.target in _RELABEL:
        x = x.args[0]
    return isinstance(x, fx.Node) and x.op == "call_function" and x.target in WAITS
