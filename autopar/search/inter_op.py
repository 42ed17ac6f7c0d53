"""Inter-op search: pipeline stages, their cut points, and the schedule (Alpa's outer loop).

`solve_pipeline(captured, cluster, stage_mesh, options, pipeline) -> (result, schedule, ...)`
(`search.pipeline_plan.search_pipeline` makes it a `Plan`)

The cluster's `pp` axis holds the pipeline ranks; every stage runs on the submesh of the
remaining axes (its logical mesh), with the placements the intra-op ILP chose for that
submesh and the microbatch's shapes (the graph was captured on one microbatch). Identical
layers cost the same, so one ILP solve prices them all: per layer, its forward+backward
time t(l) and memory; outside layers, the embedding (first stage) and head/loss (last).

For each schedule (pinned or all of them): v = virtual stages per rank, S = pp*v stages;
the cut points come from the DP that minimizes the slowest stage over contiguous layer
ranges (`balanced_cuts`, each range priced by `stage_time`, what the schedule is priced
with); the timeline simulator (`search/schedules.py`) prices the schedule with per-stage
times t as the stage programs run with the communication pass (`stage_time`: gathers
fused per layer and prefetched, a sharded parameter's gradient reduce-scatters bucketed
behind every microbatch's backward, waits at first use, `search.step.overlapped_time`),
forward t/3 and backward 2t/3 (of which the zero-bubble schedules' W action runs the
weight-gradient matmuls, `schedules.weight_gradient_work`), the activation sends between
ranks (on processes that share CPU cores, `DeviceSpec.core_share` < 1, a longer stage's
compute runs on the cores the others leave: `search.core_sharing`), and gives each rank's
peak in-flight microbatches, which multiplies its stages' activation memory. Each stage
all-reduces its replicated parameters' gradients once per step from its last backward (`reduced_per_step`, `runtime.pipeline.GradientSync`), one
flat buffer per (collective, mesh axis, dtype) (`cost_models.buckets.fused_time`), on
its rank's communication channel while its other stages compute (`schedules.synced_end`);
under ZeRO a reduce-scatter, and the working parameters' all-gathers go out at the step's
start in stage order, each stage's first forward waiting for its own (`_gathered`).
A schedule whose ranks do not fit in device memory is dropped; the fastest remaining one
wins; none is priced when the stages' work alone reaches the layout search's best step
(`Dominated`, `PipelineOptions.bar`: cutting and simulating cost ~1 s per layout). When
none fits, the ILP is solved again (twice at most) under a budget shrunk by limit / least
peak, so that it turns to its memory levers (recompute, reshard after forward) or shards
more. A rank's memory counts the weights its layers keep gathered until backward
(`IntraOpResult.held_weights`) and a copy of each parameter its stages share with others
(`search.shared_params`, their gradients summed over pp after the schedule); the one-layer
working sets of recompute and regathering are in the ILP's memory, not in a rank's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.cluster import Cluster
from autopar.cost_models.buckets import Grad, fused_copies, fused_time
from autopar.cost_models.comm import Collective, send_recv_time
from autopar.plan import (
    DEFAULT_COMM,
    SCHEDULES,
    stage_ranks,
)
from autopar.search.core_sharing import shared_core_factors, stage_compute
from autopar.search.costs import CostWeights
from autopar.search.ilp import MemoryInfeasible
from autopar.search.intra_op import IntraOpResult, prepare_intra, solve_intra
from autopar.search.layer_costs import (
    LayerCosts,
    StageSpans,
    layer_costs,
    layer_range,
    reduced_per_step,
    stage_time,
)
from autopar.search.pins import SearchOptions
from autopar.search.schedules import (
    Timeline,
    microbatch_groups,
    simulate,
    synced_end,
)
from autopar.search.shared_params import shared_sum_seconds, stage_copies
from autopar.search.stage_cuts import balanced_cuts
from autopar.search.step import (
    zero_gathers,
)


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    microbatches: int
    schedule: str | None = None  # None: search all
    stage_cuts: tuple[int, ...] | None = None  # None: balanced by cost
    rows: int | None = None  # the batch's; None: the microbatch count divides it
    bar: float = math.inf  # the layout search's best step: schedules that cannot beat it
    # per pipeline rank, its stage mesh's shape where they differ (`search.stage_meshes`)
    rank_meshes: tuple[tuple[int, ...], ...] = ()

    @property
    def groups(self) -> tuple[int, ...]:
        """Microbatches per size, largest first (`schedules.microbatch_groups`): a batch
        the count does not divide runs as two schedule steps, priced so."""
        if self.rows is None:
            return (self.microbatches,)
        return microbatch_groups(self.rows, self.microbatches)


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


@dataclass(frozen=True)
class PricedSchedule:
    schedule: str
    cuts: tuple[int, ...]
    timeline: Timeline
    peak_memory: float  # bytes on the fullest rank
    step_time: float  # the timeline's ranks, each done when its gradient sync is, seconds
    stage_times: tuple[float, ...] = ()  # one microbatch's forward + backward per stage
    sync: float = 0.0  # what the gradient sync adds to the timeline (step - timeline), s
    boundary: str = "placed"  # how activations cross the stages (`search.crossing`)

    def info(self) -> dict:
        """What the plan's search info records of the schedule (`views.tables.step_text`
        shows what the step time is made of)."""
        return {
            "bubble": self.timeline.bubble,
            "stage_times": [float(t) for t in self.stage_times],
            "gradient_sync": float(self.sync),
        }


def price_schedule(
    lc: LayerCosts | tuple[LayerCosts, ...],
    schedule: str,
    pp: int,
    microbatches: int | tuple[int, ...],
    cluster: Cluster,
    cuts: tuple[int, ...] | None = None,
    spans: dict[int, StageSpans] | None = None,
) -> PricedSchedule:
    """`lc`: the layers' costs on the stage mesh, or one per pipeline rank, each on the
    stage mesh of its rank (`LayerCosts.stage`; ranks of different shapes exchange their
    activations "canonical", `search.stage_meshes`). `microbatches`: a count, or the
    counts of `PipelineOptions.groups` (every microbatch priced at the captured, largest
    one's costs). `spans`: `StageSpans` by `id` of their costs, shared by the schedules
    priced on the same costs (its memo of stage prices is most of what cutting the stages
    costs)."""
    virtual = SCHEDULES[schedule]
    num = pp * virtual
    if cuts is not None and len(cuts) != num:
        raise ValueError(
            f"stage_cuts has {len(cuts)} entries but {schedule} on {pp} pipeline ranks "
            f"runs {num} stages"
        )
    ranks = stage_ranks(schedule, pp)
    per_rank = lc if isinstance(lc, tuple) else (lc,) * pp
    costs = [per_rank[r] for r in ranks]  # per stage
    subs = [c.stage or stage_cluster(cluster) for c in costs]  # its collectives' mesh axes
    if cuts is None:
        spans = {} if spans is None else spans
        for c, sub in zip(costs, subs, strict=True):
            spans.setdefault(id(c), StageSpans(c, sub))
        tables = [spans[id(c)].prices() for c in costs]
        cuts = balanced_cuts(costs[0].time, num, prices=tables)
    bounds = [*cuts, len(costs[0].layers)]
    stages = [layer_range(costs[s], bounds[s], bounds[s + 1]) for s in range(num)]
    times = [stage_time(p, subs[s], costs[s].comm) for s, p in enumerate(stages)]
    run = (costs, subs, schedule, pp, microbatches, cluster, cuts, stages, times, ranks)
    if len({id(c) for c in per_rank}) > 1:
        return _simulated(*run, boundary="canonical")
    between = sum(ranks[s] != ranks[s + 1] for s in range(num - 1))  # from rank to rank
    placed = _simulated(*run, boundary="placed")
    if not (any(costs[0].crossings[b].can_scatter for b in cuts[1:]) and between):
        return placed
    return min(placed, _simulated(*run, boundary="scattered"), key=lambda p: p.step_time)


def _simulated(
    costs, subs, schedule, pp, microbatches, cluster, cuts, stages, times, ranks, boundary
):
    """The schedule's timeline and step on `stages` (a microbatch's `times` each, on the
    stage meshes `subs`, their layers priced by `costs`), its activations crossing the
    `boundary` way (`search.crossing`: smaller messages between ranks where scattered or
    canonical, redistributions on every stage boundary, receiving and sending)."""
    num = len(stages)
    link = cluster.links[cluster.axis_names.index("pp")]
    # what each cut carries (the sending stage's placements; canonical: the same bytes)
    carried = [costs[s].crossings[cuts[s + 1]] for s in range(num - 1)]
    p2p = [send_recv_time(c.sent(boundary), link) for c in carried]
    times = list(times)
    fwd, bwd = [t / 3 for t in times], [2 * t / 3 for t in times]
    for s in range(num):  # a stage receives (all but the first) and sends (all but the last)
        receive = costs[s].crossings[cuts[s]].adds(boundary)[0] if s else (0.0, 0.0)
        send = carried[s].adds(boundary)[1] if s < num - 1 else (0.0, 0.0)
        for adds in (receive, send):
            fwd[s], bwd[s] = fwd[s] + adds[0], bwd[s] + adds[1]
            times[s] += sum(adds)
    wgrad = [p.wgrad for p in stages]
    share = cluster.device.core_share
    if share < 1:  # processes sharing CPU cores: a stage's compute speeds up while others wait
        compute = [stage_compute(p, t) for p, t in zip(stages, times, strict=True)]
        processes = {r: math.prod(subs[s].mesh_shape) for s, r in enumerate(ranks)}
        for s, f in enumerate(shared_core_factors(times, compute, ranks, processes, share)):
            saved = (1.0 - f) * compute[s]
            fwd[s], bwd[s] = fwd[s] - saved / 3, bwd[s] - 2 * saved / 3
            times[s] -= saved
            wgrad[s] *= f
    grads = [[g for g in p.grads if reduced_per_step(g)] for p in stages]
    ready = None
    if costs[0].zero:  # reduce-scatters; the parameters' all-gathers before each stage's forward
        ready = _gathered(grads, ranks, [c.zero for c in costs], subs)
        grads = [[(k, Collective.REDUCE_SCATTER, a, b) for k, _, a, b in gs] for gs in grads]
    tl = simulate(
        schedule,
        fwd,
        bwd,
        microbatches,
        pp,
        p2p,
        wgrad=wgrad,
        stash=[min(p.stash / p.act, 1.0) if p.act else 1.0 for p in stages],
        ready=ready,
    )
    peak, synced, updates = [], [], []
    shared = stage_copies(costs, cuts)  # shared parameters' copies beyond the parts' count
    for r in range(pp):
        own = [s for s in range(num) if ranks[s] == r]
        mine = [stages[s] for s in own]
        held = sum(p.state for p in mine) + sum(shared[s][0] for s in own)
        peak.append(held + max(p.act for p in mine) * tl.in_flight[r])
        syncs = [fused_time(grads[s], subs[s]) for s in own]
        overlap = subs[own[0]].device.overlap_efficiency
        done = synced_end(tl.ends[r], [tl.grads_done[s] for s in own], syncs, overlap)
        # the flat buffers' copies
        copies = sum(fused_copies(grads[s], subs[s], back=costs[s].cast_back) for s in own)
        synced.append(done + copies)
        updates.append(sum(p.update for p in mine) + sum(shared[s][1] for s in own))
    step = max(s + u for s, u in zip(synced, updates, strict=True))
    tied = shared_sum_seconds(costs, cuts, ranks, cluster)
    if tied:  # every rank joins the shared gradients' sums over pp, then steps
        step = max(synced) + tied + max(updates)
    sync = step - tl.step_time
    return PricedSchedule(schedule, cuts, tl, max(peak), step, tuple(times), sync, boundary)


def _gathered(grads: list[list[Grad]], ranks: list[int], ratios: list[float], subs) -> list[float]:
    """ZeRO: when each stage's parameters are gathered (`runtime.optimizer.ParamGather`):
    a rank issues one all-gather per stage and axis (`step.zero_gathers`) in stage order
    on its channel at the step's start (right after the previous optimizer step)."""
    ready, channel = [0.0] * len(grads), dict.fromkeys(ranks, 0.0)
    for s, gs in enumerate(grads):
        gathers = zero_gathers(gs, ratios[s])
        channel[ranks[s]] += fused_time(gathers, subs[s])
        ready[s] = channel[ranks[s]] + fused_copies(gathers, subs[s])  # copied out, then read
    return ready


