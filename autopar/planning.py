"""Orchestration behind `autopar.plan` and `autopar.compile` (the api layer).

    PlanOptions (validated)  ->  PlanJob.make: the cluster as the search sees it ("pp" axis
    first when pipelining), the microbatches, the fusion mode; no capture yet
      ->  capture (one microbatch when pipelining)  ->  fuse  ->  search

`plan_model` runs the search under a fake process group of the cluster's size (the model
may live on the meta device) on meshes without process groups (`_compat.shape_only_mesh`).
When the layout is searched (`searches_layout`: by default on a cluster given by its
hardware mesh with nothing pinned, or `pipeline_stages="auto"`), `plan_layout` first
searches it on layer templates (`autopar.search.layouts`) and then plans the whole model
on the winner. A model repeating a block `TEMPLATE_MIN_BLOCKS` times or more is solved on its
two-block template and the decisions replicated onto the full capture
(`autopar.search.template_plan`; the layout search's template and solve are reused).
The phases are timed by `autopar.search.progress` (`autopar plan --profile`).
compile's half (rank 0 searches and broadcasts, every rank checks) is `autopar.rank_plans`.
"""

from __future__ import annotations

import copy
import gc
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar._compat import FakeStore, shape_only_mesh
from autopar.capture import Captured, capture
from autopar.capture.template import BUILT, Template, template_of
from autopar.cluster import PRESETS, Cluster, with_pipeline_axis
from autopar.options import MIXED_PRECISION, PlanOptions
from autopar.passes.fusion import fuse_regions
from autopar.passes.strategies.from_dtensor import source_line
from autopar.passes.strategies.rules.random_ops import random_draws
from autopar.plan import SCHEDULES, FusedRegion, Plan
from autopar.runtime.pipeline_model import SmallerMicrobatches
from autopar.search.inter_op import PipelineOptions
from autopar.search.intra_op import search_plan
from autopar.search.layouts import search_layout
from autopar.search.peak import with_predicted_memory
from autopar.search.pins import SearchOptions
from autopar.search.pipeline_plan import search_pipeline
from autopar.search.progress import phase
from autopar.search.schedules import default_microbatches, microbatch_rows
from autopar.search.template_plan import plan_from_template, solve_on_template, template_applies


