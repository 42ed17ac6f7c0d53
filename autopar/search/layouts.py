"""Alpa's outer loop: how the cluster's devices are laid out for one model.

`search_layout(model, batch, cluster, options, ...) -> LayoutSearch`

A *layout* is a pipeline degree `pp`, the logical mesh every stage runs on, `(dp, tp)` with
`pp * dp * tp` = the cluster's devices (ranks row-major, so `tp` is the fastest axis and
stays inside a node: `tp` is a power of two dividing the devices per node), the number of
microbatches `M` and the schedule. The stage mesh's axes are only names: the intra-op ILP
decides what each axis does (batch, ZeRO, Megatron TP/SP, ...). Stages are uniform (every
stage gets the same submesh shape, as in Megatron and torchtitan) while the degrees are
priced; then the winner, if pipelined, is offered Alpa's choice of submesh with the device
count fixed (`search.stage_meshes`): the rank holding the embedding, the one holding the
head, or both, on the neighbouring (dp, tp) shapes (tp halved or doubled), its schedule and
microbatches kept; a variant that is faster wins (`Layout.rank_meshes`).

Each candidate is priced on a *template* (`autopar.capture.template`: the model captured
with two of its blocks, the second weighted by the number of blocks it stands for) at the
microbatch's shape, cached by shape, so a 112-block model prices like a 2-block one:
`pp == 1` by the overlapped step (`IntraOpResult.step_time`, the whole batch), `pp > 1` by
`inter_op.solve_pipeline` (the ILP with pipeline weights, then every schedule simulated).
Microbatches hold `mbs` rows per data-parallel replica, `mbs` in 1, 2 (Megatron's micro
batch size), so `M = rows / (dp * mbs)`, and `M >= pp`. Without a pipeline, `M = 1` (the
whole batch) or, where that needs memory levers or does not fit, gradient accumulation over
`M > 1` microbatches: a pipeline on a "pp" axis of 1, its schedules priced as for any
degree (two stages on the one rank, as interleaved and V-shaped schedules run, let the
first-finished stage's gradient reduction overlap the other's last backward).

Which degrees: for each `tp`, every divisor `pp` of `devices / tp` that divides the number
of blocks (they are few: 26 for 48 GPUs and 24 blocks); microbatch sizes grow until one
does not fit. The step time is not unimodal in `pp` (the memory levers switch on and off,
the divisors jump, a schedule starts to fit), so no degree is skipped on the strength of
its neighbours: every one is priced, the degrees without a pipeline first (their answer is
the bar the pipelines must beat). On several cores the degrees are shared out among this
process and forked ones (`search.workers`), each pricing under the best step any has found.
A model without two blocks, or one whose forward updates buffers (pipeline stages do not
write them back), is searched without pipelines.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from autopar._compat import shape_only_mesh
from autopar.capture.analysis import layer_order
from autopar.capture.export import layer_of
from autopar.capture.rows import AnyRows
from autopar.capture.template import Template, capture_template, start_check
from autopar.cluster import Cluster
from autopar.cost_models import compute
from autopar.passes.strategies.rules.random_ops import random_draws
from autopar.plan import Plan
from autopar.search import ahead, workers
from autopar.search.costs import VIEW_OPS
from autopar.search.ilp import MemoryInfeasible, SolverTimeout
from autopar.search.inter_op import Dominated, PipelineOptions
from autopar.search.pins import SearchOptions
from autopar.search.progress import candidate, phase
from autopar.search.schedules import microbatch_rows
from autopar.search.stage_meshes import rank_variants
from autopar.search.template_plan import prepare_on_template, solve_on_template

MICROBATCH_ROWS = (1, 2)  # rows per data-parallel replica in one microbatch


@dataclass(frozen=True, slots=True)
class Layout:
    pp: int
    dp: int
    tp: int
    microbatches: int
    schedule: str | None = None  # None: no pipeline
    # per pipeline rank, its stage mesh's (dp, tp) where they differ (() : all (dp, tp))
    rank_meshes: tuple[tuple[int, ...], ...] = ()

    @property
    def key(self) -> str:
        sched = f" {self.schedule}" if self.schedule else ""
        ranks = " ranks " + ",".join("x".join(map(str, m)) for m in self.rank_meshes)
        return f"pp{self.pp} dp{self.dp} tp{self.tp} m{self.microbatches}{sched}" + (
            ranks if self.rank_meshes else ""
        )

    @property
    def accumulates(self) -> bool:
        """Gradient accumulation: several microbatches on a pipeline of one rank (each of
        its stages' gradients reduced once, after that stage's last backward)."""
        return self.pp == 1 and self.microbatches > 1

    def cluster(self, base: Cluster) -> Cluster:
        """`base`'s devices on this layout's mesh: ("pp", "dp", "tp"), size-1 axes dropped
        (one stage axis is always kept; an accumulating layout keeps its "pp" axis of 1,
        what makes the plan a one-stage pipeline)."""
        axes = [("pp", self.pp), ("dp", self.dp), ("tp", self.tp)]
        kept = [
            (n, s)
            for n, s in axes
            if s > 1 or (n == "pp" and self.accumulates) or (n != "pp" and self.rank_meshes)
        ]
        kept = kept or [("dp", 1)]
        if [n for n, _ in kept] == ["pp"]:
            kept.append(("dp", 1))
        return base.reshaped([s for _, s in kept], [n for n, _ in kept])


@dataclass
class LayoutSearch:
    # every layout priced: (step seconds, peak bytes, layout), fastest first (`best`)
    priced: list[tuple[float, float, Layout]]
    tried: dict[str, float | str] = field(default_factory=dict)  # key -> seconds or why not
    search_time_s: float = 0.0
    templates: dict[int, Template] = field(default_factory=dict)  # microbatch rows -> template
    # captures a template the search's other processes priced on (`search.workers`)
    capture: Callable[[int], Template] | None = None

    @property
    def best(self) -> Layout:
        return self.priced[0][2]

    @property
    def step_time(self) -> float:
        return self.priced[0][0]

    @property
    def peak_memory(self) -> float:
        return self.priced[0][1]

    def template_for(self, layout: Layout, rows: int) -> Template | None:
        """The template captured at `layout`'s microbatch shape (None if it cut nothing)."""
        mb_rows = microbatch_rows(rows, layout.microbatches)[0]
        if mb_rows not in self.templates and self.capture is not None:
            self.capture(mb_rows)  # priced on another process: captured here again
        tpl = self.templates.get(mb_rows)
        return tpl if tpl is not None and tpl.total_layers is not None else None

    def fastest_fitting(self, plan_on: Callable[[Layout], Plan], bound: float):
        """(plan, layout): the fastest layout whose final plan (`plan_on(layout)`) has a
        liveness-simulated peak within `bound` bytes. The search prices a pipeline's peak
        from its stages' states and activations, without the gradient buckets and gather
        buffers the final plan's simulation counts (and measurement confirms), so a winner
        can plan above it; then the next fastest priced layouts are planned
        (`MEMORY_FALLBACKS` of them, each marked in `tried`). None fitting, the winner
        is kept, with its plan's warnings (`planning.warn_if_over_memory` names the fix)."""
        kept = None
        for _, _, layout in self.priced[: 1 + MEMORY_FALLBACKS]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                plan = plan_on(layout)
            fits = plan.predicted_peak_memory <= bound
            if kept is None or fits:
                kept = (plan, layout, caught)
            if fits:
                break
            peak = plan.predicted_peak_memory / 2**30
            self.tried[layout.key] = (
                f"over memory: its plan's simulated peak is {peak:.3g} GiB per device, "
                f"above {bound / 2**30:.3g} GiB (priced {self.tried[layout.key]:.4g} s)"
            )
        plan, layout, caught = kept
        for w in caught:  # as the kept plan's own call gives them
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        return plan, layout


