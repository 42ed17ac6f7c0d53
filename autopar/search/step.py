"""Predicted step time of a solved (non-pipelined) plan, with the overlap the runtime gets.

`predicted_step_time(captured, result, comm) -> seconds`

The ILP objective prices every collective as waited at once, one per tensor (a linear
program cannot see a schedule): an upper bound. The program `autopar.passes.comm` produces
with `comm` (`plan.CommPlan`) buckets and overlaps them, and this prices that program: the
graph is cut into parts in execution order (what precedes the first layer, each layer as
`capture.analysis.layer_order` lists them, what follows the last), and per part

    forward   = sum of its nodes' forward compute (`CostContext.forward_time`)
    backward  = node_cost - forward, plus what recompute runs again
    gather    = its weights' forward reshards, fused into one collective per (kind, mesh axis,
                dtype) (`fused_time`: the FSDP all-gather, one per layer and phase; one per
                tensor without bucketing, `collective_times`)
    regather  = the same again in backward when the layer regathers (reshard / full recompute)
    grads     = its weights' gradient reductions (`CostContext.grad_reductions`)
    exposed   = activation reshards, forward and backward (TP collectives, loss reductions):
                waited at once, but for a backward all-reduce of a matmul's input gradient,
                which hides (`DeviceSpec.overlap_efficiency` of it) under that matmul's
                weight gradient, half its backward (`Part.hideable`: `passes.comm` issues
                it once the gradient exists, and the weight's is computed after it); and a
                fused gather's copies in and out of its flat buffer (`buckets.fused_copies`)

go to `cost_models.buckets.overlapped_step` (gradient buckets on one serial channel behind
the backward, gathers prefetched one layer ahead; `comm=None`, no pass: every collective
waited at once, one per tensor, which is the ILP's objective), and then the optimizer's
update of every parameter (`IntraOpResult.update_time`, in the objective too; a pipeline
rank's after its last gradient sync, `inter_op.price_schedule`). A template's layer standing
for `w` layers (`CostWeights.layer`) appears round(w) times, its times scaled by
w / round(w). Without any collective the prediction equals the objective (same node
prices); with collectives it does not exceed it but by the buckets' copies, which the ILP
(one collective per tensor, no buffer) does not price and the latency terms bucketing
saves usually outweigh (tests/test_cost_model_invariants.py).

Issue order: the pass keeps the traced order of the collectives among themselves (each is
issued after the one traced before it, `passes.comm`). A layer's forward gather is traced
after the previous part's forward activation collectives (TP all-reduces, issued where
they were lowered), so its prefetch goes out no earlier than the last of them and hides
only under the forward compute after it (`Part.tail`; the part's whole forward when it
has none): `prefetch_exposure` of the gathers over those computes. In backward the
gradient buckets are priced ready at the end of the layer where their last member stands,
after every collective traced in that layer (its re-gather, its activation collectives),
and go out in that (traced) order on one channel (`serial_exposure`), so no bucket is
priced as issued before a collective traced ahead of it; the activation collectives are
waited at once (those hidden under a weight gradient aside).

This is the step time of a non-pipelined plan: `IntraOpResult.step_time`, by which the search
ranks its candidates (`intra_op.solve_intra`) and which `Plan.predicted_step_time` reports;
the ILP's objective is kept as ``ilp_step_time_bound`` in the plan's search info. Pipelines
are priced by the schedule simulator (`inter_op`), each stage's microbatch as its programs
run with the pass (`overlapped_time` of the stage's parts with the gradient collectives
its backward program runs: a sharded parameter's reduce-scatter, every microbatch; the
replicated parameters' all-reduces run once per step, each stage's from its last backward,
`inter_op.reduced_per_step`, `schedules.synced_end`). ZeRO: a non-pipelined plan's
reduce-scatters go out behind the backward like the all-reduces they replace, and the
working parameters' all-gathers, one fused per axis (`zero_gathers`), after the optimizer
step, waited; a pipeline's per stage on its rank's channel at the step's start, each
stage's forwards waiting for its own (`inter_op`). Every plan's program runs the pass
(`passes.comm`), uneven shards included: the pass buckets only what every peer's program
has alike and keeps the traced issue order of the collectives (tests/test_uneven.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autopar.capture import Captured
from autopar.capture.analysis import layer_order, layer_parts
from autopar.capture.export import layer_of
from autopar.cluster import Cluster
from autopar.cost_models import compute
from autopar.cost_models.buckets import (
    Grad,
    collective_times,
    fused_copies,
    fused_time,
    overlapped_step,
)
from autopar.cost_models.comm import Collective
from autopar.plan import DEFAULT_COMM, CommPlan

if TYPE_CHECKING:  # intra_op imports this module
    from autopar.search.intra_op import IntraOpResult


@dataclass(slots=True)
class Part:
    """What a part of the graph (before the layers, one layer, after them) runs, seconds."""

    forward: float = 0.0
    backward: float = 0.0
    gather: float = 0.0  # as the ILP prices them (only to tell infeasible from feasible)
    exposed: float = 0.0
    # of `exposed`: backward all-reduces of activation gradients that the weight gradient
    # computed after them can hide (`passes.comm` issues them once the gradient exists)
    hideable: float = 0.0
    # forward compute after the part's last forward activation collective (None: it has
    # none): all the next part's gather can be prefetched under (issue order, module doc)
    tail: float | None = None
    weight: float = 1.0
    gathers: list[Grad] = field(default_factory=list)
    regathers: list[Grad] = field(default_factory=list)
    grads: list[Grad] = field(default_factory=list)


def predicted_step_time(
    captured: Captured, result: IntraOpResult, comm: CommPlan | None = DEFAULT_COMM
) -> float:
    """Seconds per step of `result`'s plan as the runtime runs it with `comm` (module doc).
    ZeRO: a replicated parameter's gradient is reduce-scattered in backward, and after the
    optimizer step the working parameters all-gathered, one flat buffer per mesh axis,
    waited (`runtime.optimizer.ParamGather`)."""
    parts, cluster = program_parts(captured, result), result.ctx.cluster
    ratio, update = zero_gather_ratio(captured, result), result.update_time()
    if not ratio:
        return overlapped_time(parts, cluster, comm) + update
    gathers = []
    for p in parts:
        gathers += zero_gathers(p.grads, ratio * p.weight)
        p.grads = [
            (k, Collective.REDUCE_SCATTER if _is_all_reduce(kind) else kind, a, b)
            for k, kind, a, b in p.grads
        ]
    after = fused_time(gathers, cluster) + fused_copies(gathers, cluster)
    return overlapped_time(parts, cluster, comm) + update + after


def zero_gather_ratio(captured: Captured, result: IntraOpResult) -> float:
    """ZeRO: bytes the all-gathers after the optimizer step move (the working parameters)
    per gradient byte reduced; 0 without ZeRO."""
    if not result.ctx.shard_optimizer:
        return 0.0
    itemsize = param_itemsize(captured)
    return itemsize / (result.ctx.reduce_itemsize or itemsize)


def param_itemsize(captured: Captured) -> int:
    """Bytes per element of the captured parameters (4 without any)."""
    params = (n for n in captured.placeholders() if n.name in captured.params)
    return next((n.meta["val"].element_size() for n in params), 4)


def _is_all_reduce(kind) -> bool:
    return Collective(kind) is Collective.ALL_REDUCE


def zero_gathers(grads: list[Grad], ratio: float) -> list[Grad]:
    """ZeRO: the all-gathers of the working parameters whose gradients `grads` all-reduce
    (`ratio` x their bytes), keyed by mesh axis alone: one flat buffer per axis
    (`runtime.optimizer.ParamGather`)."""
    return [
        (("zero-gather",), Collective.ALL_GATHER, a, b * ratio)
        for _, kind, a, b in grads
        if _is_all_reduce(kind)
    ]


def program_parts(captured: Captured, result: IntraOpResult) -> list[Part]:
    """The parts in execution order: before the first layer, each layer, after the last
    (`capture.analysis.layer_parts`)."""
    part_of = layer_parts(captured)  # as a pipeline runs them
    parts = [Part() for _ in range(len(layer_order(captured)) + 2)]
    for n in captured.gm.graph.nodes:
        if n not in result.chosen or n.op == "output":
            continue
        i = part_of[n]
        parts[i].weight = result.ctx.weights.of(n)
        _add_node(parts[i], n, result)
    return parts


def overlapped_time(parts: list[Part], cluster: Cluster, comm: CommPlan | None) -> float:
    """Seconds of the program of `parts` with `comm`'s overlap (module doc)."""
    values = [v for p in parts for v in (p.forward, p.backward, p.gather, p.exposed)]
    if not all(math.isfinite(v) for v in values):
        return math.inf
    fwd, hide, bwd, gat, reg, reductions, exposed = [], [], [], [], [], [], 0.0
    overlap = cluster.device.overlap_efficiency
    for p in parts:
        copies = max(1, round(p.weight))
        k = p.weight / copies
        scaled = _scaled(p.grads, k)
        fused = comm is not None and comm.bucket
        gather = collective_times(_scaled(p.gathers, k), cluster, fused)
        regather = collective_times(_scaled(p.regathers, k), cluster, fused)
        if fused:  # a layer's fused gathers copy in and out of their flat buffers, waited
            moved = (fused_copies(_scaled(g, k), cluster) for g in (p.gathers, p.regathers))
            exposed += copies * sum(moved)
        for _ in range(copies):
            fwd.append(p.forward * k)
            hide.append(p.forward * k if p.tail is None else p.tail * k)
            bwd.append(p.backward * k)
            gat.append(gather)
            reg.append(regather)
            reductions.append(scaled)
        hidden = overlap * p.hideable if comm is not None and comm.overlap else 0.0
        exposed += (p.exposed - hidden) * p.weight
    # the forward's gathers, prefetched in issue order under `hide`
    return overlapped_step(fwd, bwd, gat, reg, reductions, cluster, exposed, comm, hide)


