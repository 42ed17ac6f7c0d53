"""Predicted peak memory of a plan: what a rank really holds at the peak of a step.

`predict_peak(captured, plan, optimizer_states=2) -> PeakMemory`,
`with_predicted_memory(captured, plan) -> Plan` (sets `predicted_peak_memory` and
`predicted_memory` at plan assembly, `planning.PlanJob.search`).

The ILP keeps a linear memory term for feasibility; this is the liveness simulation of the
step as the runtime runs it (`search.liveness`), in the categories `runtime.memory_stats`
measures. Without a pipeline every rank holds the same (even shards), so one simulation
of the whole graph on the stage mesh is every rank's prediction.

Pipelines (`Plan.pipeline`): the nodes are split as `passes.stages` splits them (activation
nodes by layer, weight-only nodes copied into every stage that reads them); each stage is
simulated for one microbatch (the captured graph is one microbatch), receiving the values
of earlier stages and sending (and getting gradients back for) what later stages read.
Pipeline rank r, holding stages S_r, with k_r microbatches in flight at its peak
(`search.schedules.simulate(...).in_flight`; under a zero-bubble schedule a microbatch
between its I and W counts as the fraction of its kept activations the W half holds,
`stage_stash` / kept):

    peak_r = sum over S_r of ( simulated peak
                               + (k_r - 1) * kept   (saved activations, stage outputs and
                                                     received inputs of the other
                                                     microbatches in flight)
                               + gradients not yet made at that peak (M > 1: earlier
                                 microbatches made every parameter gradient) )
             + the batch: every rank takes the global batch and keeps its local shard of
               all M microbatches (the simulation counted one microbatch's)

The plan's figure is the busiest pipeline rank; every rank's is in
`plan.solver["predicted_memory_per_pp_rank"]`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.fx as fx

from autopar.capture import Captured
from autopar.capture.analysis import assign_stages, batch_dependent
from autopar.capture.operands import tensor_operands
from autopar.cost_models.memory import local_shape, replicas
from autopar.plan import Plan, parse_spec, stage_ranks
from autopar.search.liveness import (
    CATEGORIES,
    NodeProbe,
    PeakMemory,
    probe_graph,
    simulate_step,
)
from autopar.search.schedules import simulate, weight_gradient_reads

__all__ = ["PeakMemory", "predict_peak", "predict_peak_per_rank", "probe_graph"]


def predict_peak(
    captured: Captured, plan: Plan, *, optimizer_states: int = 2, foreach: bool | None = None
) -> PeakMemory:
    """The predicted peak of one training step on the busiest rank (module docstring).
    `foreach`: the optimizer's multi-tensor implementation (torch's default on GPUs; None:
    a non-gloo cluster)."""
    ranks = predict_peak_per_rank(
        captured, plan, optimizer_states=optimizer_states, foreach=foreach
    )
    return max(ranks, key=lambda p: p.peak)


def predict_peak_per_rank(
    captured: Captured, plan: Plan, *, optimizer_states: int = 2, foreach: bool | None = None
) -> list[PeakMemory]:
    """One prediction per pipeline rank (one in all without a pipeline)."""
    if foreach is None:
        foreach = plan.cluster.get("backend", "nccl") != "gloo"
    probes = probe_graph(captured)
    if plan.pipeline is None:
        nodes = [n for n in captured.gm.graph.nodes if n.name in probes]
        return [simulate_step(captured, plan, nodes, probes, optimizer_states, foreach)]
    stages = stage_nodes(captured, list(plan.stage_cuts), probes)
    pipe = plan.pipeline
    owners = stage_ranks(pipe.schedule, pipe.pp)
    n = len(stages)
    sims = [
        simulate_step(
            captured,
            plan.on_rank(owners[s]),
            stages[s],
            probes,
            optimizer_states,
            foreach,
            frozenset(x for t in range(s + 1, n) for x in stages[t]),
        )
        for s in range(n)
    ]
    # zero-bubble schedules: the part of a microbatch's activations held from I to W
    stash = [
        min(stage_stash(captured, plan.on_rank(owners[s]), stages[s]) / p.kept, 1.0)
        if p.kept
        else 1.0
        for s, p in enumerate(sims)
    ]
    timeline = simulate(
        pipe.schedule, [1.0] * n, [2.0] * n, pipe.microbatches, pipe.pp, stash=stash
    )
    batch = _batch_bytes(captured, plan)
    out = []
    for rank in range(pipe.pp):
        mine = [s for s in range(n) if owners[s] == rank]
        grads = [stage_gradients(captured, plan.on_rank(rank), stages[s]) for s in mine]
        rank_sims = [sims[s] for s in mine]
        out.append(_combine(rank_sims, grads, timeline.in_flight[rank], pipe.microbatches, batch))
    return out


def stage_stash(captured: Captured, plan: Plan, nodes: list[fx.Node]) -> float:
    """Bytes one microbatch's weight-gradient half holds on this stage from the
    zero-bubble schedules' I action to their W (`runtime.zero_bubble`): per matmul reading
    a weight, its activation as its plan reads it and its output's gradient, local
    (`search.schedules.weight_gradient_reads`)."""
    batch = batch_dependent(captured)
    mesh = plan.stage_mesh_shape
    index = {p.name: p for p in plan.nodes}

    def is_weight(x: fx.Node) -> bool:
        return x.name in captured.params or (x.op != "placeholder" and x not in batch)

    def local(t, spec: str | None) -> float:
        shape = local_shape(t.shape, parse_spec(spec), mesh) if spec else t.shape
        return float(math.prod(shape) * t.element_size())

    total = 0.0
    for n in nodes:
        acts = weight_gradient_reads(n, tensor_operands(n), is_weight)
        node = index.get(n.name)
        if not acts or node is None:
            continue
        total += sum(local(op.tensor, node.inputs[pos]) for pos, op in acts)
        total += local(n.meta["val"], node.outputs[0])
    return total


def stage_gradients(
    captured: Captured, plan: Plan, nodes: list[fx.Node]
) -> tuple[float, float, dict[tuple, float]]:
    """(accumulated, shards, buckets): what a stage's gradient reduction after its last
    microbatch holds, as `runtime.pipeline` runs it. Per parameter of N local elements,
    R replicas, compute itemsize c, master itemsize m (4 under the policy), reduce
    itemsize d: the microbatches accumulate N*m (ZeRO: N*c, the working dtype);
    `GradientSync` flattens the replicated ones into one buffer per set of axes and
    all-reduces it in place (bucket per axes: sum N*d); ZeRO's `GradientScatter`
    copies all into an R x ceil(N/R) buffer per set of axes (bucket: sum R*ceil(N/R)*d;
    twice on gloo, whose reduce-scatter works on a copy) and keeps the flat shards (sum
    ceil(N/R)*m)."""
    mem, mesh = plan.memory, plan.stage_mesh_shape
    names = {a.name for n in nodes for a in [n, *n.all_input_nodes] if a.op == "placeholder"}
    accumulated = shards = 0.0
    buckets: dict[tuple, float] = {}
    vals = {p.name: p.meta["val"] for p in captured.placeholders()}
    # gloo reduce-scatters a full-size copy of the bucket, alive until the wait
    copies = 2 if plan.cluster.get("backend", "nccl") == "gloo" else 1
    for name in sorted(names & set(captured.params)):
        val = vals[name]
        spec = parse_spec(plan.tensor(name).spec)
        numel = math.prod(local_shape(tuple(val.shape), spec, mesh))
        c = val.dtype.itemsize
        m = 4 if mem.param_dtype else c
        d = getattr(torch, mem.reduce_dtype or "float32").itemsize if mem.param_dtype else m
        axes = tuple(
            a for a, (q, k) in enumerate(zip(spec, mesh, strict=True)) if q.is_replicate() and k > 1
        )
        r = replicas(spec, mesh)
        if mem.shard_optimizer:
            accumulated += numel * c
            shards += -(-numel // r) * m
            buckets[axes] = buckets.get(axes, 0.0) + -(-numel // r) * r * d * copies
        else:
            accumulated += numel * m
            if axes:
                buckets[axes] = buckets.get(axes, 0.0) + numel * d
    return accumulated, shards, buckets


def _combine(
    sims: list[PeakMemory],
    grads: list[tuple[float, float, dict[tuple, float]]],
    in_flight: float,
    microbatches: int,
    batch: float,
) -> PeakMemory:
    """A pipeline rank's peak from its stages' one-microbatch simulations: the largest of
    the first backward (k - 1 other microbatches in flight, no gradient accumulated yet),
    the last (nothing else in flight, every earlier microbatch's gradients held) and the
    gradient reduction after it (`stage_gradients`: the state, the accumulated gradients,
    the flat shards made so far and the reduction buffers: every stage's, alive until the
    wait after the schedule, `runtime.stage_grads`; during the last backward, those of the
    stages reduced before it). `in_flight` counts the rank's
    stage-microbatches together (`schedules.simulate`): with v stages per rank, each
    stage's simulation holds one, and the rest are held at the largest stage's `kept`."""
    first = dict.fromkeys(CATEGORIES, 0.0)
    others = max(in_flight - len(sims), 0.0) * max((p.kept for p in sims), default=0.0)
    first["activations"] += others
    last = dict.fromkeys(CATEGORIES, 0.0)
    sync = dict.fromkeys(CATEGORIES, 0.0)
    for p, (accumulated, shards, _) in zip(sims, grads, strict=True):
        for c, b in p.breakdown.items():
            first[c] += b
            last[c] += b
        if microbatches > 1:
            last["gradients"] += max(accumulated - p.breakdown["gradients"], 0.0)
        for c in ("parameters", "optimizer_state", "buffers"):
            sync[c] += p.breakdown[c]
        sync["gradients"] += accumulated + shards
    per_stage = [sum(b.values()) for _, _, b in grads]
    sync["communication"] = sum(per_stage)
    last["communication"] += sum(per_stage) - min(per_stage, default=0.0)
    # the batch: simulated as one microbatch's shard (and global) on the stages reading it
    for total in (first, last):
        total["activations"] += batch - sum(p.batch for p in sims)
    sync["activations"] += batch
    total = max(first, last, sync, key=lambda t: sum(t.values()))
    return PeakMemory(sum(total.values()), total, sims[0].phase if sims else "forward")


def stage_nodes(
    captured: Captured, cuts: list[int], probes: dict[str, NodeProbe]
) -> list[list[fx.Node]]:
    """Each stage's nodes in graph order, as `passes.stages.split_stages` cuts them."""
    stage_of = assign_stages(captured, cuts)
    batch = batch_dependent(captured)
    readers: dict[fx.Node, set[int]] = {}
    for n in reversed(captured.gm.graph.nodes):  # weight-only nodes: every reading stage
        if n.op == "call_function" and n not in batch:
            readers[n] = {
                s for u in n.users for s in ([stage_of[u]] if u in stage_of else readers.get(u, ()))
            }
    out: list[list[fx.Node]] = [[] for _ in cuts]
    for n in captured.gm.graph.nodes:
        if n.name not in probes:
            continue
        for s in [stage_of[n]] if n in stage_of else sorted(readers.get(n, ())):
            out[s].append(n)
    return out


def _batch_bytes(captured: Captured, plan: Plan) -> float:
    """The batch on every pipeline rank: the global batch and the local shard of every
    microbatch (`PipelineModel` cuts, shards and concatenates them before the schedule)."""
    total = 0.0
    for n in captured.placeholders():
        if n.name in captured.user_inputs:
            val = n.meta["val"]
            spec = parse_spec(plan.tensor(n.name).spec)
            local = math.prod(local_shape(val.shape, spec, plan.stage_mesh_shape))
            total += plan.microbatches * (val.numel() + local) * val.dtype.itemsize
    return total


def with_predicted_memory(captured: Captured, plan: Plan, optimizer_states: int = 2) -> Plan:
    """`plan` with `predicted_peak_memory` and `predicted_memory` from the simulation (the
    ILP's linear memory term stays in `plan.solver` as `ilp_memory`)."""
    ranks = predict_peak_per_rank(captured, plan, optimizer_states=optimizer_states)
    peak = max(ranks, key=lambda p: p.peak)
    info = {"ilp_memory": plan.predicted_peak_memory, "peak_phase": peak.phase}
    if plan.pipeline is not None:
        info["predicted_memory_per_pp_rank"] = [
            {c: float(b) for c, b in p.breakdown.items()} for p in ranks
        ]
    return replace(
        plan.with_solver(**info),
        predicted_peak_memory=float(peak.peak),
        predicted_memory={c: float(b) for c, b in peak.breakdown.items()},
    )
