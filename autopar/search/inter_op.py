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
ranks, and gives each rank's peak in-flight microbatches, which multiplies its stages'
activation memory. Each stage all-reduces its replicated parameters' gradients once per
step from its last backward (`reduced_per_step`, `runtime.pipeline.GradientSync`), one
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
(`IntraOpResult.held_weights`); the one-layer working sets of recompute and regathering
are in the ILP's memory, not in a rank's peak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import groupby

from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.capture.analysis import batch_dependent, layer_order
from autopar.capture.export import layer_of
from autopar.cluster import Cluster
from autopar.cost_models.buckets import Grad, collective_times, fused_copies, fused_time
from autopar.cost_models.comm import Collective, send_recv_time
from autopar.plan import (
    DEFAULT_COMM,
    SCHEDULES,
    CommPlan,
    stage_ranks,
)
from autopar.search.costs import CostWeights
from autopar.search.crossing import Crossing, crossing
from autopar.search.ilp import MemoryInfeasible
from autopar.search.intra_op import IntraOpResult, prepare_intra, solve_intra
from autopar.search.pins import SearchOptions
from autopar.search.schedules import (
    Timeline,
    microbatch_groups,
    simulate,
    synced_end,
    weight_gradient_work,
)
from autopar.search.stage_cuts import balanced_cuts, range_prices
from autopar.search.step import (
    Part,
    overlapped_time,
    param_itemsize,
    program_parts,
    zero_gather_ratio,
    zero_gathers,
)


@dataclass(frozen=True, slots=True)
class PipelineOptions:
    microbatches: int
    schedule: str | None = None  # None: search all
    stage_cuts: tuple[int, ...] | None = None  # None: balanced by cost
    rows: int | None = None  # the batch's; None: the microbatch count divides it
    bar: float = math.inf  # the layout search's best step: schedules that cannot beat it

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


@dataclass(frozen=True, slots=True)
class PartCost:
    """One layer (or the part of the graph before/after the layers) on one stage mesh."""

    time: float = 0.0  # forward + backward per microbatch, seconds
    sync: float = 0.0  # parameter-gradient reduction, once per step, seconds (as the ILP)
    state: float = 0.0  # parameters, gradients, optimizer state, bytes
    act: float = 0.0  # saved activations per microbatch, bytes
    grads: tuple[Grad, ...] = ()  # the gradient reductions behind `sync`
    # zero-bubble schedules (`schedules.weight_gradient_work`): the part of `time` their W
    # action runs, seconds, and the bytes held from I to W, per microbatch
    wgrad: float = 0.0
    stash: float = 0.0
    update: float = 0.0  # the optimizer's update of its parameters, once per step, seconds
    # what the stage program runs, for its time with the communication pass (`search.step`)
    program: tuple[Part, ...] = ()

    def __add__(self, other: PartCost) -> PartCost:
        sums = (a + b for a, b in zip(self.astuple(), other.astuple(), strict=True))
        return PartCost(
            *sums,
            grads=self.grads + other.grads,
            wgrad=self.wgrad + other.wgrad,
            stash=self.stash + other.stash,
            update=self.update + other.update,
            program=self.program + other.program,
        )

    def astuple(self) -> tuple[float, float, float, float]:
        return (self.time, self.sync, self.state, self.act)


@dataclass(frozen=True)
class LayerCosts:
    layers: tuple[str, ...]
    parts: tuple[PartCost, ...]  # per layer
    pre: PartCost  # outside the layers, before the first (embedding)
    post: PartCost  # after the last layer (final norm, head, loss)
    crossing: Crossing  # what an activation crossing a stage boundary costs (placed, scattered)
    comm: CommPlan | None = None  # the stage programs' communication pass (None: none)
    # ZeRO: bytes the all-gathers after the optimizer step move (the working parameters,
    # `runtime.optimizer.ParamState`) per gradient byte reduced; 0: no ZeRO
    zero: float = 0.0
    # the once-per-step reduction runs in another dtype than the gradients: its sums are
    # cast back into them (`runtime.stage_grads`; else they are the buffer's slices)
    cast_back: bool = False

    @property
    def time(self) -> list[float]:
        return [p.time for p in self.parts]

    def repeated(self, total: int) -> LayerCosts:
        """A template's costs stretched to `total` layers: the last captured layer stands
        for all the layers that were not captured (they are identical)."""
        if total <= len(self.layers):
            return self
        prefix = self.layers[-1].rsplit(".", 1)[0]
        extra = total - len(self.layers)
        return replace(
            self,
            layers=(*self.layers, *(f"{prefix}.{len(self.layers) + i}" for i in range(extra))),
            parts=(*self.parts, *(self.parts[-1],) * extra),
        )