def pipeline_weights(pp: int, microbatches: int, layers: dict[str, float]) -> CostWeights:
    """What the ILP of a pipelined graph weighs: each rank holds 1/pp of the layers and up
    to min(pp, microbatches) microbatches of their activations (1F1B's first rank), and
    reduces gradients once per step."""
    return CostWeights(layer=layers, activation=min(pp, microbatches), sync=1 / microbatches)


def solve_pipeline(
    captured: Captured,
    cluster: Cluster,
    stage_mesh: DeviceMesh,
    options: SearchOptions,
    pipeline: PipelineOptions,
    layers: dict[str, float] | None = None,
) -> tuple[IntraOpResult, PricedSchedule, dict[str, float]]:
    """One ILP for the stage mesh, then every schedule (or the pinned one) priced; the
    fastest that fits wins. `layers`: the graph is a template whose weighted layers stand
    for that many blocks each (see `CostWeights`, `LayerCosts.repeated`). Raises
    ValueError when none fits."""
    pp = cluster.axis_size("pp")
    options, weights, ilp_limit = stage_ilp(cluster, options, pipeline, layers)

    def solve(budget: float) -> IntraOpResult:
        result = solve_intra(captured, stage_cluster(cluster), stage_mesh, options, weights, budget)
        with_comm(result)
        return result

    def costs(result: IntraOpResult) -> LayerCosts:
        return layer_costs(captured, result).repeated(layers or {})

    return fitting_schedules(solve, costs, _planned, pp, cluster, pipeline, ilp_limit)


