"""What a compile/plan call asks for: the cluster as the search sees it, the options, and
the batch the graph is captured on (one microbatch when pipelining)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.cluster import Cluster, with_pipeline_axis
from autopar.passes.fusion import fusion_kind
from autopar.plan import Plan
from autopar.search.inter_op import PipelineOptions, search_pipeline
from autopar.search.intra_op import search_plan
from autopar.search.pins import SearchOptions

FUSION_CHOICES = ("none", "triton", "inductor")


@dataclass(frozen=True)
class _Job:
    cluster: Cluster
    options: SearchOptions
    pipeline: PipelineOptions | None
    fusion: str = "none"

    @classmethod
    def make(
        cls,
        batch: Sequence[torch.Tensor],
        cluster: Cluster,
        strategy,
        placements,
        memory_limit,
        time_limit_s,
        pipeline_stages=None,
        microbatches=None,
        schedule=None,
        stage_cuts=None,
        plan: Plan | None = None,
        fusion: str = "none",
    ) -> _Job:
        options = SearchOptions(
            strategy=strategy,
            placements=dict(placements or {}),
            memory_limit=memory_limit,
            time_limit_s=time_limit_s,
        )
        if fusion not in FUSION_CHOICES:
            raise ValueError(f"fusion={fusion!r}: choose one of {', '.join(FUSION_CHOICES)}")
        if plan is not None:
            fusion = fusion_kind(plan.fusion)
        if plan is not None and plan.pipeline is not None:
            pipeline_stages = plan.pipeline.pp
            microbatches = plan.pipeline.microbatches
        cluster = with_pipeline_axis(cluster, pipeline_stages)
        if "pp" not in cluster.axis_names:
            return cls(cluster, options, None, fusion)
        pp = cluster.mesh_shape[0]
        rows = batch[0].shape[0]
        m = microbatches or _default_microbatches(rows, pp)
        if rows % m:
            raise ValueError(
                f"the batch has {rows} rows, which do not split into "
                f"microbatches={m}; pick a divisor of {rows}"
            )
        cuts = tuple(stage_cuts) if stage_cuts is not None else None
        return cls(cluster, options, PipelineOptions(m, schedule, cuts), fusion)

    def capture_batch(self, batch: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Pipelined graphs are captured on one microbatch (the shapes each stage runs)."""
        if self.pipeline is None:
            return tuple(batch)
        m = self.pipeline.microbatches
        return tuple(t.chunk(m, dim=0)[0] for t in batch)

    def fuse(self, captured: Captured) -> tuple[dict, ...]:
        """Swap matched regions of the captured graph for fused kernels (passes/fusion)."""
        if self.fusion == "none":
            return ()
        from autopar.passes.fusion import fuse_regions

        return tuple(r.to_dict() for r in fuse_regions(captured, kernels=self.fusion))

    def search(self, captured: Captured, mesh: DeviceMesh, fused: tuple[dict, ...] = ()) -> Plan:
        if self.pipeline is None:
            plan = search_plan(captured, self.cluster, mesh, self.options)
        else:
            stage_names = tuple(n for n in self.cluster.axis_names if n != "pp")
            plan = search_pipeline(
                captured, self.cluster, mesh[stage_names], self.options, self.pipeline
            )
        return replace(plan, fusion=fused)


def _default_microbatches(rows: int, pp: int) -> int:
    """2*pp microbatches (a small bubble), or the largest divisor of the batch below it."""
    for m in range(min(rows, 2 * pp), 0, -1):
        if rows % m == 0:
            return m
    return 1
