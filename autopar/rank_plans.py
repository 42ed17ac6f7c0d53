"""compile's half of planning: every rank holds the same plan for its captured graph.

`plan_for_ranks(model, batch, cluster, loss_fn, options, plan) -> (plan, captured, mesh)`:
rank 0 searches (the layout too, under the job's own group, `planning.plan_layout`) and
broadcasts its plan (`from_rank0`), or every rank checks a saved plan against its own graph
and mesh (`check_plan_matches`; a cluster on its hardware mesh takes the plan's mesh,
`on_plan_mesh`); then every rank compares the plan's hash with rank 0's before the first
collective (`verify_same_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.capture.template import BUILT, DEPTH_HINT
from autopar.cluster import Cluster
from autopar.options import PlanOptions
from autopar.plan import Plan
from autopar.planning import hardware_mesh, plan_layout, prepare, searches_layout


def plan_for_ranks(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    cluster: Cluster,
    loss_fn: Callable | None,
    options: PlanOptions,
    plan: Plan | None,
) -> tuple[Plan, Captured, DeviceMesh]:
    """compile's half: every rank holds the same plan for its captured graph, and the
    mesh it runs on. A searched layout: rank 0 plans as `autopar.plan` does (meshes
    without process groups under the job's group) and broadcasts the plan; every rank
    then applies it on the plan's mesh."""
    if plan is None and searches_layout(options, cluster):
        plan = from_rank0(lambda: plan_layout(model, batch, cluster, loss_fn, options))
        cluster = on_plan_mesh(plan, cluster)
    elif plan is not None and hardware_mesh(cluster):
        cluster = on_plan_mesh(plan, cluster)
    searches = plan is None and dist.get_rank() == 0  # the others receive its plan
    job, captured, regions, tpl = prepare(
        model, batch, cluster, loss_fn, options, plan, template=searches
    )
    mesh = job.cluster.device_mesh()
    if plan is not None:
        check_plan_matches(plan, captured, job.cluster)
    else:
        plan = from_rank0(lambda: job.search(captured, mesh, regions, tpl))
    verify_same_plan(plan)
    return plan, captured, mesh


def on_plan_mesh(plan: Plan, cluster: Cluster) -> Cluster:
    """The cluster's devices on the plan's mesh: the layout a search chose, or a saved
    plan's for a cluster given by its hardware mesh (a mesh the user pinned is compared
    with the plan's as it is, `check_plan_matches`)."""
    same = plan.mesh_shape == cluster.mesh_shape and plan.axis_names == cluster.axis_names
    if same or math.prod(plan.mesh_shape) != cluster.world_size:
        return cluster
    return cluster.reshaped(plan.mesh_shape, plan.axis_names)


def check_plan_matches(plan: Plan, captured: Captured, cluster: Cluster) -> None:
    """A saved plan applies only to the graph and the mesh it was made for."""
    if plan.solver.get("shard_optimizer") and not plan.memory.shard_optimizer:
        raise ValueError(
            "this plan was priced with shard_optimizer=True by an older autopar that did "
            "not record it in plan.memory; re-plan it to train"
        )
    if plan.graph_fingerprint != captured.fingerprint:
        raise ValueError(
            f"this plan was made for another model or batch shape (graph fingerprint "
            f"{plan.graph_fingerprint}, this model's is {captured.fingerprint}); re-plan with "
            "autopar.plan / `autopar plan` for this model and batch."
            + (DEPTH_HINT if plan.solver.get("graph") == BUILT else "")
        )
    if plan.mesh_shape != tuple(cluster.mesh_shape):
        raise ValueError(
            f"this plan is for a mesh {plan.mesh_shape} but the cluster's mesh is "
            f"{tuple(cluster.mesh_shape)}; re-plan for this cluster or launch "
            f"{math.prod(plan.mesh_shape)} processes with that mesh."
        )


def from_rank0(search: Callable[[], Plan]) -> Plan:
    """Rank 0 runs `search`; the others receive its plan (solvers with time limits are
    not guaranteed to answer identically on every rank)."""
    box: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = search().to_json()
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