def _grouped(failures: list[tuple[str, str]]) -> str:
    """(schedule, why) per schedule, the schedules that fail for one reason named together
    ("gpipe, 1f1b: 2 pipeline stages need at least 2 layers; ...")."""
    by_why: dict[str, list[str]] = {}
    for schedule, why in failures:
        by_why.setdefault(why, []).append(schedule)
    return "; ".join(f"{', '.join(names)}: {why}" for why, names in by_why.items())


def _planned(result: IntraOpResult) -> float:
    """The memory the stage ILP planned (its budget's share used)."""
    return result.memory


def fitting_schedules(solve, costs, memory, pp, cluster, pipeline, ilp_limit):
    """(answers, best, {schedule: step}): `solve(budget)` the stage ILPs' answers under a
    budget (every rank's, summed), `costs(answers)` each rank's `LayerCosts` (one, or a
    tuple per rank), every schedule (or the pinned one) priced, the fastest that fits
    wins. When none fits, the ILPs are solved again under a budget smaller in proportion
    to what the ranks need (`memory(answers)`: what the ILPs planned; recompute, reshard,
    more sharding), `_RETRIES` times while they can. ValueError when none fits."""
    limit = ilp_limit / pp
    candidates = [pipeline.schedule] if pipeline.schedule else list(SCHEDULES)
    answers = solve(ilp_limit)
    for attempt in range(_RETRIES + 1):
        found = price_schedules(costs(answers), candidates, pp, cluster, pipeline, limit)
        priced, failures, least = found
        if priced or attempt == _RETRIES or not math.isfinite(least):
            break
        ilp_limit = min(ilp_limit, memory(answers)) * limit / least * 0.98
        try:
            answers = solve(ilp_limit)
        except MemoryInfeasible:
            break
    if not priced:
        raise ValueError("no pipeline schedule fits: " + _grouped(failures))
    best = min(priced, key=lambda p: p.step_time)
    return answers, best, {p.schedule: p.step_time for p in priced}


