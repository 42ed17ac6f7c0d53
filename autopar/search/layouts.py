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
number of blocks; microbatch sizes grow until one does not fit; once a degree is feasible, the walk stops at the first degree that is
slower than the best so far (more stages cut per-device memory and work but add bubble
and boundary traffic, so the step time is unimodal in `pp` in practice).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autopar.capture.analysis import layer_order
from autopar.capture.template import Template, capture_template
from autopar.cluster import Cluster
from autopar.search.costs import CostWeights
from autopar.search.ilp import MemoryInfeasible
from autopar.search.inter_op import PipelineOptions, solve_pipeline, stage_cluster
from autopar.search.intra_op import solve_intra
from autopar.search.pins import SearchOptions

MICROBATCH_ROWS = (1, 2)  # rows per data-parallel replica in one microbatch


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
            weights = CostWeights(layer=tpl.weights)
            result = solve_intra(tpl.captured, cluster, mesh, self.options, weights)
            return result.objective, result.memory, layout
        stage = stage_cluster(cluster)
        result, best, _ = solve_pipeline(
            tpl.captured,
            cluster,
            mesh[stage.axis_names],
            self.options,
            PipelineOptions(layout.microbatches, schedule),
            layers=tpl.weights,
            total_layers=tpl.total_layers,
        )
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
    best: tuple[float, float, Layout] | None = None
    for by_degree in candidates.values():
        tp_best = math.inf
        for layouts in by_degree:
            found = _price_all(pricer, layouts, schedule, tried)
            if found is None:
                continue
            if best is None or found[0] < best[0]:
                best = found
            if found[0] > tp_best:
                break
            tp_best = found[0]
    if best is None:
        raise ValueError(
            "no layout fits: " + "; ".join(f"{k}: {v}" for k, v in list(tried.items())[:8])
        )
    step, peak, layout = best
    return LayoutSearch(layout, step, peak, tried, time.perf_counter() - t0)


def _price_all(pricer: _Pricer, layouts, schedule, tried) -> tuple[float, float, Layout] | None:
    """The fastest of one degree's layouts (most microbatches first: once one does not
    fit, larger microbatches will not either)."""
    best = None
    for layout in layouts:
        try:
            found = pricer.price(layout, schedule)
        except (MemoryInfeasible, ValueError) as exc:
            tried[layout.key] = f"infeasible: {str(exc).splitlines()[0][:100]}"
            break
        tried[found[2].key] = found[0]
        if best is None or found[0] < best[0]:
            best = found
    return best


def _captured_layers(pricer: _Pricer) -> int:
    return len(layer_order(pricer.template(pricer.batch[0].shape[0]).captured))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
