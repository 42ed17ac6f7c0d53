"""Alpa's outer loop: how the cluster's devices are laid out for one model.

`search_layout(model, batch, cluster, options, ...) -> LayoutSearch`

A *layout* is a pipeline degree `pp`, the logical mesh every stage runs on, `(dp, tp)` with
`pp * dp * tp` = the cluster's devices (ranks row-major, so `tp` is the fastest axis and
stays inside a node: `tp` is a power of two dividing the devices per node), the number of
microbatches `M` and the schedule. The stage mesh's axes are only names: the intra-op ILP
decides what each axis does (batch, ZeRO, Megatron TP/SP, ...). Stages are uniform (every
stage gets the same submesh shape, as in Megatron and torchtitan); Alpa's heterogeneous
submeshes are not searched.

Each candidate is priced on a *template* (`autopar.capture.template`: the model captured
with two of its blocks, the second weighted by the number of blocks it stands for) at the
microbatch's shape, cached by shape, so a 112-block model prices like a 2-block one:
`pp == 1` by the ILP's objective (one microbatch, the whole batch), `pp > 1` by
`inter_op.solve_pipeline` (the ILP with pipeline weights, then every schedule simulated).
Microbatches hold `mbs` rows per data-parallel replica, `mbs` in 1, 2 (Megatron's micro
batch size), so `M = rows / (dp * mbs)`, and `M >= pp`.

Pruning: for each `tp`, `pp` runs through the divisors of `devices / tp` that divide the
number of blocks; microbatch sizes grow until one does not fit. The step time need not be
unimodal in `pp` (the memory levers switch on and off, the divisors jump, a schedule
starts to fit), so the walk does not stop at the first slower degree: it stops after
`PATIENCE` consecutive feasible degrees slower than the best of its `tp` (a bump of up to
`PATIENCE - 1` degrees is walked through), and infeasible degrees never stop it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autopar.capture.analysis import layer_order
from autopar.capture.template import Template, capture_template
from autopar.cluster import Cluster
from autopar.search.ilp import MemoryInfeasible, SolverTimeout
from autopar.search.inter_op import PipelineOptions
from autopar.search.pins import SearchOptions
from autopar.search.progress import candidate, phase
from autopar.search.template_plan import solve_on_template

MICROBATCH_ROWS = (1, 2)  # rows per data-parallel replica in one microbatch
PATIENCE = 2  # consecutive pipeline degrees slower than the best before a tp's walk stops


@dataclass(frozen=True, slots=True)
class Layout:
    pp: int
    dp: int
    tp: int
    microbatches: int
    schedule: str | None = None  # None: no pipeline

    @property
    def key(self) -> str:
        sched = f" {self.schedule}" if self.schedule else ""
        return f"pp{self.pp} dp{self.dp} tp{self.tp} m{self.microbatches}{sched}"

    def cluster(self, base: Cluster) -> Cluster:
        """`base`'s devices on this layout's mesh: ("pp", "dp", "tp"), size-1 axes dropped
        (one stage axis is always kept)."""
        axes = [("pp", self.pp), ("dp", self.dp), ("tp", self.tp)]
        kept = [(n, s) for n, s in axes if s > 1] or [("dp", 1)]
        if [n for n, _ in kept] == ["pp"]:
            kept.append(("dp", 1))
        return base.reshaped([s for _, s in kept], [n for n, _ in kept])


@dataclass
class LayoutSearch:
    best: Layout
    step_time: float
    peak_memory: float
    tried: dict[str, float | str] = field(default_factory=dict)  # key -> seconds or why not
    search_time_s: float = 0.0
    templates: dict[int, Template] = field(default_factory=dict)  # microbatch rows -> template

    def template_for(self, layout: Layout, rows: int) -> Template | None:
        """The template captured at `layout`'s microbatch shape (None if it cut nothing)."""
        tpl = self.templates.get(rows // layout.microbatches)
        return tpl if tpl is not None and tpl.total_layers is not None else None


@dataclass
class _Pricer:
    model: nn.Module
    batch: Sequence[torch.Tensor]
    cluster: Cluster
    options: SearchOptions
    loss_fn: Callable | None
    templates: dict[int, Template] = field(default_factory=dict)

    def template(self, rows: int) -> Template:
        if rows not in self.templates:
            mb = tuple(t[:rows] if t.ndim else t for t in self.batch)
            with phase("capture"):
                self.templates[rows] = capture_template(self.model, mb, self.loss_fn)
        return self.templates[rows]

    def price(self, layout: Layout, schedule: str | None) -> tuple[float, float, Layout]:
        """(step seconds, peak bytes, the layout with its schedule); ValueError if none fits."""
        rows = self.batch[0].shape[0] // layout.microbatches
        tpl = self.template(rows)
        cluster = layout.cluster(self.cluster)
        # under the fake group (shapes only): a cpu mesh prices any device's plan
        mesh = init_device_mesh("cpu", cluster.mesh_shape, mesh_dim_names=cluster.axis_names)
        if layout.pp == 1:
            result = solve_on_template(tpl, cluster, mesh, self.options, None)
            return result.objective, result.memory, layout
        pipeline = PipelineOptions(layout.microbatches, schedule)
        result, best, _ = solve_on_template(tpl, cluster, mesh, self.options, pipeline)
        chosen = Layout(layout.pp, layout.dp, layout.tp, layout.microbatches, best.schedule)
        return best.step_time, best.peak_memory, chosen


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
            if p == 1:
                counts = [1] if rows % dp == 0 else []
            elif microbatches is not None:
                counts = [microbatches] if rows % microbatches == 0 else []
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
    pricer = _Pricer(model, batch, cluster, options, loss_fn)
    layers = pricer.template(batch[0].shape[0]).total_layers or _captured_layers(pricer)
    candidates = candidate_layouts(
        cluster, batch[0].shape[0], layers, pipeline_stages, microbatches
    )
    if not candidates:
        raise ValueError(
            f"no layout of {cluster.world_size} devices splits a batch of "
            f"{batch[0].shape[0]} rows evenly; use a batch divisible by the data-parallel "
            "degree (e.g. a multiple of the device count)"
        )
    tried: dict[str, float | str] = {}
    best = None
    for by_degree in candidates.values():
        found = walk_degrees(by_degree, lambda ls: _price_all(pricer, ls, schedule, tried))
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    if best is None:
        raise ValueError(
            "no layout fits: " + "; ".join(f"{k}: {v}" for k, v in list(tried.items())[:8])
        )
    step, peak, layout = best
    return LayoutSearch(layout, step, peak, tried, time.perf_counter() - t0, pricer.templates)


def walk_degrees(by_degree: list[list[Layout]], price: Callable) -> tuple | None:
    """The fastest of one tp's pipeline degrees (ascending): `price(layouts)` gives the
    fastest (step, peak, layout) of a degree or None; the walk stops after `PATIENCE`
    consecutive priced degrees slower than the best so far."""
    best, worse = None, 0
    for layouts in by_degree:
        found = price(layouts)
        if found is None:
            continue
        if best is not None and found[0] >= best[0]:
            worse += 1
            if worse >= PATIENCE:
                break
            continue
        best, worse = found, 0
    return best


def _price_all(pricer: _Pricer, layouts, schedule, tried) -> tuple[float, float, Layout] | None:
    """The fastest of one degree's layouts (most microbatches first: once one does not
    fit, larger microbatches will not either)."""
    best = None
    for layout in layouts:
        try:
            found = pricer.price(layout, schedule)
        except (MemoryInfeasible, ValueError) as exc:
            tried[layout.key] = f"infeasible: {str(exc).splitlines()[0][:100]}"
            candidate(layout.key, None)
            break
        except SolverTimeout as exc:  # unknown, not infeasible: the next count may solve
            tried[layout.key] = f"no solution: {str(exc)[:60]}"
            candidate(layout.key, None)
            continue
        tried[found[2].key] = found[0]
        candidate(found[2].key, found[0])
        if best is None or found[0] < best[0]:
            best = found
    return best


def _captured_layers(pricer: _Pricer) -> int:
    return len(layer_order(pricer.template(pricer.batch[0].shape[0]).captured))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