def layer_costs(captured: Captured, result: IntraOpResult) -> LayerCosts:
    layers = layer_order(captured)
    index = {name: i for i, name in enumerate(layers)}
    # with the pass, each part's program (unweighted: `repeated` copies the layers)
    program = [
        (replace(p, weight=1.0),) if result.comm is not None else ()
        for p in program_parts(captured, result)
    ]
    parts = [PartCost(program=p) for p in program[1:-1]]
    pre, post = PartCost(program=program[0]), PartCost(program=program[-1])
    seen_layer = False
    batch = batch_dependent(captured)
    for n in captured.gm.graph.nodes:
        if n not in result.chosen or n.op == "output":
            continue
        time, sync = result.node_times(n)
        mem = result.node_memory(n)
        state = n.op == "placeholder" or n not in batch
        held = result.held_weights(n)  # gathered weights kept until backward: once per stage
        grads = tuple(g for pos, op in result.ctx.operands(n) for g in _grads(result, n, pos, op))
        w = weight_gradient_work(result.ctx, n, result.chosen[n])
        cost = PartCost(time, sync, (mem if state else 0.0) + held, 0.0 if state else mem,
                        grads, *w, update=result.ctx.update_time(n, result.chosen[n]))  # fmt: skip
        layer = layer_of(n)
        if layer is not None:
            seen_layer = True
            parts[index[layer]] += cost
        elif seen_layer:
            post += cost
        else:
            pre += cost
    zero, cast = zero_gather_ratio(captured, result), result.ctx.reduce_itemsize
    cast_back = bool(cast) and cast != param_itemsize(captured)
    cross = crossing(captured, result)
    return LayerCosts(tuple(layers), tuple(parts), pre, post, cross, result.comm, zero, cast_back)


def _grads(result: IntraOpResult, n, pos: int, op) -> list[Grad]:
    src = result.ctx.output_spec(op, result.chosen[op.producer])
    return result.ctx.grad_reductions(op, src, n, result.chosen[n], pos)


def _stage_parts(lc: LayerCosts, cuts: tuple[int, ...]) -> list[PartCost]:
    bounds = [*cuts, len(lc.layers)]
    return [_layer_range(lc, bounds[s], bounds[s + 1]) for s in range(len(cuts))]


def _layer_range(lc: LayerCosts, first: int, end: int) -> PartCost:
    """A stage of layers first..end-1 (with what precedes the first layer / follows the
    last when it holds them)."""
    total = sum(lc.parts[first:end], PartCost())
    if first == 0:
        total = lc.pre + total
    if end == len(lc.layers):
        total += lc.post
    return total


class _StageSpans:
    """`balanced_cuts`' price of a stage of layers i..j-1 (`span(i, j)`): `stage_time`, what
    the schedule is priced with (overlap does not add up layer by layer: a stage's first
    gather and last gradient bucket are exposed). A template's repeated layers are one
    object, so ranges of them that hold as many are priced once; `prices()`, the table of
    every range, is made once for the schedules priced on the same costs."""

    def __init__(self, lc: LayerCosts, cluster: Cluster):
        self.lc, self.cluster, self.n = lc, cluster, len(lc.layers)
        self.seen: dict[tuple, float] = {}
        self.table = None
        # same[i]: the end of the run of lc.parts[i]'s object
        self.same = list(range(1, self.n + 1))
        for i in reversed(range(self.n - 1)):
            if lc.parts[i] is lc.parts[i + 1]:
                self.same[i] = self.same[i + 1]

    def __call__(self, i: int, j: int) -> float:
        lc, n = self.lc, self.n
        key = (i == 0, j == n, id(lc.parts[i]), j - i) if j <= self.same[i] else (i, j)
        if key not in self.seen:
            self.seen[key] = stage_time(_layer_range(lc, i, j), self.cluster, lc.comm)
        return self.seen[key]

    def prices(self):
        if self.table is None:
            self.table = range_prices(self.lc.time, self)
        return self.table


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
    lc: LayerCosts,
    schedule: str,
    pp: int,
    microbatches: int | tuple[int, ...],
    cluster: Cluster,
    cuts: tuple[int, ...] | None = None,
    span: _StageSpans | None = None,
) -> PricedSchedule:
    """`microbatches`: a count, or the counts of `PipelineOptions.groups` (every
    microbatch priced at the captured, largest one's costs). `span`: `_StageSpans(lc,
    stage_cluster(cluster))`, shared by the schedules priced on the same costs (its
    memo of stage prices is most of what cutting the stages costs)."""
    virtual = SCHEDULES[schedule]
    num = pp * virtual
    if cuts is not None and len(cuts) != num:
        raise ValueError(
            f"stage_cuts has {len(cuts)} entries but {schedule} on {pp} pipeline ranks "
            f"runs {num} stages"
        )
    sub = stage_cluster(cluster)  # the mesh axes of the stage programs' collectives
    if cuts is None:
        cuts = balanced_cuts(lc.time, num, prices=(span or _StageSpans(lc, sub)).prices())
    stages = _stage_parts(lc, cuts)
    ranks = stage_ranks(schedule, pp)
    between = sum(ranks[s] != ranks[s + 1] for s in range(num - 1))  # from rank to rank
    times = [stage_time(p, sub, lc.comm) for p in stages]
    run = (lc, schedule, pp, microbatches, cluster, cuts, stages, times, ranks)
    placed = _simulated(*run, scattered=False)
    if not (lc.crossing.can_scatter and between):
        return placed
    return min(placed, _simulated(*run, scattered=True), key=lambda p: p.step_time)


