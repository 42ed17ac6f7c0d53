"""A pipeline's plan: `search_pipeline(captured, cluster, stage_mesh, options, pipeline)`
solves the stages and the schedule (`search.inter_op.solve_pipeline`) and assembles the
plan; `pipeline_plan` is its pipeline part (schedule, cuts, stage mesh, timeline).
"""

from __future__ import annotations

from dataclasses import replace

from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.capture.analysis import layer_order
from autopar.cluster import Cluster
from autopar.plan import MemoryPlan, PipelinePlan, Plan, mixed_shapes, stage_ranks
from autopar.search.inter_op import PipelineOptions, PricedSchedule, solve_pipeline, stage_cluster
from autopar.search.pins import SearchOptions
from autopar.search.stage_meshes import merged_plan, on_shape, solve_rank_meshes
from autopar.search.to_plan import assemble_plan


def search_pipeline(
    captured: Captured,
    cluster: Cluster,
    stage_mesh: DeviceMesh,
    options: SearchOptions,
    pipeline: PipelineOptions,
) -> Plan:
    if mixed_shapes(pipeline.rank_meshes):  # pipeline ranks on stage meshes of two shapes
        results, best, schedules = solve_rank_meshes(captured, cluster, options, pipeline)
    else:
        result, best, schedules = solve_pipeline(captured, cluster, stage_mesh, options, pipeline)
        results = {stage_cluster(cluster).mesh_shape: result}

    def assembled(shape: tuple[int, ...], result) -> Plan:
        on = on_shape(cluster, shape)
        plan = assemble_plan(
            captured,
            on,
            result.chosen,
            options.strategy_name(),
            best.step_time,
            best.peak_memory,
            {**result.info, "schedules": schedules, **best.info()},
            priced=result.priced,
            memory=MemoryPlan(*result.memory_plan),  # (recompute, reshard_after_forward)
            comm=result.comm,
        )
        return replace(plan, pipeline=pipeline_plan(captured, on, pipeline, best))

    plans = {shape: assembled(shape, r) for shape, r in results.items()}
    if len(plans) == 1:
        return next(iter(plans.values()))
    return merged_plan(captured, plans, plans[pipeline.rank_meshes[0]].pipeline)


def pipeline_plan(
    captured: Captured, cluster: Cluster, pipeline: PipelineOptions, best: PricedSchedule
) -> PipelinePlan:
    """The pipeline part of the plan: `best`'s schedule and cuts over `captured`'s layers."""
    pp = cluster.axis_size("pp")
    sub = stage_cluster(cluster)
    return PipelinePlan(
        pp=pp,
        stage_cuts=best.cuts,
        layers=tuple(layer_order(captured)),
        schedule=best.schedule,
        microbatches=pipeline.microbatches,
        stage_mesh=sub.mesh_shape,
        stage_axis_names=sub.axis_names,
        rank_of_stage=tuple(stage_ranks(best.schedule, pp)),
        timeline=best.timeline.rows,
        boundary=best.boundary,
        rank_meshes=pipeline.rank_meshes if mixed_shapes(pipeline.rank_meshes) else (),
    )
