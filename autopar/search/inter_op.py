"""Inter-op search: pipeline stages, their cut points, and the schedule (Alpa's outer loop).

`search_pipeline(captured, cluster, stage_mesh, options, pipeline) -> Plan`

The cluster's `pp` axis holds the pipeline ranks; every stage runs on the submesh of the
remaining axes (its logical mesh), with the placements the intra-op ILP chose for that
submesh and the microbatch's shapes (the graph was captured on one microbatch). Identical
layers cost the same, so one ILP solve prices them all: per layer, its forward+backward
time t(l) and memory; outside layers, the embedding (first stage) and head/loss (last).

For each schedule (pinned or all of them): v = virtual stages per rank, S = pp*v stages;
the cut points come from the DP that minimizes the slowest stage over contiguous layer
ranges (`balanced_cuts`); the timeline simulator (`search/schedules.py`) prices the
schedule with per-stage forward (t/3) and backward (2t/3) times, the activation sends
between ranks, and gives each rank's peak in-flight microbatches, which multiplies its
stages' activation memory. A schedule whose ranks do not fit in device memory is dropped;
the fastest remaining one wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.capture.export import layer_of
from autopar.cluster import Cluster
from autopar.cost_models.comm import send_recv_time
from autopar.passes.stages import batch_dependent, layer_order
from autopar.plan import PipelinePlan, Plan
from autopar.runtime.pipeline import SCHEDULES, stage_ranks
from autopar.search.intra_op import IntraOpResult, solve_intra
from autopar.search.pins import SearchOptions
from autopar.search.schedules import Timeline, simulate
from autopar.search.to_plan import assemble_plan


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    microbatches: int
    schedule: str | None = None  # None: search all
    stage_cuts: tuple[int, ...] | None = None  # None: balanced by cost


def stage_cluster(cluster: Cluster) -> Cluster:
    """The cluster one stage sees: every axis but `pp` (a size-1 axis if none is left)."""
    keep = [i for i, n in enumerate(cluster.axis_names) if n != "pp"]
    if not keep:
        return replace(cluster, mesh_shape=(1,), axis_names=("stage",), links=cluster.links[:1])
    return replace(
        cluster,
        mesh_shape=tuple(cluster.mesh_shape[i] for i in keep),
        axis_names=tuple(cluster.axis_names[i] for i in keep),
        links=tuple(cluster.links[i] for i in keep),
    )


@dataclass
class LayerCosts:
    layers: list[str]
    time: list[float]  # per layer, forward + backward seconds per microbatch
    memory_state: list[float]  # parameters, gradients, optimizer state (bytes)
    memory_act: list[float]  # saved activations per microbatch (bytes)
    pre: tuple[float, float, float]  # outside layers, before the first: time, state, act
    post: tuple[float, float, float]  # after the last layer
    boundary_bytes: float  # activation bytes a stage sends per microbatch


def layer_costs(captured: Captured, result: IntraOpResult) -> LayerCosts:
    layers = layer_order(captured)
    index = {name: i for i, name in enumerate(layers)}
    t = [0.0] * len(layers)
    ms, ma = [0.0] * len(layers), [0.0] * len(layers)
    pre, post = [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
    seen_layer = False
    batch = batch_dependent(captured)
    for n in captured.gm.graph.nodes:
        if n not in result.chosen or n.op == "output":
            continue
        layer = layer_of(n)
        state = n.op == "placeholder" or n not in batch
        cost, mem = result.node_time(n), result.node_memory(n)
        if layer is not None:
            seen_layer = True
            i = index[layer]
            t[i] += cost
            (ms if state else ma)[i] += mem
        else:
            bucket = post if seen_layer else pre
            bucket[0] += cost
            bucket[1 if state else 2] += mem
    return LayerCosts(layers, t, ms, ma, tuple(pre), tuple(post), _boundary_bytes(captured))


def _boundary_bytes(captured: Captured) -> float:
    """Bytes of the residual stream entering the second layer (what a stage sends)."""
    layers = layer_order(captured)
    if len(layers) < 2:
        return 0.0
    for n in captured.gm.graph.nodes:
        if layer_of(n) == layers[1]:
            for a in n.all_input_nodes:
                if layer_of(a) == layers[0] and isinstance(a.meta.get("val"), torch.Tensor):
                    v = a.meta["val"]
                    return float(v.numel() * v.element_size())
    return 0.0


def balanced_cuts(costs: list[float], stages: int) -> tuple[int, ...]:
    """First layer of each stage, minimizing the slowest stage (contiguous ranges; DP)."""
    n = len(costs)
    if stages > n:
        raise ValueError(
            f"{stages} pipeline stages need at least {stages} layers; the model "
            f"has {n}. Use fewer stages or a non-interleaved schedule."
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1][i], prefix[j] - prefix[i])
                if v < best[s][j]:
                    best[s][j], cut[s][j] = v, i
    cuts, j = [], n
    for s in range(stages, 0, -1):
        cuts.append(cut[s][j])
        j = cut[s][j]
    return tuple(reversed(cuts))


def _stage_figures(lc: LayerCosts, cuts: tuple[int, ...]):
    n = len(lc.layers)
    bounds = list(cuts) + [n]
    times, state, act = [], [], []
    for s in range(len(cuts)):
        lo, hi = bounds[s], bounds[s + 1]
        t = sum(lc.time[lo:hi])
        ms, ma = sum(lc.memory_state[lo:hi]), sum(lc.memory_act[lo:hi])
        if s == 0:
            t, ms, ma = t + lc.pre[0], ms + lc.pre[1], ma + lc.pre[2]
        if s == len(cuts) - 1:
            t, ms, ma = t + lc.post[0], ms + lc.post[1], ma + lc.post[2]
        times.append(t)
        state.append(ms)
        act.append(ma)
    return times, state, act


def price_schedule(
    lc: LayerCosts,
    schedule: str,
    pp: int,
    microbatches: int,
    cluster: Cluster,
    cuts: tuple[int, ...] | None = None,
):
    virtual = SCHEDULES[schedule][1]
    num = pp * virtual
    if cuts is None:
        weights = [t for t in lc.time]
        weights[0] += lc.pre[0]
        weights[-1] += lc.post[0]
        cuts = balanced_cuts(weights, num)
    times, state, act = _stage_figures(lc, cuts)
    pp_axis = cluster.axis_names.index("pp")
    p2p = send_recv_time(lc.boundary_bytes, cluster.links[pp_axis])
    tl = simulate(
        schedule, [t / 3 for t in times], [2 * t / 3 for t in times], microbatches, pp, p2p
    )
    ranks = stage_ranks(schedule, pp)
    peak = []
    for r in range(pp):
        mine = [s for s in range(num) if ranks[s] == r]
        per_mb_act = max(act[s] for s in mine)
        peak.append(sum(state[s] for s in mine) + per_mb_act * tl.in_flight[r])
    return cuts, tl, max(peak)


def search_pipeline(
    captured: Captured,
    cluster: Cluster,
    stage_mesh: DeviceMesh,
    options: SearchOptions,
    pipeline: PipelineOptions,
) -> Plan:
    pp = cluster.axis_size("pp")
    sub = stage_cluster(cluster)
    result = solve_intra(captured, sub, stage_mesh, options)
    lc = layer_costs(captured, result)
    limit = options.memory_limit or cluster.device.memory_bytes * 0.9
    candidates = [pipeline.schedule] if pipeline.schedule else list(SCHEDULES)
    priced: list[tuple[float, str, tuple[int, ...], Timeline, float]] = []
    failures = []
    for sched in candidates:
        try:
            cuts, tl, peak = price_schedule(
                lc, sched, pp, pipeline.microbatches, cluster, pipeline.stage_cuts
            )
        except ValueError as exc:
            failures.append(f"{sched}: {exc}")
            continue
        if peak <= limit:
            priced.append((tl.step_time, sched, cuts, tl, peak))
        else:
            failures.append(f"{sched}: needs {peak / 2**30:.1f} GiB per device")
    if not priced:
        raise ValueError("no pipeline schedule fits: " + "; ".join(failures))
    step, sched, cuts, tl, peak = min(priced)
    plan = assemble_plan(
        captured,
        cluster,
        result.chosen,
        options.strategy_name(),
        step,
        peak,
        {**result.info, "schedules": {s: t for t, s, *_ in priced}, "bubble": tl.bubble},
    )
    return replace(
        plan,
        pipeline=PipelinePlan(
            pp=pp,
            stage_cuts=cuts,
            layers=tuple(lc.layers),
            schedule=sched,
            microbatches=pipeline.microbatches,
            stage_mesh=sub.mesh_shape,
            stage_axis_names=sub.axis_names,
            rank_of_stage=tuple(stage_ranks(sched, pp)),
            timeline=tl.rows,
        ),
    )