MEMORY_FALLBACKS = 3  # layouts planned after a winner whose final plan is over the bound


@dataclass
class _Pricer:
    model: nn.Module
    batch: Sequence[torch.Tensor]
    cluster: Cluster
    options: SearchOptions
    loss_fn: Callable | None
    templates: dict[int, Template] = field(default_factory=dict)
    # (dp, tp) whose whole batch needs memory levers or does not fit: where accumulating
    # gradients over microbatches can pay. Where it fits without levers, accumulation
    # cannot: smaller matmuls, more launches, the gradient reduction after the last
    # microbatch instead of behind the whole backward, the same states.
    pressed: set[tuple[int, int]] = field(default_factory=set)
    following: dict[Layout, Layout] = field(default_factory=dict)  # the next one priced
    any_rows: AnyRows = field(default_factory=AnyRows)  # one trace for every microbatch size

    def template(self, rows: int) -> Template:
        if rows not in self.templates:
            mb = tuple(t[:rows] if t.ndim else t for t in self.batch)
            with phase("capture"):
                self.templates[rows] = capture_template(
                    self.model, mb, self.loss_fn, tracer=self.any_rows
                )
        return self.templates[rows]

    def prepare_next(self, layout: Layout, bar: float) -> None:
        """While `layout`'s ILP solves: what pricing the next layout that will not surely be
        skipped (an accumulation not asked for, a compute bound over `bar`) computes before
        its own ILP (its template, strategies and prices, `search.ahead`)."""
        nxt = self.following.get(layout)
        while nxt is not None and (
            (nxt.accumulates and (nxt.dp, nxt.tp) not in self.pressed) or self.bound(nxt) >= bar
        ):
            nxt = self.following.get(nxt)
        if nxt is not None:
            prepare_on_template(*self._problem(nxt), self.options, self._pipeline(nxt))

    def bound(self, layout: Layout) -> float:
        """A lower bound of `layout`'s step time: its ranks do M microbatches of compute,
        summed over the pp ranks at least the whole model's (`compute_bound`), and no
        schedule, communication or memory lever takes any away."""
        tpl = self.template(microbatch_rows(self.batch[0].shape[0], layout.microbatches)[0])
        per_mb = compute_bound(tpl, self.cluster, layout.dp * layout.tp)
        return per_mb * layout.microbatches / layout.pp

    def price(
        self, layout: Layout, schedule: str | None, bar: float = math.inf
    ) -> tuple[float, float, Layout]:
        """(step seconds, peak bytes, the layout with its schedule); ValueError if none fits,
        `Dominated` if a pipeline's stages cannot beat `bar` (then no schedule is priced)."""
        tpl, cluster, mesh = self._problem(layout)
        pipeline = self._pipeline(layout, schedule, bar)
        if pipeline is None:
            result = solve_on_template(tpl, cluster, mesh, self.options, None)
            if any(result.memory_plan):
                self.pressed.add((layout.dp, layout.tp))
            return result.step_time, result.memory, layout
        result, best, _ = solve_on_template(tpl, cluster, mesh, self.options, pipeline)
        chosen = Layout(layout.pp, layout.dp, layout.tp, layout.microbatches, best.schedule)
        return best.step_time, best.peak_memory, chosen

    def _problem(self, layout: Layout) -> tuple[Template, Cluster, object]:
        """(template at the largest microbatch's shape, cluster, mesh) `layout` is priced on;
        the mesh has shapes only: it prices any device's plan, and rank 0 of a running job
        can build meshes the other ranks never do."""
        tpl = self.template(microbatch_rows(self.batch[0].shape[0], layout.microbatches)[0])
        cluster = layout.cluster(self.cluster)
        return tpl, cluster, shape_only_mesh("cpu", cluster.mesh_shape, cluster.axis_names)

    def _pipeline(self, layout: Layout, schedule=None, bar: float = math.inf):
        """The pipeline `layout` is priced as (None: no pipeline, the whole batch at once)."""
        if layout.pp == 1 and not layout.accumulates:
            return None
        rows = self.batch[0].shape[0]
        meshes = layout.rank_meshes
        return PipelineOptions(
            layout.microbatches, schedule, rows=rows, bar=bar, rank_meshes=meshes
        )