@dataclass(frozen=True)
class PlanJob:
    """One plan or compile call, before capture: everything the options and the cluster
    decide (a saved plan decides the fusion mode and the pipeline)."""

    cluster: Cluster  # with its "pp" axis first when pipelining
    options: PlanOptions
    pipeline: PipelineOptions | None
    fusion: str

    @classmethod
    def make(
        cls,
        options: PlanOptions,
        cluster: Cluster,
        batch: Sequence[torch.Tensor],
        plan: Plan | None = None,
    ) -> PlanJob:
        stages, microbatches, fusion = options.pipeline_stages, options.microbatches, options.fusion
        if plan is not None:
            fusion, stages, microbatches = plan.fusion, None, None
            if plan.pipeline is not None:
                stages, microbatches = plan.pipeline.pp, plan.pipeline.microbatches
        cluster = with_pipeline_axis(cluster, stages)
        pipelined = "pp" in cluster.axis_names
        if plan is None:  # the roles must fit the mesh each stage runs on
            SearchOptions.from_options(options).roles(len(cluster.axis_names) - pipelined)
        if not pipelined:
            return cls(cluster, options, None, fusion)
        pp = cluster.mesh_shape[0]
        rows = batch[0].shape[0]
        m = microbatches or default_microbatches(rows, pp)
        microbatch_rows(rows, m)  # a count from 1 to the rows (uneven ones: the last smaller)
        cuts, schedule = options.stage_cuts, options.schedule
        if plan is None and cuts is not None and schedule is not None:
            want = pp * SCHEDULES[schedule]
            if len(cuts) != want:
                raise ValueError(
                    f"stage_cuts has {len(cuts)} entries but schedule={schedule!r} on {pp} "
                    f"pipeline ranks runs {want} stages; give {want} cuts"
                )
        uneven = rows if rows % m else None
        meshes = _stage_meshes(options, cluster) if plan is None else ()
        if meshes and meshes[0] != cluster.mesh_shape[1:]:  # the plan's mesh: rank 0's shape
            cluster = cluster.reshaped((pp, *meshes[0]), cluster.axis_names)
        if len(set(meshes)) == 1:  # every rank on one shape: a uniform pipeline on it
            meshes = ()
        pipeline = PipelineOptions(m, schedule, cuts, uneven, rank_meshes=meshes)
        return cls(cluster, options, pipeline, fusion)

    def capture_batch(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Pipelined graphs are captured on one microbatch (the shapes each stage runs)."""
        if self.pipeline is None:
            return tuple(batch)
        largest = microbatch_rows(batch[0].shape[0], self.pipeline.microbatches)[0]
        return tuple(t[:largest] for t in batch)

    def fuse(self, captured: Captured) -> tuple[FusedRegion, ...]:
        """Swap matched regions of the captured graph for fused kernels (passes/fusion)."""
        return tuple(fuse_regions(captured, kernels=self.fusion))

    def solve_template_first(self, template: Template) -> None:
        """Solve on `template` before the full graph is captured (the solve is kept in
        `Template.solved` for `search`), so that a model no plan fits fails in seconds:
        the full capture of an 80-block model takes ~40 s."""
        options = SearchOptions.from_options(self.options)
        if not template_applies(options):
            return
        with fake_group(self.cluster.world_size):
            mesh = shape_only_mesh("cpu", self.cluster.mesh_shape, self.cluster.axis_names)
            solve_on_template(template, self.cluster, mesh, options, self.pipeline)

    def search(
        self,
        captured: Captured,
        mesh: DeviceMesh,
        regions: tuple[FusedRegion, ...] = (),
        template: Template | None = None,
    ) -> Plan:
        """The plan of `captured`: solved on `template` (two blocks standing for all of
        them, `autopar.search.template_plan`) when given and it corresponds, else on the
        full graph."""
        options = SearchOptions.from_options(self.options)
        plan = None
        if template is not None and not regions:
            plan = plan_from_template(
                captured, template, self.cluster, mesh, options, self.pipeline
            )
        if plan is None and self.pipeline is None:
            plan = search_plan(captured, self.cluster, mesh, options)
        elif plan is None:
            stage_names = tuple(n for n in self.cluster.axis_names if n != "pp")
            plan = search_pipeline(
                captured, self.cluster, mesh[stage_names], options, self.pipeline
            )
        # the mode the graph was fused with: "triton" only if a region was swapped, so a
        # runtime without kernels still reproduces the planned graph
        applied = "triton" if regions else ("inductor" if self.fusion == "inductor" else "none")
        memory = replace(plan.memory, **precision_fields(self.options))
        plan = replace(plan, fusion=applied, fused_regions=regions, memory=memory)
        if captured.from_template:
            plan = plan.with_solver(graph=BUILT)
        # what the runtime really holds at its peak (a liveness simulation of the step)
        with phase("assembly"):
            plan = with_predicted_memory(captured, plan, options.optimizer_states)
        warn_if_over_memory(plan, self.cluster, self.options.memory_limit)
        return plan


def warn_if_over_memory(plan: Plan, cluster: Cluster, memory_limit: float | None = None) -> None:
    """The search fits its own price of the memory under the limit; the liveness simulation
    of the step it chose (`Plan.predicted_peak_memory`) may still exceed the device (or the
    `memory_limit` the call gave), where the two models disagree: say so, with the fix,
    rather than let the run fail there."""
    peak, bound = plan.predicted_peak_memory, memory_bound(cluster, memory_limit)
    if peak > bound:
        what = "device's" if bound == cluster.device.memory_bytes else "memory_limit of"
        warnings.warn(
            f"the plan's predicted peak is {peak / 2**30:.3g} GiB per device (a liveness "
            f"simulation of the step), above the {what} {bound / 2**30:.3g} GiB, though "
            f"the search priced {plan.solver.get('ilp_memory', peak) / 2**30:.3g} GiB: the "
            "run may run out of memory. Fix: plan with a lower memory_limit= (e.g. "
            f"{0.8 * bound * bound / peak / 2**30:.3g} GiB), activation_checkpointing="
            "'full', or more devices.",
            stacklevel=3,
        )


def prepare(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    cluster: Cluster,
    loss_fn: Callable | None,
    options: PlanOptions,
    plan: Plan | None = None,
    template: bool = False,
    solve_first: bool = False,
    given: Template | None = None,
    cast: nn.Module | None = None,
) -> tuple[PlanJob, Captured, tuple[FusedRegion, ...], Template | None]:
    """What compile and plan share: the job, the captured (maybe fused) graph, and with
    `template` the two-block template to search on (None when nothing repeats).
    `solve_first` (planning without processes): the template (or the `given` one, captured
    at the same shapes) is solved before the whole graph is made, and the whole graph is
    built from it rather than traced where it can be (`Template.whole_model`). `cast`:
    `model` in the compute dtype already (the layout search's copy, which the `given`
    template's three-block check traces: a copy made anew would start it again)."""
    job = PlanJob.make(options, cluster, batch, plan)
    dtype = compute_dtype(options, plan)
    batch = job.capture_batch(batch)
    if dtype is not None:  # captured in the compute dtype: activations and communication
        model, batch = in_compute_dtype(model, batch, dtype, cast)  # priced in it
    with phase("capture"):
        tpl = template_of(model, batch, loss_fn) if template else None
    if solve_first and tpl is not None and job.fusion == "none":
        job.solve_template_first(tpl)
    source = (tpl or given) if solve_first else None
    with phase("capture"):
        captured = source and source.whole_model(model, batch, loss_fn, confirm_later=True)
        captured = captured or capture(model, batch, loss_fn)
        regions = job.fuse(captured)
    if job.pipeline is not None:
        check_pipelines_take(captured)
    return job, captured, regions, tpl


def check_pipelines_take(captured: Captured) -> None:
    """A model that updates buffers in forward is not pipelined: a pipeline runs the
    forward once per microbatch, so training-mode BatchNorm would normalize each microbatch
    by its own statistics and update the running statistics once per microbatch, which is
    not what one forward over the batch computes. Nor is one that draws random numbers
    (dropout): each stage draws on its own ranks, from the generator every rank holds in
    the state the single-device run starts from, once per microbatch, so the stages would
    repeat each other's masks instead of drawing the batch's. (The layout search leaves
    pipelines out for such models; this names the fix when a pipeline is asked for.)"""
    draws = random_draws(captured.gm)
    if draws:
        first = draws[0]
        raise ValueError(
            f"the model draws random numbers in forward ({len(draws)} ops, the first "
            f"{first.target}{source_line(first)}): dropout masks or random fills. A "
            "pipeline runs the forward once per microbatch, each stage on its own ranks, so "
            "its draws would not be those of one forward over the batch (the stages would "
            "repeat each other's masks). Fix: plan without pipeline stages "
            "(pipeline_stages=1; the default search does), or set the dropout "
            "probabilities to 0."
        )
    if captured.mutated_buffers:
        names = [captured.buffers[n] for n in captured.mutated_buffers]
        raise ValueError(
            f"the model updates buffers in forward ({', '.join(names)}: e.g. BatchNorm "
            "running statistics). A pipeline runs the forward once per microbatch, so it "
            "would compute per-microbatch statistics, not the batch's. Fix: plan without "
            "pipeline stages (pipeline_stages=1; the default search does), or use "
            "LayerNorm / GroupNorm / eval-mode BatchNorm."
        )


def smaller_microbatch(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: Callable | None,
    options: PlanOptions,
    plan: Plan,
) -> SmallerMicrobatches | None:
    """A pipeline whose batch its microbatch count does not divide runs its last
    microbatches one row smaller (`microbatch_rows`): their graph, captured and fused as
    the planned one (same node names, so the plan's placements apply). None when even."""
    assert plan.pipeline is not None
    sizes = microbatch_rows(batch[0].shape[0], plan.pipeline.microbatches)
    if sizes[0] == sizes[-1]:
        return None
    small = tuple(t[: sizes[-1]] for t in batch)
    dtype = compute_dtype(options, plan)
    if dtype is not None:
        model, small = in_compute_dtype(model, small, dtype)
    captured = capture(model, small, loss_fn)
    fuse_regions(captured, kernels=plan.fusion)
    return SmallerMicrobatches(captured, sizes.count(sizes[-1]))


def compute_dtype(options: PlanOptions, plan: Plan | None) -> torch.dtype | None:
    """The mixed-precision compute dtype: a saved plan's, else the options'."""
    name = plan.memory.param_dtype if plan is not None else None
    if plan is None and options.mixed_precision is not None:
        name = MIXED_PRECISION[options.mixed_precision]
    return getattr(torch, name) if name else None


def precision_fields(options: PlanOptions) -> dict:
    """`MemoryPlan` fields of the mixed-precision policy and ZeRO options."""
    param = MIXED_PRECISION.get(options.mixed_precision) if options.mixed_precision else None
    return {
        "param_dtype": param,
        "reduce_dtype": options.reduce_dtype if param else None,
        "loss_scaling": param == "float16",
        "shard_optimizer": options.shard_optimizer,
        "shard_gradients": options.shard_gradients,
    }


def in_compute_dtype(
    model: nn.Module, batch: Sequence[torch.Tensor], dtype: torch.dtype, cast=None
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A copy of `model` with its parameters (not buffers) cast to `dtype` (`cast`, where
    given: such a copy made before), and the batch with its floating tensors cast: what
    the runtime computes with under the policy."""
    bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if bad:
        raise ValueError(
            f"mixed_precision keeps fp32 master weights, but this model has {', '.join(bad)} "
            "parameters; hand over the fp32 model, or drop mixed_precision to train in the "
            "model's own dtype"
        )
    if cast is None:
        cast = copy.deepcopy(model)
        for p in cast.parameters():
            p.data = p.data.to(dtype)
    return cast, tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def _stage_meshes(options: PlanOptions, cluster: Cluster) -> tuple[tuple[int, ...], ...]:
    """`options.stage_meshes` checked against the pipelined cluster (one per pipeline
    rank, each as many devices on as many axes as the cluster's stage mesh); () when
    not given."""
    meshes = options.stage_meshes
    if meshes is None:
        return ()
    pp, stage = cluster.mesh_shape[0], cluster.mesh_shape[1:]
    names = cluster.axis_names[1:]
    wrong = [m for m in meshes if len(m) != len(stage) or math.prod(m) != math.prod(stage)]
    if len(meshes) != pp or wrong:
        raise ValueError(
            f"stage_meshes={meshes}: give {pp} shapes (one per pipeline rank), each "
            f"{math.prod(stage)} devices on the stage axes {names}, e.g. {(stage,) * pp}"
        )
    return meshes


def searches_layout(options: PlanOptions, cluster: Cluster) -> bool:
    """Whether the call searches the layout (pipeline degree, stage cuts, stage mesh,
    microbatches, schedule): with `pipeline_stages="auto"`, and by default when nothing
    pins the mesh: no `pipeline_stages`, no `stage_cuts`, no `placements`,
    `strategy="auto"`, and a cluster whose mesh only describes the hardware
    (`hardware_mesh`). A pinned mesh or strategy is planned as it is (pipelined only by a
    "pp" axis or `pipeline_stages`)."""
    if options.pipeline_stages == "auto":
        return True
    return (
        options.pipeline_stages is None
        and options.stage_cuts is None
        and options.stage_meshes is None
        and not options.placements
        and options.strategy == "auto"
        and cluster.world_size > 1
        and hardware_mesh(cluster)
    )


def hardware_mesh(cluster: Cluster) -> bool:
    """The mesh `Cluster.preset` makes when none is given: (nodes, devices per node) named
    ("node", label), or (devices per node,) named (label,), the label being the preset's
    device axis ("gpu", "cpu"); on a cluster that can be re-meshed (it knows its fabric).
    Any other mesh (other sizes, other names: "dp", "tp", "axis0") is the user's layout."""
    shape, names = cluster.mesh_shape, cluster.axis_names
    if cluster.fabric is None or names[-1] not in DEVICE_LABELS:
        return False
    if len(shape) == 1:
        return shape[0] == cluster.devices_per_node
    return len(shape) == 2 and names[0] == "node" and shape[1] == cluster.devices_per_node


DEVICE_LABELS = frozenset(p.device_label for p in PRESETS.values())


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused while a plan is searched. The search keeps
    ~1M objects alive (templates, strategies, price tables) that every full collection
    walks again: GPT-3 175B's search spent ~9 s of 55 in 24 collections, Llama-3-8B's
    ~4 s of 25; without them its peak memory grew 820 -> 849 MB (it makes little cyclic
    garbage). The collector's state is restored after; its next run reclaims the rest."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@collector_paused()
def plan_model(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    cluster: Cluster,
    loss_fn: Callable | None,
    options: PlanOptions,
    template: Template | None = None,
    cast: nn.Module | None = None,
) -> Plan:
    """`autopar.plan`: search without processes or weights (on `template` when given: the
    layout search's, captured at the same shapes on `cast`, its copy of `model` in the
    compute dtype)."""
    if searches_layout(options, cluster):
        return plan_layout(model, batch, cluster, loss_fn, options)
    job, captured, regions, tpl = prepare(
        model,
        batch,
        cluster,
        loss_fn,
        options,
        template=template is None,
        solve_first=True,
        given=template,
        cast=cast,
    )
    tpl = template or tpl
    with fake_group(job.cluster.world_size), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # only shapes are read: a mesh without process groups serves any device's plan
        mesh = shape_only_mesh("cpu", job.cluster.mesh_shape, job.cluster.axis_names)
        plan = job.search(captured, mesh, regions, tpl)
    if captured.from_template:
        with phase("capture"):  # the three-block check, run beside the plan (`whole_model`)
            if not tpl.confirmed():  # the built graph is not the model's: planned on its trace
                return plan_model(model, batch, cluster, loss_fn, options, tpl, cast)
    for w in caught:  # the plan's own, once it is the one given out
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return plan


@collector_paused()
def plan_layout(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    cluster: Cluster,
    loss_fn: Callable | None,
    options: PlanOptions,
) -> Plan:
    """Search the layout on layer templates, then plan the whole model on the winner.
    By default (no explicit "auto"), a search that finds no layout falls back to the
    cluster's own mesh without a pipeline (whose error, if any, names the fix)."""
    dtype = compute_dtype(options, None)  # templates captured as the runtime computes
    searched, example = (model, batch) if dtype is None else in_compute_dtype(model, batch, dtype)
    with fake_group(cluster.world_size):
        try:
            found = search_layout(
                searched,
                example,
                cluster,
                SearchOptions.from_options(options),
                loss_fn,
                microbatches=options.microbatches,
                schedule=options.schedule,
            )
        except ValueError:  # MemoryInfeasible too
            if options.pipeline_stages == "auto":
                raise
            found = None
    if found is None:
        return plan_model(model, batch, cluster, loss_fn, replace(options, pipeline_stages=1))

    def on(layout):  # the whole model planned on one of the search's layouts
        return plan_model(
            model,
            batch,
            layout.cluster(cluster),
            loss_fn,
            replace(
                options,
                pipeline_stages=layout.pp,  # 1: no pipeline, or accumulation ("pp" of 1)
                microbatches=layout.microbatches if layout.pp > 1 or layout.accumulates else None,
                schedule=layout.schedule,
                stage_meshes=layout.rank_meshes or None,
            ),
            template=found.template_for(layout, batch[0].shape[0]),
            cast=searched if dtype is not None else None,
        )

    final, layout = found.fastest_fitting(on, memory_bound(cluster, options.memory_limit))
    return final.with_solver(
        layout=layout.key, layout_candidates=found.tried, layout_search_s=found.search_time_s
    )


def memory_bound(cluster: Cluster, memory_limit: float | None) -> float:
    """The memory a plan must fit: the device's, or the call's memory_limit if lower."""
    device = cluster.device.memory_bytes
    return min(device, memory_limit) if memory_limit is not None else device


@contextmanager
def fake_group(world: int) -> Iterator[None]:
    """Planning needs a process group of the cluster's size: a fake one, unless one runs.
    A fake group made here is destroyed on the way out, and `sys.excepthook` restored:
    `init_process_group` wraps it to prefix "[rank0]: " to every traceback line, and a
    process planning N times would print each line of its next error with N prefixes."""
    owns_group = not dist.is_initialized()
    hook = sys.excepthook
    if owns_group:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    elif dist.get_world_size() != world:
        raise ValueError(
            f"the cluster has {world} devices but the running process "
            f"group has {dist.get_world_size()}; plan outside the job, or use a "
            "cluster of the job's size"
        )
    try:
        yield
    finally:
        if owns_group:
            dist.destroy_process_group()
            sys.excepthook = hook