def _simulated(lc, schedule, pp, microbatches, cluster, cuts, stages, times, ranks, scattered):
    """The schedule's timeline and step on `stages` (a microbatch's `times` each), its
    activations placed or scattered (`search.crossing`: smaller messages between ranks,
    redistributions on every stage boundary, receiving and sending)."""
    num, sub, cross = len(stages), stage_cluster(cluster), lc.crossing
    link = cluster.links[cluster.axis_names.index("pp")]
    p2p = send_recv_time(cross.scattered_bytes if scattered else cross.placed_bytes, link)
    times = list(times)
    fwd, bwd = [t / 3 for t in times], [2 * t / 3 for t in times]
    if scattered:  # a stage receives (all but the first) and sends (all but the last)
        for s in range(num):
            for adds, on in ((cross.receive, s > 0), (cross.send, s < num - 1)):
                fwd[s], bwd[s] = fwd[s] + adds[0] * on, bwd[s] + adds[1] * on
                times[s] += sum(adds) * on
    grads = [[g for g in p.grads if reduced_per_step(g)] for p in stages]
    ready = None
    if lc.zero:  # reduce-scatters; the parameters' all-gathers before each stage's forward
        ready = _gathered(grads, ranks, lc.zero, sub)
        grads = [[(k, Collective.REDUCE_SCATTER, a, b) for k, _, a, b in gs] for gs in grads]
    tl = simulate(
        schedule,
        fwd,
        bwd,
        microbatches,
        pp,
        p2p,
        wgrad=[p.wgrad for p in stages],
        stash=[min(p.stash / p.act, 1.0) if p.act else 1.0 for p in stages],
        ready=ready,
    )
    peak, finish = [], []
    for r in range(pp):
        own = [s for s in range(num) if ranks[s] == r]
        mine = [stages[s] for s in own]
        peak.append(sum(p.state for p in mine) + max(p.act for p in mine) * tl.in_flight[r])
        syncs = [fused_time(grads[s], sub) for s in own]
        overlap = sub.device.overlap_efficiency
        done = synced_end(tl.ends[r], [tl.grads_done[s] for s in own], syncs, overlap)
        copies = sum(fused_copies(grads[s], sub, back=lc.cast_back) for s in own)  # flat buffers
        finish.append(done + copies + sum(p.update for p in mine))  # then its optimizer step
    step = max(finish)
    boundary = "scattered" if scattered else "placed"
    sync = step - tl.step_time
    return PricedSchedule(schedule, cuts, tl, max(peak), step, tuple(times), sync, boundary)


def _gathered(grads: list[list[Grad]], ranks: list[int], ratio: float, sub) -> list[float]:
    """ZeRO: when each stage's parameters are gathered (`runtime.optimizer.ParamGather`):
    a rank issues one all-gather per stage and axis (`step.zero_gathers`) in stage order
    on its channel at the step's start (right after the previous optimizer step)."""
    ready, channel = [0.0] * len(grads), dict.fromkeys(ranks, 0.0)
    for s, gs in enumerate(grads):
        gathers = zero_gathers(gs, ratio)
        channel[ranks[s]] += fused_time(gathers, sub)
        ready[s] = channel[ranks[s]] + fused_copies(gathers, sub)  # copied out, then read
    return ready


def reduced_per_step(grad: Grad) -> bool:
    """Whether a stage reduces `grad` once per step, from its last backward: a replicated
    parameter's all-reduce, left partial (`runtime.pipeline._DeferGradSync`) for
    `GradientSync`. Every other gradient collective (a sharded parameter's reduce-scatter)
    runs in each microbatch's backward program (its parameter is not deferred)."""
    return Collective(grad[1]) is Collective.ALL_REDUCE