def candidate_layouts(
    cluster: Cluster, rows: int, layers: int, pp: int | None = None, microbatches: int | None = None
) -> dict[int, list[list[Layout]]]:
    """tp -> per pipeline degree (ascending), its layouts (one per microbatch count)."""
    world, per_node = cluster.world_size, cluster.devices_per_node
    tps = [t for t in (1, 2, 4, 8, 16) if per_node % t == 0 and world % t == 0]
    out: dict[int, list[list[Layout]]] = {}
    for tp in tps:
        # uniform stages: the degree divides the block count (as Megatron requires)
        degrees = [p for p in _divisors(world // tp) if layers % p == 0 or p == 1]
        if pp is not None:
            degrees = [p for p in degrees if p == pp]
        rows_by_degree = []
        for p in degrees:
            dp = world // (tp * p)
            if p == 1 and microbatches is not None:
                counts = [microbatches] if microbatches <= rows and rows % dp == 0 else []
            elif p == 1:  # the whole batch, then accumulation (most microbatches first)
                counts = [rows // (dp * b) for b in MICROBATCH_ROWS if rows % (dp * b) == 0]
                counts = ([1] if rows % dp == 0 else []) + [m for m in counts if m > 1]
            elif microbatches is not None:
                counts = [microbatches] if microbatches <= rows else []  # uneven: priced so
            else:
                counts = [rows // (dp * b) for b in MICROBATCH_ROWS if rows % (dp * b) == 0]
            counts = [m for m in counts if p == 1 or m >= p]
            if counts:
                rows_by_degree.append([Layout(p, dp, tp, m) for m in counts])
        if rows_by_degree:
            out[tp] = rows_by_degree
    return out


def search_layout(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    cluster: Cluster,
    options: SearchOptions,
    loss_fn: Callable | None = None,
    pipeline_stages: int | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
) -> LayoutSearch:
    with phase("layout search"):
        return _search_layout(
            model, batch, cluster, options, loss_fn, pipeline_stages, microbatches, schedule
        )


def _search_layout(
    model, batch, cluster, options, loss_fn, pipeline_stages, microbatches, schedule
) -> LayoutSearch:
    t0 = time.perf_counter()
    _check_state_fits(model, cluster, options)
    pricer = _Pricer(model, batch, cluster, options, loss_fn)
    rows = batch[0].shape[0]
    # the three-block check, forked now at the lowest priority: it runs on the cycles the
    # template's traces and the pricing processes leave idle, and on its own at the end
    check = start_check(model, batch, loss_fn)
    whole = pricer.template(rows)
    whole.adopt(check)
    layers = whole.total_layers or _captured_layers(pricer)
    if layers < 2 or whole.captured.mutated_buffers or random_draws(whole.captured.gm):
        pipeline_stages = 1  # nothing to cut, or per-microbatch BatchNorm statistics or
        # dropout masks (planning.check_pipelines_take)
    candidates = candidate_layouts(cluster, rows, layers, pipeline_stages, microbatches)
    if not candidates:
        raise ValueError(
            f"no layout of {cluster.world_size} devices splits a batch of "
            f"{rows} rows evenly; use a batch divisible by the data-parallel "
            "degree (e.g. a multiple of the device count)"
        )
    degrees = pricing_order([d for by_degree in candidates.values() for d in by_degree])
    try:
        found = workers.price_in_processes(
            len(degrees),
            lambda i, nxt, bar: _price_degree(pricer, degrees, i, nxt, schedule, bar),
            workers.processes_for(len(degrees)),
        )
        tried = {key: why for degree in found for key, why in degree.tried.items()}
        priced = [p for degree in found for p in degree.priced]
        best = fastest(priced)
        if best is not None and best[2].pp > 1:
            variants = _price_stage_meshes(pricer, best, tried, priced)
            best = min([best, *variants], key=operator.itemgetter(0))
    finally:
        ahead.clear()
    if best is None:
        raise ValueError(
            "no layout fits: " + "; ".join(f"{k}: {v}" for k, v in list(tried.items())[:8])
        )
    priced.sort(key=operator.itemgetter(0))  # stable: ties in pricing order, `best` first
    elapsed = time.perf_counter() - t0
    return LayoutSearch(priced, tried, elapsed, pricer.templates, pricer.template)


def _price_stage_meshes(pricer: _Pricer, best, tried: dict, priced: list) -> list[tuple]:
    """The pipelined winner `best` with its first or last stage's rank (or both) on a
    neighbouring stage mesh shape (`stage_meshes.rank_variants`), its schedule and
    microbatches kept: each variant that fits priced (and appended to `priced`)."""
    _, _, won = best
    rows = microbatch_rows(pricer.batch[0].shape[0], won.microbatches)[0]
    out = []
    per_node = pricer.cluster.devices_per_node
    for meshes in rank_variants(won.pp, won.schedule, (won.dp, won.tp), per_node, rows):
        layout = Layout(won.pp, won.dp, won.tp, won.microbatches, won.schedule, meshes)
        try:
            found = pricer.price(layout, won.schedule)
        except (MemoryInfeasible, ValueError, SolverTimeout) as exc:
            tried[layout.key] = f"infeasible: {str(exc).splitlines()[0][:100]}"
            candidate(layout.key, None)
            continue
        found = (found[0], found[1], layout)
        tried[layout.key] = found[0]
        candidate(layout.key, found[0])
        priced.append(found)
        out.append(found)
    return out


@dataclass
class DegreePriced:
    """What pricing one degree's layouts gave (`_price_degree`; sent between processes)."""

    tried: dict[str, float | str]  # layout key -> seconds or why not, in pricing order
    priced: list[tuple[float, float, Layout]]  # every layout priced


def fastest(found: list[tuple | None]) -> tuple | None:
    """The fastest of (step, peak, layout)s in pricing order (None: nothing found there),
    the first in pricing order among equals. Every degree is offered (the step time is not
    unimodal in the degree); each prices its layouts under the best step found so far."""
    best = None
    for f in found:
        if f is not None and (best is None or f[0] < best[0]):
            best = f
    return best


def _price_degree(
    pricer: _Pricer, degrees: list[list[Layout]], i: int, nxt: int | None, schedule, bar
) -> DegreePriced:
    """Degree `i`'s layouts priced (`_price_all`), degree `nxt`'s first one prepared ahead
    of its own pricing (`_Pricer.prepare_next`: the one this process prices next)."""
    ahead_of = degrees[i] + (degrees[nxt] if nxt is not None else [])
    pricer.following = dict(itertools.pairwise(ahead_of))
    tried: dict[str, float | str] = {}
    priced: list[tuple[float, float, Layout]] = []
    _price_all(pricer, degrees[i], schedule, tried, priced, bar)
    return DegreePriced(tried, priced)


def pricing_order(degrees: list[list[Layout]]) -> list[list[Layout]]:
    """The degrees without a pipeline first (their answer is the bar pipelines must beat)."""
    return sorted(degrees, key=lambda ls: ls[0].pp > 1)


def _price_all(
    pricer: _Pricer, layouts, schedule, tried, priced: list, bar: workers.Bar
) -> tuple[float, float, Layout] | None:
    """The fastest of one degree's layouts (most microbatches first: once one does not
    fit, larger microbatches will not either); a layout whose compute bound reaches the
    bar (the best step so far, read as the layout starts) cannot win and is not priced, nor
    are a pipeline's schedules once its ILP's stage work reaches it (`inter_op.Dominated`).
    Each layout priced is appended to `priced` and lowers the bar."""
    best = None
    for layout in layouts:
        beat = bar.value if best is None else min(bar.value, best[0])  # this degree's too
        if layout.accumulates and (layout.dp, layout.tp) not in pricer.pressed:
            tried[layout.key] = "skipped: the whole batch fits without memory levers"
            candidate(layout.key, None)
            continue
        bound = pricer.bound(layout)
        if bound >= beat:
            tried[layout.key] = f"pruned: compute bound {bound:.4g} s >= best {beat:.4g} s"
            candidate(layout.key, None)
            continue
        try:
            with ahead.meanwhile(
                lambda layout=layout, beat=beat: pricer.prepare_next(layout, beat)
            ):
                found = pricer.price(layout, schedule, beat)
        except Dominated as exc:  # its ILP ran, its schedules did not: a larger count may win
            tried[layout.key] = f"pruned: {exc}"
            candidate(layout.key, None)
            continue
        except (MemoryInfeasible, ValueError) as exc:
            tried[layout.key] = f"infeasible: {str(exc).splitlines()[0][:100]}"
            candidate(layout.key, None)
            if layout.pp > 1 or layout.accumulates:
                break
            pricer.pressed.add((layout.dp, layout.tp))  # the whole batch does not fit
            continue
        except SolverTimeout as exc:  # unknown, not infeasible: the next count may solve
            tried[layout.key] = f"no solution: {str(exc)[:60]}"
            candidate(layout.key, None)
            continue
        tried[found[2].key] = found[0]
        candidate(found[2].key, found[0])
        priced.append(found)
        bar.lower(found[0])
        if best is None or found[0] < best[0]:
            best = found
    return best


def compute_bound(template: Template, cluster: Cluster, devices: int) -> float:
    """Seconds of one step's forward + backward compute (no communication) with every
    node's work split over all `devices`, the template's layers weighted: the ILP prices
    a node on a mesh of `devices` at `roofline(flops * (1 + backward) / split, bytes *
    (1 + backward_bytes) / split) + launches` with `split <= devices`
    (`search.costs.CostContext.node_cost`), the
    roofline grows with the work, and recompute only adds; so no plan on those devices
    computes a step in less."""
    total = 0.0
    for n in template.captured.gm.graph.nodes:
        if n.op != "call_function" or n.target in VIEW_OPS or n.target is operator.getitem:
            continue
        val = n.meta.get("val")
        val = val[0] if isinstance(val, (tuple, list)) and val else val
        dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else None
        flops = compute.node_flops(n) * (1.0 + compute.backward_factor(n))
        t = compute.compute_time(
            flops / devices,
            (1.0 + compute.backward_bytes_factor(n)) * compute.node_bytes(n) / devices,
            dtype or "float32",
            cluster,
            op=compute.op_class(n),
            kernels=compute.training_kernels(n),
            rated=compute.rated_seconds(n, cluster.device, 1 / devices, backward=True),
        )
        total += t * template.weights.get(layer_of(n), 1.0)
    return total


def _check_state_fits(model: nn.Module, cluster: Cluster, options: SearchOptions) -> None:
    """No layout fits when the parameters, their gradients and optimizer states, every one
    at the parameter's own itemsize and held once over all devices (the least any plan
    keeps), already exceed a device: ValueError before any template is priced."""
    per_elem = 2 + options.optimizer_states
    state = sum(p.numel() * p.element_size() * per_elem for p in model.parameters())
    limit = options.memory_limit or cluster.device.memory_bytes * 0.9
    if state / cluster.world_size > limit:
        raise ValueError(
            f"no layout fits: parameters, gradients and optimizer states need at least "
            f"{state / cluster.world_size / 2**30:.1f} GiB per device over all "
            f"{cluster.world_size} devices, above the {limit / 2**30:.1f} GiB limit"
        )


def _captured_layers(pricer: _Pricer) -> int:
    return len(layer_order(pricer.template(pricer.batch[0].shape[0]).captured))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
