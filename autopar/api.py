"""The public entry points: `autopar.compile` and `autopar.plan`.

Both first build one `autopar.options.PlanOptions` from their keywords, so a bad option
fails before the model is captured; `autopar.planning` does the rest.
compile: capture -> (search on rank 0, broadcast | load a saved plan) -> every rank checks the
plan's hash against rank 0's -> lower -> ParallelModel (PipelineModel when pipelined). A
searched layout is searched on rank 0 under the job's process group (meshes of any shape,
without process groups) and applied by every rank on the plan's mesh.
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
from autopar.devices import cache_host_memory
from autopar.options import PlanOptions
from autopar.plan import Plan
from autopar.planning import plan_model, smaller_microbatch
from autopar.rank_plans import plan_for_ranks
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
    stage_meshes: Sequence[Sequence[int]] | None = None,
    fusion: str = "none",
    mixed_precision: str | None = None,
    reduce_dtype: str = "float32",
    shard_optimizer: bool = False,
    shard_gradients: bool = False,
    activation_checkpointing: str = "auto",
    reshard_after_forward: bool | str = "auto",
) -> ParallelModel | PipelineModel:
    """Plan (or apply `plan`) and build this rank's share of the model for training.

    Every rank calls it with the same model (same initial weights) and the same GLOBAL batch.
    What is searched: by default everything, the layout included (pipeline degree, stage
    cuts, every stage's (dp, tp) mesh, microbatches, schedule), when nothing pins the mesh:
    a cluster on its hardware mesh (`Cluster.preset`'s default, e.g. `nodes=4` without
    `mesh=`), `strategy="auto"`, no `placements`, no `stage_cuts`. A mesh the user gives
    (other sizes or axis names), a named strategy or placements keep that mesh, pipelined
    only if its first axis is named "pp" or `pipeline_stages=n` (n > 1) splits it.
    `pipeline_stages=1` turns pipelining off, `"auto"` searches the layout whatever the
    mesh. `microbatches`, `schedule` (gpipe, 1f1b, interleaved1f1b, interleavedzb, zbv,
    dualpipev) and `stage_cuts` (first layer of each stage) pin what the search would
    choose; `stage_meshes` (per pipeline rank, its stage mesh's shape, the same devices in
    another (dp, tp) layout) pins each rank's. A searched layout runs on the plan's mesh (`plan.mesh_shape`), not the cluster's.
    `fusion="triton"` swaps matched regions (residual add + LayerNorm/RMSNorm, SwiGLU,
    bias + GELU, head matmul + cross-entropy) for autopar's Triton kernels; without a GPU
    they run only under TRITON_INTERPRET=1.
    `fusion="inductor"` hands each rank's step program (each stage's, when pipelined) to
    torch.compile instead (C++ on CPU, Triton on GPU; compiled on the first step).
    `mixed_precision="bf16"|"fp16"` trains an fp32 model in that compute dtype with fp32
    master weights and optimizer state, gradients reduced in `reduce_dtype` (fp16: dynamic
    loss scaling); `shard_optimizer=True` (ZeRO-1) keeps the master and optimizer state as a
    flat shard over each parameter's replicas, `shard_gradients=True` (ZeRO-2) the gradient
    too (`autopar.runtime.optimizer` lists what a rank holds in each case).
    `activation_checkpointing` ("auto": searched per layer, or "none"/"selective"/"full")
    and `reshard_after_forward` ("auto": searched per layer, or True/False: FSDP-gathered
    weights freed after forward and gathered again for backward) pin the memory levers.
    The options are those of `autopar.options.PlanOptions`.
    On a CPU mesh the process keeps its freed host memory for reuse, as a GPU's caching
    allocator does (`autopar.devices.cache_host_memory`; `AUTOPAR_HOST_MALLOC=system`
    leaves the allocator alone).
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
        stage_meshes=stage_meshes,
        fusion=fusion,
        mixed_precision=mixed_precision,
        reduce_dtype=reduce_dtype,
        shard_optimizer=shard_optimizer,
        shard_gradients=shard_gradients,
        activation_checkpointing=activation_checkpointing,
        reshard_after_forward=reshard_after_forward,
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
    if mesh.device_type == "cpu":  # as a GPU's caching allocator: freed tensors kept
        cache_host_memory()
    if plan.pipeline is not None:
        smaller = smaller_microbatch(model, example_inputs, loss_fn, options, plan)
        return PipelineModel(model, captured, plan, mesh, optimizer, smaller)
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
    stage_meshes: Sequence[Sequence[int]] | None = None,
    fusion: str = "none",
    shard_optimizer: bool = False,
    shard_gradients: bool = False,
    mixed_precision: str | None = None,
    reduce_dtype: str = "float32",
    activation_checkpointing: str = "auto",
    reshard_after_forward: bool | str = "auto",
) -> Plan:
    """Search a plan without processes or weights (the model may be on the meta device).

    `shard_optimizer=True` prices ZeRO-1 (master and optimizer state split over the
    devices holding the same shard), `shard_gradients=True` ZeRO-2, `mixed_precision` the
    policy, as `compile` runs them.

    What is searched is as for `compile`: by default the layout too (the pipeline degree,
    the stage cuts, every stage's (dp, tp) mesh, the microbatch count and the schedule,
    `autopar.search.layouts`) when nothing pins the mesh (`autopar.planning.searches_layout`);
    `pipeline_stages=1` turns pipelining off, an int pins the degree, "auto" searches the
    layout on any cluster; `microbatches=`, `schedule=` and `stage_meshes=` pin those.
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
        stage_meshes=stage_meshes,
        fusion=fusion,
        shard_optimizer=shard_optimizer,
        shard_gradients=shard_gradients,
        mixed_precision=mixed_precision,
        reduce_dtype=reduce_dtype,
        activation_checkpointing=activation_checkpointing,
        reshard_after_forward=reshard_after_forward,
    )
    return plan_model(model, example_inputs, cluster, loss_fn, options)
