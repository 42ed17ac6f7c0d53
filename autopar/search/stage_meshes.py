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

from contextlib import nullcontext
from dataclasses import replace
from functools import partial

from autopar._compat import shape_only_mesh
from autopar.capture import Captured
from autopar.capture.analysis import assign_stages
from autopar.cluster import Cluster
from autopar.plan import PipelinePlan, Plan, stage_ranks
from autopar.search import ahead
from autopar.search.inter_op import (
    PipelineOptions,
    PricedSchedule,
    fitting_schedules,
    stage_cluster,
    stage_ilp,
    with_comm,
)
from autopar.search.intra_op import IntraOpResult, prepare_intra, solve_intra
from autopar.search.layer_costs import LayerCosts, layer_costs
from autopar.search.pins import SearchOptions


def node_stages(captured: Captured, cuts: list[int]) -> dict[str, int]:
    """The stage of every node by name: an activation's own (`assign_stages`); a
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
    `pipeline`'s cuts), each node's and tensor's placements and each layer's memory levers
    from its stage's rank's shape; the rest (cluster, solver info) from the plan of rank
    0's shape, with `pipeline`'s rank meshes and the "canonical" boundary."""
    stage_of = node_stages(captured, list(pipeline.stage_cuts))

    def source(name: str) -> Plan:
        return plans[pipeline.mesh_of(pipeline.rank_of_stage[stage_of.get(name, 0)])]

    base = plans[pipeline.mesh_of(0)]
    nodes = tuple(source(n.name).node(n.name) for n in base.nodes)
    tensors = tuple(source(t.name).tensor(t.name) for t in base.tensors)
    # a layer's memory levers: those of its stage's rank's shape
    stage_of_layer = [
        sum(c <= i for c in pipeline.stage_cuts[1:]) for i in range(len(pipeline.layers))
    ]
    levers = {
        layer: plans[pipeline.mesh_of(pipeline.rank_of_stage[stage_of_layer[i]])].memory
        for i, layer in enumerate(pipeline.layers)
    }
    memory = replace(
        base.memory,
        recompute=tuple(
            (k, m.recompute_of(k)) for k, m in levers.items() if k in dict(m.recompute)
        ),
        reshard_after_forward=tuple(k for k, m in levers.items() if k in m.reshard_after_forward),
    )
    pipeline = replace(pipeline, boundary="canonical")
    return replace(base, nodes=nodes, tensors=tensors, pipeline=pipeline, memory=memory)


def on_shape(cluster: Cluster, shape: tuple[int, ...]) -> Cluster:
    """`cluster` (a pipeline's: "pp" first) with its stage mesh of `shape`."""
    if shape == stage_cluster(cluster).mesh_shape:
        return cluster
    return cluster.reshaped((cluster.axis_size("pp"), *shape), cluster.axis_names)


def solve_rank_meshes(
    captured: Captured,
    cluster: Cluster,
    options: SearchOptions,
    pipeline: PipelineOptions,
    layers: dict[str, float] | None = None,
    known: dict[tuple[int, ...], IntraOpResult] | None = None,
) -> tuple[dict[tuple[int, ...], IntraOpResult], PricedSchedule, dict[str, float]]:
    """`inter_op.solve_pipeline` with every pipeline rank on its stage mesh's shape
    (`pipeline.rank_meshes`): one stage ILP per shape (the same weights and budget), each
    rank's stages priced on its shape's answer, the activations crossing "canonical"; the
    fastest schedule that fits wins. ({shape: its ILP's answer}, best, {schedule: step});
    ValueError when none fits; solved again under a smaller budget while none fits, as
    `solve_pipeline` does. `known`: ILP answers by (shape, budget), for these same problems
    (the ones solved here are added)."""
    names = stage_cluster(cluster).axis_names
    options, weights, ilp_limit = stage_ilp(cluster, options, pipeline, layers)
    known = {} if known is None else known
    shapes = list(dict.fromkeys(pipeline.rank_meshes))

    def problem(shape, budget):  # `solve_intra`'s arguments for one shape's stage ILP
        mesh = shape_only_mesh("cpu", shape, names)
        return captured, stage_cluster(on_shape(cluster, shape)), mesh, options, weights, budget

    def solve(budget: float) -> dict[tuple[int, ...], IntraOpResult]:
        todo = [shape for shape in shapes if (shape, budget) not in known]
        for shape, nxt in zip(todo, [*todo[1:], None], strict=False):  # last: no next
            # the next shape's problems are priced (and its ILP started) while this one's
            # solves (`search.ahead`): the same problems, solved the same
            meanwhile = nullcontext()
            if nxt is not None:
                meanwhile = ahead.meanwhile(partial(prepare_intra, *problem(nxt, budget)))
            with meanwhile:
                known[shape, budget] = solve_intra(*problem(shape, budget))
            with_comm(known[shape, budget])
        return {shape: known[shape, budget] for shape in shapes}

    def costs(results: dict) -> tuple[LayerCosts, ...]:
        by_shape = {s: layer_costs(captured, r).repeated(layers or {}) for s, r in results.items()}
        return tuple(by_shape[shape] for shape in pipeline.rank_meshes)

    def memory(results: dict) -> float:
        return max(r.memory for r in results.values())

    pp = cluster.axis_size("pp")
    return fitting_schedules(solve, costs, memory, pp, cluster, pipeline, ilp_limit)


def rank_variants(
    pp: int, schedule: str, shape: tuple[int, ...], per_node: int, rows: int
) -> list[tuple[tuple[int, ...], ...]]:
    """The per-rank stage mesh shapes offered to a pipeline whose ranks all run `shape`
    (dp, tp): the rank holding the first stage (the embedding), the one holding the last
    (the head), or both, on a neighbouring shape (tp halved or doubled, inside a node,
    every data-parallel rank given a share of the microbatch's `rows`); never every rank
    (a uniform pipeline on that shape is a layout of its own)."""
    if len(shape) != 2:
        return []
    dp, tp = shape
    devices, ranks = dp * tp, stage_ranks(schedule, pp)
    tps = [t for t in (tp // 2, tp * 2) if t >= 1 and t != tp and devices % t == 0]
    others = [(devices // t, t) for t in tps if per_node % t == 0 and rows % (devices // t) == 0]
    out: list[tuple[tuple[int, ...], ...]] = []
    for other in others:
        for moved in ({ranks[0]}, {ranks[-1]}, {ranks[0], ranks[-1]}):
            meshes = tuple(other if r in moved else shape for r in range(pp))
            if meshes not in out and len(moved) < pp:
                out.append(meshes)
    return out