def stage_time(stage: PartCost, cluster: Cluster, comm: CommPlan | None) -> float:
    """Seconds of one microbatch's forward and backward programs of `stage` on the stage
    mesh `cluster`, with the gradient collectives those programs run (a sharded
    parameter's reduce-scatter, every microbatch; not the all-reduces `reduced_per_step`
    leaves to a stage's last backward): with the communication pass, its gathers fused per
    layer and prefetched, its gradients bucketed behind the backward, its waits at first
    use (`search.step.overlapped_time`); without it, every collective waited at once, one
    per tensor (the ILP's)."""
    if comm is None or not stage.program:
        return stage.time + collective_times(_in_program(stage.grads), cluster, fused=False)
    # a template's repeated layer (one object) as one part of that weight: the same price
    runs = [list(run) for _, run in groupby(stage.program, key=id)]
    program = [
        replace(r[0], weight=r[0].weight * len(r), grads=_in_program(r[0].grads)) for r in runs
    ]
    return overlapped_time(program, cluster, comm)


def _in_program(grads) -> list[Grad]:
    return [g for g in grads if not reduced_per_step(g)]


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
    total_layers: int | None = None,
) -> tuple[IntraOpResult, PricedSchedule, dict[str, float]]:
    """One ILP for the stage mesh, then every schedule (or the pinned one) priced; the
    fastest that fits wins. `layers`/`total_layers`: the graph is a template whose layers
    stand for `total_layers` (see `CostWeights`). Raises ValueError when none fits."""
    pp = cluster.axis_size("pp")
    limit = options.memory_limit or cluster.device.memory_bytes * 0.9
    options, weights, ilp_limit = _stage_ilp(cluster, options, pipeline, layers)
    candidates = [pipeline.schedule] if pipeline.schedule else list(SCHEDULES)
    result = solve_intra(captured, stage_cluster(cluster), stage_mesh, options, weights, ilp_limit)
    with_comm(result)
    for attempt in range(_RETRIES + 1):
        lc = layer_costs(captured, result).repeated(total_layers or 0)
        priced, failures, least = _price_schedules(lc, candidates, pp, cluster, pipeline, limit)
        if priced or attempt == _RETRIES or not math.isfinite(least):
            break
        # the ranks need `least`: ask the ILP for proportionally less (recompute, reshard,
        # more sharding), while it can
        ilp_limit = min(ilp_limit, result.memory) * limit / least * 0.98
        try:
            result = solve_intra(
                captured, stage_cluster(cluster), stage_mesh, options, weights, ilp_limit
            )
        except MemoryInfeasible:
            break
        with_comm(result)
    if not priced:
        raise ValueError("no pipeline schedule fits: " + "; ".join(failures))
    best = min(priced, key=lambda p: p.step_time)
    return result, best, {p.schedule: p.step_time for p in priced}


_RETRIES = 2  # ILP re-solves under a tighter budget when no schedule fits


def prepare_pipeline(captured, cluster, stage_mesh, options, pipeline, layers=None) -> None:
    """`intra_op.prepare_intra` of `solve_pipeline`'s first ILP (`search.ahead`)."""
    options, weights, ilp_limit = _stage_ilp(cluster, options, pipeline, layers)
    prepare_intra(captured, stage_cluster(cluster), stage_mesh, options, weights, ilp_limit)


def _stage_ilp(cluster: Cluster, options, pipeline: PipelineOptions, layers):
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


def _price_schedules(lc, candidates, pp, cluster, pipeline, limit):
    """(schedules that fit, why the others do not, the least peak of those priced)."""
    priced: list[PricedSchedule] = []
    failures, least = [], math.inf
    span = _StageSpans(lc, stage_cluster(cluster))
    # each rank runs its stages for every microbatch back to back (DualPipeV's pairs too), a
    # stage's time at least its share of the whole's (first gathers, last buckets add up)
    bound = pipeline.microbatches * span(0, len(lc.layers)) / pp
    if bound >= pipeline.bar:
        raise Dominated(f"work bound {bound:.4g} s >= best {pipeline.bar:.4g} s")
    for sched in candidates:
        try:
            p = price_schedule(lc, sched, pp, pipeline.groups, cluster, pipeline.stage_cuts, span)
        except ValueError as exc:
            failures.append(f"{sched}: {exc}")
            continue
        least = min(least, p.peak_memory)
        if p.peak_memory <= limit:
            priced.append(p)
        else:
            failures.append(f"{sched}: needs {p.peak_memory / 2**30:.1f} GiB per device")
    return priced, failures, least
