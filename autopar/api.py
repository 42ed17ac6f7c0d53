"""The public entry points: `autopar.compile` and `autopar.plan`.

compile: capture -> (search on rank 0, broadcast | load a saved plan) -> every rank checks the
plan's hash against rank 0's -> lower -> ParallelModel.
plan: the same search with no processes: a fake process group of the cluster's size and a
model that may live on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autopar._compat import FakeStore
from autopar.capture import Captured, capture
from autopar.cluster import Cluster
from autopar.plan import Plan
from autopar.runtime.parallel_model import OptimizerFactory, ParallelModel
from autopar.runtime.pipeline_model import PipelineModel
from autopar.search.job import _Job
from autopar.search.layouts import search_layout
from autopar.search.pins import SearchOptions


def compile(  # noqa: A001 - the public name mirrors torch.compile
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    cluster: Cluster,
    optimizer: OptimizerFactory | None = None,
    loss_fn: Callable | None = None,
    plan: Plan | str | Path | None = None,
    strategy: str | tuple[str, ...] = "auto",
    placements: dict[str, str] | None = None,
    memory_limit: float | None = None,
    time_limit_s: float = 30.0,
    pipeline_stages: int | str | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    stage_cuts: Sequence[int] | None = None,
    fusion: str = "none",
) -> ParallelModel | PipelineModel:
    """Plan (or apply `plan`) and build this rank's share of the model for training.

    Every rank calls it with the same model (same initial weights) and the same GLOBAL batch.
    Pipelining: name the first mesh axis "pp" or pass `pipeline_stages`; `microbatches`,
    `schedule` (gpipe, 1f1b, interleaved1f1b, interleavedzb, zbv, dualpipev) and
    `stage_cuts` (first layer of each stage) pin what the search would choose.
    `fusion="triton"` swaps matched regions (residual add + LayerNorm/RMSNorm, SwiGLU,
    bias + GELU, head matmul + cross-entropy) for autopar's Triton kernels; without a GPU they run only under
    TRITON_INTERPRET=1.
    `fusion="inductor"` hands each rank's step program (each stage's, when pipelined) to
    torch.compile instead (C++ on CPU, Triton on GPU; compiled on the first step).
    """
    if pipeline_stages == "auto":
        raise ValueError(
            "pipeline_stages='auto' searches the pipeline degree while planning: "
            "run autopar.plan(..., pipeline_stages='auto') (or `autopar plan`) "
            "and pass the result as plan= to compile"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "autopar.compile needs a process group: launch with torchrun (or "
            "`autopar run`) and call torch.distributed.init_process_group first; "
            "use autopar.plan to plan without processes."
        )
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    job, captured, fused = _prepare(
        model,
        example_inputs,
        cluster,
        loss_fn,
        plan,
        strategy=strategy,
        placements=placements,
        memory_limit=memory_limit,
        time_limit_s=time_limit_s,
        pipeline_stages=pipeline_stages,
        microbatches=microbatches,
        schedule=schedule,
        stage_cuts=stage_cuts,
        fusion=fusion,
    )
    mesh = job.cluster.device_mesh()
    if plan is not None:
        check_plan_matches(plan, captured, job.cluster)
    else:
        plan = _plan_on_rank0(captured, job, mesh, fused)
    verify_same_plan(plan)
    if plan.pipeline is not None:
        return PipelineModel(model, captured, plan, mesh, optimizer)
    return ParallelModel(model, captured, plan, mesh, optimizer)


def plan(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    cluster: Cluster,
    loss_fn: Callable | None = None,
    strategy: str | tuple[str, ...] = "auto",
    placements: dict[str, str] | None = None,
    memory_limit: float | None = None,
    time_limit_s: float = 30.0,
    pipeline_stages: int | str | None = None,
    microbatches: int | None = None,
    schedule: str | None = None,
    stage_cuts: Sequence[int] | None = None,
    fusion: str = "none",
    shard_optimizer: bool = False,
) -> Plan:
    """Search a plan without processes or weights (the model may be on the meta device).

    `shard_optimizer=True` prices ZeRO-1 (fp32 master and optimizer state split over the
    devices holding the same shard, as Megatron's distributed optimizer): for planning and
    benchmarks only, `compile` does not run such plans yet.

    `pipeline_stages="auto"` also searches how the devices are laid out: the pipeline
    degree, every stage's (dp, tp) mesh, the microbatch count and the schedule
    (`autopar.search.layouts`); `microbatches=` and `schedule=` pin those."""
    if pipeline_stages == "auto":
        return _plan_layout(
            model,
            example_inputs,
            cluster=cluster,
            loss_fn=loss_fn,
            strategy=strategy,
            placements=placements,
            memory_limit=memory_limit,
            time_limit_s=time_limit_s,
            microbatches=microbatches,
            schedule=schedule,
            fusion=fusion,
            shard_optimizer=shard_optimizer,
        )
    job, captured, fused = _prepare(
        model,
        example_inputs,
        cluster,
        loss_fn,
        None,
        strategy=strategy,
        placements=placements,
        memory_limit=memory_limit,
        time_limit_s=time_limit_s,
        pipeline_stages=pipeline_stages,
        microbatches=microbatches,
        schedule=schedule,
        stage_cuts=stage_cuts,
        fusion=fusion,
    )
    if shard_optimizer:
        job = replace(job, options=replace(job.options, shard_optimizer=True))
    cluster = job.cluster
    with _fake_group(cluster.world_size):
        return job.search(captured, cluster.device_mesh(device_type="cpu"), fused)


@contextmanager
def _fake_group(world: int) -> Iterator[None]:
    """Planning needs a process group of the cluster's size: a fake one, unless one runs."""
    owns_group = not dist.is_initialized()
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


def _prepare(
    model,
    example_inputs,
    cluster: Cluster,
    loss_fn,
    plan: Plan | None,
    *,
    strategy,
    placements,
    memory_limit,
    time_limit_s,
    pipeline_stages,
    microbatches,
    schedule,
    stage_cuts,
    fusion,
) -> tuple[_Job, Captured, tuple]:
    """What compile and plan share: the job, the captured (maybe fused) graph."""
    job = _Job.make(
        example_inputs,
        cluster,
        strategy,
        placements,
        memory_limit,
        time_limit_s,
        pipeline_stages,
        microbatches,
        schedule,
        stage_cuts,
        plan,
        fusion,
    )
    captured = capture(model, job.capture_batch(example_inputs), loss_fn)
    return job, captured, job.fuse(captured)


def _plan_layout(
    model, example_inputs, *, cluster: Cluster, microbatches, schedule, **options
) -> Plan:
    """Search the layout on layer templates, then plan the whole model on the winner."""
    strategy = options["strategy"]
    if not isinstance(strategy, str):
        raise ValueError(
            f"strategy={strategy!r} names a role per mesh axis, but pipeline_stages='auto' "
            "chooses the mesh; give one role (e.g. 'auto'), or a cluster with the mesh you want"
        )
    search_options = SearchOptions(
        strategy=strategy,
        placements=dict(options["placements"] or {}),
        memory_limit=options["memory_limit"],
        time_limit_s=options["time_limit_s"],
        shard_optimizer=options["shard_optimizer"],
    )
    with _fake_group(cluster.world_size):
        found = search_layout(
            model,
            example_inputs,
            cluster,
            search_options,
            options["loss_fn"],
            microbatches=microbatches,
            schedule=schedule,
        )
    best = found.best
    final = plan(
        model,
        example_inputs,
        cluster=best.cluster(cluster),
        pipeline_stages=best.pp if best.pp > 1 else None,
        microbatches=best.microbatches if best.pp > 1 else None,
        schedule=best.schedule,
        **options,
    )
    return final.with_solver(
        layout=best.key, layout_candidates=found.tried, layout_search_s=found.search_time_s
    )


def check_plan_matches(plan: Plan, captured: Captured, cluster: Cluster) -> None:
    """A saved plan applies only to the graph and the mesh it was made for."""
    if plan.solver.get("shard_optimizer"):
        raise ValueError(
            "this plan was made with shard_optimizer=True (ZeRO-1 priced for planning), "
            "which the runtime does not run yet; re-plan without shard_optimizer to train"
        )
    if plan.graph_fingerprint != captured.fingerprint:
        raise ValueError(
            f"this plan was made for another model or batch shape (graph fingerprint "
            f"{plan.graph_fingerprint}, this model's is {captured.fingerprint}); re-plan with "
            "autopar.plan / `autopar plan` for this model and batch."
        )
    if plan.mesh_shape != tuple(cluster.mesh_shape):
        raise ValueError(
            f"this plan is for a mesh {plan.mesh_shape} but the cluster's mesh is "
            f"{tuple(cluster.mesh_shape)}; re-plan for this cluster or launch "
            f"{_prod(plan.mesh_shape)} processes with that mesh."
        )


def _plan_on_rank0(captured: Captured, job: _Job, mesh, fused: tuple[dict, ...]) -> Plan:
    """Rank 0 searches; the others receive its plan (solvers with time limits are not
    guaranteed to answer identically on every rank)."""
    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = job.search(captured, mesh, fused).to_json()
        except Exception as exc:  # the other ranks must not wait forever for a plan
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return Plan.from_json(box[0])


def verify_same_plan(plan: Plan) -> None:
    """Every rank compares its plan's hash with rank 0's before the first collective."""
    hashes: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, plan.content_hash)
    if any(h != hashes[0] for h in hashes):
        bad = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise ValueError(
            f"ranks {bad} hold a different plan than rank 0 (hashes {hashes}); "
            "give every rank the same plan file."
        )


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for s in shape:
        out *= s
    return out
