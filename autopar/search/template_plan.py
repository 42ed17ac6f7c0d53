"""Plan the whole model from its two-block template: solve once, replicate the decisions.

`plan_from_template(full, template, cluster, mesh, options, pipeline) -> Plan | None`

The intra-op ILP already shares the decisions of identical blocks (`intra_op.share_layers`),
so solving it on the full capture prices every block's nodes and edges only to add them up
on the same variables. The template (`autopar.capture.template`: the model captured with
two blocks, the second weighted by the number of blocks it stands for) gives the same ILP,
the same objective and memory (tests/test_layouts.py, tests/test_template_plan.py), at the
price of two blocks. Its answer is replicated onto the full capture:

- `template_nodes`: full node -> template node. Block 0 maps onto the template's block 0,
  every later block onto its block 1 (each stack's so; block 1 onto block 1 and later ones
  onto block 2 where the template kept three, T5's first block being unlike the others),
  node by node in graph order; the nodes outside the blocks (embedding, head, loss,
  inputs) map in order. Ops and shapes must agree, else
  `None` (the model's forward depends on its depth otherwise than by iterating: the caller
  searches the full capture instead). So do `share_layers=False` and `placements=` pins
  (a pin may name a parameter of a block the template did not capture).
- the chosen strategy and the "priced" mark (decision head) of each node are its template
  node's; a layer's recompute / reshard-after-forward policy is its template layer's.
- pipelines: the template's per-layer costs stretched to the full depth
  (`LayerCosts.repeated`), as the layout search prices them; the cuts index full layers.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import replace

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autopar.capture import Captured
from autopar.capture.analysis import layer_order
from autopar.capture.export import layer_of
from autopar.capture.template import Template
from autopar.cluster import Cluster
from autopar.plan import DEFAULT_COMM, MemoryPlan, Plan, mixed_shapes
from autopar.search.costs import CostWeights
from autopar.search.inter_op import (
    PipelineOptions,
    prepare_pipeline,
    solve_pipeline,
    stage_cluster,
)
from autopar.search.intra_op import IntraOpResult, prepare_intra, solve_intra
from autopar.search.pins import SearchOptions
from autopar.search.pipeline_plan import pipeline_plan
from autopar.search.progress import phase
from autopar.search.stage_meshes import merged_plan, on_shape, solve_rank_meshes
from autopar.search.to_plan import assemble_plan


def layer_names(full: Captured, tpl: Captured) -> dict[str, str] | None:
    """Full layer -> the template layer it is planned as (None if the template has none):
    the k-th block of a stack is the template's k-th of that stack, or its last where the
    template cut the stack (an encoder-decoder's two stacks each so)."""
    full_layers, tpl_layers = layer_order(full), layer_order(tpl)
    if not tpl_layers or len(tpl_layers) > len(full_layers):
        return None
    twins: dict[str, list[str]] = defaultdict(list)
    for name in tpl_layers:
        twins[name.rpartition(".")[0]].append(name)
    seen: Counter[str] = Counter()
    out = {}
    for name in full_layers:
        stack = name.rpartition(".")[0]
        if stack not in twins:
            return None
        out[name] = twins[stack][min(seen[stack], len(twins[stack]) - 1)]
        seen[stack] += 1
    return out


def template_nodes(full: Captured, tpl: Captured) -> dict[fx.Node, fx.Node] | None:
    """Every full node's template node, or None when the graphs do not correspond."""
    names = layer_names(full, tpl)
    if names is None:
        return None
    tpl_groups = _groups(tpl)
    out: dict[fx.Node, fx.Node] = {}
    for layer, nodes in _groups(full).items():
        twins = tpl_groups.get(names[layer] if layer is not None else None, [])
        if len(twins) != len(nodes):
            return None
        for n, t in zip(nodes, twins, strict=True):
            if not _same_node(n, t):
                return None
            out[n] = t
    return out


def _groups(captured: Captured) -> dict[str | None, list[fx.Node]]:
    groups: dict[str | None, list[fx.Node]] = defaultdict(list)
    for n in captured.gm.graph.nodes:
        groups[layer_of(n)].append(n)
    return groups


def _same_node(a: fx.Node, b: fx.Node) -> bool:
    if a.op != b.op or (a.op == "call_function" and a.target != b.target):
        return False
    if a.op == "placeholder" and a.meta.get("autopar_role") != b.meta.get("autopar_role"):
        return False
    return _shapes(a) == _shapes(b)


def _shapes(n: fx.Node) -> tuple:
    val = n.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return tuple(
        (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__ for v in vals
    )


def _memory_plan(result: IntraOpResult, names: dict[str, str]) -> MemoryPlan:
    """The template's per-layer levers on every full layer it stands for."""
    recompute, raf = result.memory_plan
    policy, resharded = dict(recompute), set(raf)
    by_full = [(full, tpl) for full, tpl in names.items()]
    return MemoryPlan(
        recompute=tuple((f, policy[t]) for f, t in by_full if t in policy),
        reshard_after_forward=tuple(f for f, t in by_full if t in resharded),
    )


def solved_key(cluster: Cluster, options: SearchOptions, microbatches: int | None) -> str:
    """What a template's solve depends on besides the template (`Template.solved`)."""
    return repr((json.dumps(cluster.to_dict(), sort_keys=True), options, microbatches))


def solve_on_template(
    template: Template,
    cluster: Cluster,
    mesh: DeviceMesh,
    options: SearchOptions,
    pipeline: PipelineOptions | None,
):
    """`solve_intra` (no pipeline) or `solve_pipeline` on the template, solved once per
    problem: a pinned schedule reuses a search over all schedules that chose it."""
    m = pipeline and pipeline.microbatches
    key = solved_key(cluster, options, m)
    known = template.solved.get(key)
    if pipeline is None:
        if known is None:
            weights = CostWeights(layer=template.weights)
            known = solve_intra(
                template.captured, cluster, mesh, options, weights, comm=DEFAULT_COMM
            )
            template.solved[key] = known
        return known
    if known is not None and pipeline.stage_cuts is None and not pipeline.rank_meshes:
        if pipeline.schedule in (None, known[1].schedule):
            return known
    if mixed_shapes(pipeline.rank_meshes):  # ({shape: result}, best, schedules)
        # each shape's stage ILP, kept for the final plan of the layout search's winner
        first = on_shape(cluster, pipeline.rank_meshes[0])  # as the final plan's job has it
        known = template.solved.setdefault(f"stage ILPs {solved_key(first, options, m)}", {})
        return solve_rank_meshes(
            template.captured,
            cluster,
            options,
            pipeline,
            template.weights,
            known,
        )
    found = solve_pipeline(
        template.captured,
        cluster,
        mesh[stage_cluster(cluster).axis_names],
        options,
        pipeline,
        layers=template.weights,
    )
    if pipeline.stage_cuts is None and pipeline.schedule is None and not pipeline.rank_meshes:
        template.solved[key] = found
    return found


def prepare_on_template(
    template: Template,
    cluster: Cluster,
    mesh: DeviceMesh,
    options: SearchOptions,
    pipeline: PipelineOptions | None,
) -> None:
    """What `solve_on_template` with the same arguments computes before its first ILP,
    computed now (`search.ahead`); nothing where its solve is known."""
    if solved_key(cluster, options, pipeline and pipeline.microbatches) in template.solved:
        return
    if pipeline is None:
        weights = CostWeights(layer=template.weights)
        prepare_intra(template.captured, cluster, mesh, options, weights, comm=DEFAULT_COMM)
    else:
        stage_mesh = mesh[stage_cluster(cluster).axis_names]
        prepare_pipeline(
            template.captured, cluster, stage_mesh, options, pipeline, template.weights
        )


def template_applies(options: SearchOptions) -> bool:
    """Whether a plan can be solved on a template: not when blocks are decided one by one,
    nor under placement pins (a pin may name a block the template did not capture)."""
    return options.share_layers and not options.placements


def plan_from_template(
    full: Captured,
    template: Template,
    cluster: Cluster,
    mesh: DeviceMesh,
    options: SearchOptions,
    pipeline: PipelineOptions | None = None,
) -> Plan | None:
    """The plan of `full` solved on `template` (None: the graphs do not correspond).
    `cluster` and `mesh` as for `search_plan`, or with the "pp" axis for a pipeline."""
    if not template_applies(options):
        return None
    tpl = template.captured
    with phase("assembly"):
        nodes = template_nodes(full, tpl)
        names = layer_names(full, tpl)
    if nodes is None or names is None or template.total_layers != len(names):
        return None
    if pipeline is None:
        result = solve_on_template(template, cluster, mesh, options, None)
        step, peak = result.step_time, result.memory
        extra = {"ilp_step_time_bound": result.objective}
    else:
        result, best, schedules = solve_on_template(template, cluster, mesh, options, pipeline)
        step, peak = best.step_time, best.peak_memory
        extra = {"schedules": schedules, **best.info()}

    def assembled(cluster: Cluster, result: IntraOpResult) -> Plan:
        """The plan of `full` from the template's answer `result` on `cluster`."""
        chosen = {n: result.chosen[t] for n, t in nodes.items() if t in result.chosen}
        priced = frozenset(n for n, t in nodes.items() if t in result.priced)
        memory = _memory_plan(result, names)
        info = {
            **result.info,
            **extra,
            "recompute": dict(memory.recompute),
            "reshard_after_forward": list(memory.reshard_after_forward),
            "template_blocks": len(layer_order(tpl)),
        }
        plan = assemble_plan(
            full,
            cluster,
            chosen,
            options.strategy_name(),
            step,
            peak,
            info,
            priced=priced,
            memory=memory,
            comm=result.comm,
        )
        if pipeline is not None:
            plan = replace(plan, pipeline=pipeline_plan(full, cluster, pipeline, best))
        return plan

    with phase("assembly"):
        if isinstance(result, dict):  # pipeline ranks on stage meshes of different shapes
            plans = {shape: assembled(on_shape(cluster, shape), r) for shape, r in result.items()}
            return merged_plan(full, plans, plans[pipeline.rank_meshes[0]].pipeline)
        return assembled(cluster, result)