_RETRIES = 2  # ILP re-solves under a tighter budget when no schedule fits


def prepare_pipeline(captured, cluster, stage_mesh, options, pipeline, layers=None) -> None:
    """`intra_op.prepare_intra` of `solve_pipeline`'s first ILP (`search.ahead`)."""
    options, weights, ilp_limit = stage_ilp(cluster, options, pipeline, layers)
    prepare_intra(captured, stage_cluster(cluster), stage_mesh, options, weights, ilp_limit)


def stage_ilp(cluster: Cluster, options, pipeline: PipelineOptions, layers):
    """(options, weights, memory limit) of a pipeline's stage ILP: every rank's budget
    summed (the ILP prices 1/pp of the layers per rank, `pipeline_weights`)."""
    pp = cluster.axis_size("pp")
    limit = options.memory_limit or cluster.device.memory_bytes * 0.9
    # ZeRO-2 in a pipeline: the microbatches accumulate the full-size gradients before
    # the reduce-scatter (`runtime.stage_grads.GradientScatter`), so the peak holds them
    options = replace(options, shard_gradients=False)
    return options, pipeline_weights(pp, pipeline.microbatches, layers or {}), limit * pp


class Dominated(Exception):  # noqa: N818 - not an error: the layout loses
    """No schedule of this layout can beat `PipelineOptions.bar` (not an infeasibility)."""


def with_comm(result: IntraOpResult) -> None:
    """The stage programs run the communication pass (`passes.comm`): record it on
    `result`, whose stage times are then priced with it (`stage_time`)."""
    result.comm = DEFAULT_COMM
    result.info["comm_pass"] = result.comm is not None


def price_schedules(lc, candidates, pp, cluster, pipeline, limit):
    """(schedules that fit, (schedule, why) of the others, the least peak of those priced)."""
    priced: list[PricedSchedule] = []
    failures, least = [], math.inf
    per_rank = lc if isinstance(lc, tuple) else (lc,)
    spans = {id(c): StageSpans(c, c.stage or stage_cluster(cluster)) for c in per_rank}
    # each rank runs its stages for every microbatch back to back (DualPipeV's pairs too), a
    # stage's time at least its share of the whole's (first gathers, last buckets add up)
    # (ranks on meshes of different shapes: no such bound, each rank's stages on its own)
    (span,) = spans.values() if len(spans) == 1 else (None,)
    bound = pipeline.microbatches * span(0, len(span.lc.layers)) / pp if span else 0.0
    if bound >= pipeline.bar:
        raise Dominated(f"work bound {bound:.4g} s >= best {pipeline.bar:.4g} s")
    for sched in candidates:
        try:
            p = price_schedule(lc, sched, pp, pipeline.groups, cluster, pipeline.stage_cuts, spans)
        except ValueError as exc:
            failures.append((sched, str(exc)))
            continue
        least = min(least, p.peak_memory)
        if p.peak_memory <= limit:
            priced.append(p)
        else:
            failures.append((sched, f"needs {p.peak_memory / 2**30:.1f} GiB per device"))
    return priced, failures, least
