"""Predicted step time of a solved (non-pipelined) plan, with the overlap the runtime gets.

`predicted_step_time(captured, result) -> seconds`

The ILP objective prices every collective as waited at once (conservative: a linear program
cannot see a schedule). The program `autopar.passes.comm` produces overlaps some of them, and
this prices that program: the graph is cut into parts in execution order (what precedes the
first layer, each layer as `capture.analysis.layer_order` lists them, what follows the
last), and per part

    forward   = sum of its nodes' forward compute (`CostContext.forward_time`)
    backward  = node_cost - forward, plus what recompute runs again
    gather    = its weights' forward reshards, fused into one collective per (kind, mesh axis,
                dtype) (`fused_time`: the FSDP all-gather, one per layer and phase)
    regather  = the same again in backward when the layer regathers (reshard / full recompute)
    grads     = its weights' gradient reductions (`CostContext.grad_reductions`)
    exposed   = activation reshards, forward and backward (TP collectives, loss reductions):
                waited at once

go to `cost_models.buckets.overlapped_step` (gradient buckets on one serial channel behind
the backward, gathers prefetched one layer ahead). A template's layer standing for `w`
layers (`CostWeights.layer`) appears round(w) times, its times scaled by w / round(w).
Without any collective the prediction equals the objective (same node prices).

Which is which: the ILP objective (conservative, every collective waited at once, each
gradient reduction its own collective) is what the search minimizes and what
`Plan.predicted_step_time` reports; this figure is reported beside it in the plan's search
info as ``overlapped_step_time`` (`search_plan`, `plan_from_template`; not for pipelines,
whose step is the schedule simulator's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autopar.capture import Captured
from autopar.capture.analysis import layer_order
from autopar.capture.export import layer_of
from autopar.cost_models.buckets import Grad, fused_time, overlapped_step

if TYPE_CHECKING:  # intra_op imports this module
    from autopar.search.intra_op import IntraOpResult


@dataclass(slots=True)
class _Part:
    forward: float = 0.0
    backward: float = 0.0
    gather: float = 0.0  # as the ILP prices them (only to tell infeasible from feasible)
    exposed: float = 0.0
    weight: float = 1.0
    gathers: list[Grad] = field(default_factory=list)
    regathers: list[Grad] = field(default_factory=list)
    grads: list[Grad] = field(default_factory=list)


def predicted_step_time(captured: Captured, result: IntraOpResult) -> float:
    """Seconds per step of `result`'s plan as the overlapping runtime runs it (module doc)."""
    names = layer_order(captured)
    index = {name: i + 1 for i, name in enumerate(names)}
    parts = [_Part() for _ in range(len(names) + 2)]
    seen = False
    for n in captured.gm.graph.nodes:
        if n not in result.chosen or n.op == "output":
            continue
        layer = layer_of(n)
        seen = seen or layer is not None
        i = index[layer] if layer is not None else (len(parts) - 1 if seen else 0)
        parts[i].weight = result.ctx.weights.of(n)
        _add_node(parts[i], n, result)
    values = [v for p in parts for v in (p.forward, p.backward, p.gather, p.exposed)]
    if not all(math.isfinite(v) for v in values):
        return math.inf
    cluster = result.ctx.cluster
    fwd, bwd, gat, reg, grads, exposed = [], [], [], [], [], 0.0
    for p in parts:
        copies = max(1, round(p.weight))
        k = p.weight / copies
        scaled = [(key, kind, axis, b * k) for key, kind, axis, b in p.grads]
        gather = fused_time([(key, kind, axis, b * k) for key, kind, axis, b in p.gathers], cluster)
        regather = fused_time(
            [(key, kind, axis, b * k) for key, kind, axis, b in p.regathers], cluster
        )
        for _ in range(copies):
            fwd.append(p.forward * k)
            bwd.append(p.backward * k)
            gat.append(gather)
            reg.append(regather)
            grads.append(scaled)
        exposed += p.exposed * p.weight
    return overlapped_step(fwd, bwd, gat, reg, grads, cluster, exposed)


def _add_node(part: _Part, n, result: IntraOpResult) -> None:
    """`IntraOpResult.node_times`, split into what overlaps and what is waited at once."""
    ctx, s = result.ctx, result.chosen[n]
    forward = ctx.forward_time(n, s)
    backward = max(0.0, ctx.node_cost(n, s) - forward)
    again = result.recomputed(n)
    if again:
        backward += forward
    full = again and result.recompute.get(layer_of(n)) == "full"
    part.forward += forward
    part.backward += backward
    for pos, op in ctx.operands(n):
        src = ctx.output_spec(op, result.chosen[op.producer])
        fwd, bwd = ctx.edge_parts(op, src, n, s, pos)
        if ctx.is_weight(op.producer):
            part.gather += fwd
            gathers = ctx.weight_gathers(op, src, n, s, pos)
            part.gathers += gathers
            if result._gathered(n, op, fwd) and result.regathers(n):
                part.regathers += gathers
            part.grads += ctx.grad_reductions(op, src, n, s, pos)
        else:
            part.exposed += fwd + bwd + (fwd if full else 0.0)
