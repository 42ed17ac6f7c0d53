"""Pipelines whose ranks run their stages on stage meshes of different shapes.

Alpa chooses a submesh per stage; here every pipeline rank keeps the same number of
devices (the "pp" axis splits the world evenly) and the same axis names, and a rank may
lay them out in another (dp, tp) shape: the rank holding the embedding or the head can
take more tensor parallelism, or less, than the blocks (`PipelinePlan.rank_meshes`).

`merged_plan(captured, plans, pipeline)`: one plan per stage mesh shape (each solved on
its shape, same cuts, schedule and microbatches) made into the pipeline's plan, every node
and tensor taken from the plan of the shape its stage's rank runs (`node_stages`).
Activations then cross every boundary split alike on any shape (the "canonical"
boundary, `plan.canonical_spec`): the sending stage redistributes into it, the receiving
stage out of it.
"""

from __future__ import annotations

from dataclasses import replace

from autopar.capture import Captured
from autopar.capture.analysis import assign_stages
from autopar.plan import PipelinePlan, Plan


def node_stages(captured: Captured, cuts: list[int]) -> dict[str, int]:
    """The stage of every node by name: an activation's own (`passes.stages`); a
    parameter, buffer, constant or anything computed from them alone, the first stage that
    reads it (nothing reads it: the first)."""
    stage_of = {n.name: s for n, s in assign_stages(captured, cuts).items()}
    for n in reversed(list(captured.gm.graph.nodes)):
        if n.name in stage_of or n.op == "output":
            continue
        readers = [stage_of[u.name] for u in n.users if u.name in stage_of]
        stage_of[n.name] = min(readers, default=0)
    return stage_of


def merged_plan(captured: Captured, plans: dict[tuple[int, ...], Plan], pipeline: PipelinePlan):
    """The pipeline's plan from each stage mesh shape's (`plans[shape]`, all with
    `pipeline`'s cuts), each node's and tensor's placements from its stage's rank's shape;
    the rest (cluster, solver info, memory levers) from the plan of rank 0's shape, with
    `pipeline`'s rank meshes and the "canonical" boundary."""
    stage_of = node_stages(captured, list(pipeline.stage_cuts))

    def source(name: str) -> Plan:
        return plans[pipeline.mesh_of(pipeline.rank_of_stage[stage_of.get(name, 0)])]

    base = plans[pipeline.mesh_of(0)]
    nodes = tuple(source(n.name).node(n.name) for n in base.nodes)
    tensors = tuple(source(t.name).tensor(t.name) for t in base.tensors)
    pipeline = replace(pipeline, boundary="canonical")
    return replace(base, nodes=nodes, tensors=tensors, pipeline=pipeline)
