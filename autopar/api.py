"""The public entry points: `autopar.compile` and `autopar.plan`.

Both first build one `autopar.options.PlanOptions` from their keywords, so a bad option
fails before the model is captured; `autopar.planning` does the rest.
compile: capture -> (search on rank 0, broadcast | load a saved plan) -> every rank checks the
plan's hash against rank 0's -> lower -> ParallelModel (PipelineModel when pipelined).
plan: the same search with no processes: a fake process group of the cluster's size and a
model that may live on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autopar.cluster import Cluster
from autopar.options import PlanOptions
from autopar.plan import Plan
from autopar.planning import plan_for_ranks, plan_model
from autopar.runtime.parallel_model import OptimizerFactory, ParallelModel
from autopar.runtime.pipeline_model import PipelineModel


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
    bias + GELU, head matmul + cross-entropy) for autopar's Triton kernels; without a GPU
    they run only under TRITON_INTERPRET=1.
    `fusion="inductor"` hands each rank's step program (each stage's, when pipelined) to
    torch.compile instead (C++ on CPU, Triton on GPU; compiled on the first step).
    The options are those of `autopar.options.PlanOptions`.
    """
    options = PlanOptions(
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
    if options.searches_layout:
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
    plan, captured, mesh = plan_for_ranks(model, example_inputs, cluster, loss_fn, options, plan)
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
    (`autopar.search.layouts`); `microbatches=` and `schedule=` pin those.
    The options are those of `autopar.options.PlanOptions`."""
    options = PlanOptions(
        strategy=strategy,
        placements=placements,
        memory_limit=memory_limit,
        time_limit_s=time_limit_s,
        pipeline_stages=pipeline_stages,
        microbatches=microbatches,
        schedule=schedule,
        stage_cuts=stage_cuts,
        fusion=fusion,
        shard_optimizer=shard_optimizer,
    )
    return plan_model(model, example_inputs, cluster, loss_fn, options)