def _scaled(grads: list[Grad], k: float) -> list[Grad]:
    return [(key, kind, axis, b * k) for key, kind, axis, b in grads]


def _add_node(part: Part, n, result: IntraOpResult) -> None:
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
    # a matmul's backward computes its input's gradient, then its weight's: an all-reduce
    # of the input's gradient runs while the weight's is computed (half the backward)
    weighted = compute.training_kernels(n) == 3 and any(
        ctx.is_weight(op.producer) for _, op in ctx.operands(n)
    )
    budget = (backward - (forward if again else 0.0)) / 2 if weighted else 0.0
    activation_collective = False
    for pos, op in ctx.operands(n):
        src = ctx.output_spec(op, result.chosen[op.producer])
        fwd, bwd = ctx.edge_parts(op, src, n, s, pos)
        if ctx.is_weight(op.producer):
            part.gather += fwd
            gathers = ctx.weight_gathers(op, src, n, s, pos)
            part.gathers += gathers
            # laid out after the gather's wait, and the gradient before its reduction
            copied, grad_copied = ctx.weight_copies(op, src, n, s, pos)
            part.exposed += copied + grad_copied
            if result._gathered(n, op, fwd) and result.regathers(n):
                part.regathers += gathers
                part.exposed += copied
            part.grads += ctx.grad_reductions(op, src, n, s, pos)
        else:
            part.exposed += fwd + bwd + (fwd if full else 0.0)
            activation_collective = activation_collective or fwd > 0
            if budget > 0 and bwd > 0:
                hideable = min(ctx.activation_grad_all_reduces(op, src, n, s, pos), budget)
                part.hideable += hideable
                budget -= hideable
    # the collective runs before `n`: `n`'s forward is the first after it
    if activation_collective or part.tail is not None:
        part.tail = forward + (0.0 if activation_collective else part.tail)
