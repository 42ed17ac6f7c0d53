"""A plan as data and text: `describe()` (JSON-able), `summary()` (a few lines), the
pipeline timeline (`timeline_text`, `timeline_lines`).

Axis roles are derived from placements, never stored: on each mesh axis,
- most matmuls split over tokens (output Shard(0)), parameters stored replicated -> "dp"
- the same with most parameter bytes stored sharded (gathered for use)          -> "fsdp"
- matmuls split over features (output Shard(1) or Partial: column/row parallel) -> "tp"
  (+ "sp" when norms run sharded on the sequence dim there: LayerNorm, RMSNorm fused or
  decomposed, by the op computing the row statistic, `rules.sequence.NORM_OPS`)
- nothing split                                                                 -> "replicated"
- attention queries split on the sequence (context parallel, `rules.attention`) -> "cp"
  (or "<role>+cp" when the axis plays another role too)
- stacked expert weights (3-D parameters read by batched matmuls) stored split on their
  expert dim 0                                                                  -> "+ep"
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict

import torch
from torch.distributed.tensor import Shard

from autopar.cost_models.memory import local_numel
from autopar.cost_models.ring import ring_traffic_bytes
from autopar.passes.strategies.rules.sequence import is_norm, seq_sharded
from autopar.plan import NodePlan, Plan, parse_spec
from autopar.views.layers import axis_traffic, fmt_bytes, producers


def axis_roles(plan: Plan) -> list[str]:
    return [_axis_role(plan, axis) for axis in range(len(plan.stage_mesh_shape))]


MATMUL_OPS = ("mm.default", "addmm.default")


def _axis_role(plan: Plan, axis: int) -> str:
    role = _base_role(plan, axis)
    if context_parallel_attention(plan, axis):
        role = "cp" if role in ("replicated", "dp") else role + "+cp"
    if expert_sharded(plan, axis):
        role = "ep" if role == "replicated" else role + "+ep"
    return role


def expert_sharded(plan: Plan, axis: int) -> list[str]:
    """Stacked expert weights (3-D parameters `[E, ...]`, E > 1) stored Shard(0) on `axis`
    (a ViT's `[1, tokens, dim]` position embedding under FSDP is not one)."""
    return [
        t.fqn
        for t in plan.tensors
        if t.kind == "param"
        and len(t.shape) == 3
        and t.shape[0] > 1
        and t.spec.split(",")[axis] == "S(0)"
    ]


def context_parallel_attention(plan: Plan, axis: int) -> list[NodePlan]:
    """Attention nodes whose queries (first input) are sequence-split on `axis`."""
    return [
        n
        for n in plan.nodes
        if n.op.startswith("scaled_dot_product_attention")
        and n.inputs
        and n.inputs[0]
        and n.inputs[0].split(",")[axis] == "S(2)"
    ]


def ring_attention(plan: Plan, axis: int) -> list[NodePlan]:
    """Context-parallel attention nodes on `axis` that run as a ring (K split on the
    sequence too, `rules.ring`), not with all-gathered K/V."""
    return [
        n
        for n in context_parallel_attention(plan, axis)
        if len(n.inputs) > 1 and n.inputs[1] and n.inputs[1].split(",")[axis] == "S(2)"
    ]


def ring_traffic(plan: Plan, axis: int) -> tuple[float, float]:
    """(forward, backward) bytes a rank passes around the ring on `axis` per step: every
    ring attention's local K and V blocks, (n - 1) passes forward and 2n - 1 backward
    (`cost_models.ring`)."""
    produced, mesh = producers(plan), plan.stage_mesh_shape
    fwd = bwd = 0.0
    for n in ring_attention(plan, axis):
        kv = 0.0
        for arg, spec in zip(n.args[1:3], n.inputs[1:3], strict=False):
            src = produced.get(arg)
            if src is None or src.shape is None or src.dtype is None or spec is None:
                continue
            itemsize = getattr(torch, src.dtype).itemsize
            kv += local_numel(src.shape, parse_spec(spec), mesh) * itemsize
        f, b = ring_traffic_bytes(mesh[axis], kv)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def region_all_to_all(plan: Plan, axis: int) -> list[float]:
    """Per region (`autopar.Region`) whose experts are split on `axis`: the bytes a rank's
    dispatch and combine move per step in forward (its share of the batch's payload,
    twice); backward runs the forward's exchanges again and their reverses (twice that)."""
    mesh = plan.stage_mesh_shape
    stacked = {t.name for t in plan.tensors if t.kind == "param" and len(t.shape) == 3}
    out = []
    for n in plan.nodes:
        if not n.exchange_bytes or not n.inputs or n.inputs[0] is None:
            continue
        experts = [s for s, a in zip(n.inputs, n.args, strict=False) if s and a in stacked]
        if not any(spec.split(",")[axis] == "S(0)" for spec in experts):
            continue
        rows = parse_spec(n.inputs[0])
        split = math.prod(size for p, size in zip(rows, mesh, strict=True) if isinstance(p, Shard))
        out.append(2 * n.exchange_bytes / split)
    return out


def _base_role(plan: Plan, axis: int) -> str:
    outs = [
        n.outputs[0].split(",")[axis]
        for n in plan.nodes
        if n.op in MATMUL_OPS and n.outputs and n.outputs[0]
    ]
    experts = set(expert_sharded(plan, axis))  # EP, named apart (`_axis_role`)
    params = [t for t in plan.tensors if t.kind == "param" and t.fqn not in experts]
    sharded = sum(_numel(t.shape) for t in params if isinstance(parse_spec(t.spec)[axis], Shard))
    total = sum(_numel(t.shape) for t in params) or 1
    data = sum(o == "S(0)" for o in outs)
    tensor = sum(o not in ("S(0)", "R") for o in outs)
    if outs and data >= max(tensor, 1) and data * 2 >= len(outs):
        return "fsdp" if sharded > total / 2 else "dp"
    if tensor:
        return "tp+sp" if _seq_sharded(plan, axis) else "tp"
    return "replicated"


def _seq_sharded(plan: Plan, axis: int) -> bool:
    return bool(seq_sharded_norms(plan, axis))


def seq_sharded_norms(plan: Plan, axis: int) -> list[NodePlan]:
    """The norms (row-statistic nodes) whose output is sequence-sharded on `axis`."""
    out = []
    for n in plan.nodes:
        if not (is_norm(n.op) and n.outputs and n.outputs[0] and n.shapes and n.shapes[0]):
            continue
        if seq_sharded(n.outputs[0].split(",")[axis], len(n.shapes[0])):
            out.append(n)
    return out


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def describe(plan: Plan) -> dict:
    roles = dict(zip(plan.stage_axis_names, axis_roles(plan), strict=True))
    out = {
        "strategy": plan.strategy,
        "graph_fingerprint": plan.graph_fingerprint,
        "content_hash": plan.content_hash,
        "stages": _stages(plan, roles),
        "predicted_step_time": plan.predicted_step_time,
        "ilp_step_time_bound": plan.solver.get("ilp_step_time_bound"),
        "comm": None if plan.comm is None else asdict(plan.comm),
        "predicted_peak_memory": plan.predicted_peak_memory,
        "parameters": {t.fqn: t.spec for t in plan.tensors if t.kind == "param"},
        "inputs": {t.fqn: t.spec for t in plan.tensors if t.kind == "input"},
        "solver": plan.solver,
    }
    if plan.pipeline is not None:
        p = plan.pipeline
        out["pipeline"] = {
            "pp": p.pp,
            "schedule": p.schedule,
            "microbatches": p.microbatches,
            "boundary": p.boundary,
            "bubble": plan.solver.get("bubble"),
            "timeline": list(p.timeline),
        }
    return out


def _stages(plan: Plan, roles: dict[str, str]) -> list[dict]:
    stage_size = _numel(plan.stage_mesh_shape)
    common = {
        "mesh": list(plan.stage_mesh_shape),
        "axis_names": list(plan.stage_axis_names),
        "axis_roles": roles,
    }
    if plan.pipeline is None:
        return [{"stage": 0, "devices": list(range(stage_size)), **common}]
    p = plan.pipeline
    bounds = [*p.stage_cuts, len(p.layers)]
    return [
        {
            "stage": s,
            "devices": [r * stage_size + j for j in range(stage_size)],
            "pipeline_rank": r,
            "layers": list(p.layers[bounds[s] : bounds[s + 1]]),
            **common,
        }
        for s, r in enumerate(p.rank_of_stage)
    ]


def _bound(plan: Plan) -> str:
    bound = plan.solver.get("ilp_step_time_bound")
    return "" if bound is None else f" (ILP bound {bound * 1e3:.3f} ms)"


def summary(plan: Plan) -> str:
    d = describe(plan)
    stage = d["stages"][0]
    lines = [
        f"autopar plan {d['content_hash']} for graph {d['graph_fingerprint']} "
        f"(strategy={d['strategy']})",
        f"{'stage ' if plan.pipeline else ''}mesh {tuple(stage['mesh'])} axes "
        + ", ".join(f"{a}={r}" for a, r in stage["axis_roles"].items()),
        f"predicted step time {plan.predicted_step_time * 1e3:.3f} ms{_bound(plan)}, "
        f"peak memory {plan.predicted_peak_memory / 2**30:.3f} GiB per device",
        "parameter placements: "
        + ", ".join(f"{spec}×{n}" for spec, n in Counter(d["parameters"].values()).most_common()),
        "inputs: " + ", ".join(f"{k}={v}" for k, v in d["inputs"].items()),
    ]
    lines += parallelism_lines(plan)
    lines.append("memory levers: " + memory_levers(plan))
    if plan.pipeline is not None:
        lines += _pipeline_lines(plan, d)
    if plan.solver:
        s = plan.solver
        lines.append(
            f"solver: {s.get('status')} gap {s.get('gap', 0):.2g} in "
            f"{s.get('solve_time_s', 0):.2f}s ({s.get('ilp_decisions')} decisions, "
            f"{s.get('edges')} edges; search {s.get('search_time_s', 0):.2f}s)"
        )
    return "\n".join(lines)


def parallelism_lines(plan: Plan) -> list[str]:
    """One line per axis that splits the sequence or the experts: sequence-parallel norms
    (SP), context-parallel attention (CP: K/V all-gathered, or a ring with its K/V passes
    per step), expert-parallel weights (EP),
    and the collectives on that axis per step (forward edges; backward runs their
    transposes: all-gather <-> reduce-scatter, all-to-all back)."""
    lines = []
    traffic = None
    norms_total = sum(is_norm(n.op) for n in plan.nodes)
    attn_total = sum(n.op.startswith("scaled_dot_product_attention") for n in plan.nodes)
    experts_total = sum(t.kind == "param" and len(t.shape) == 3 for t in plan.tensors)
    for axis, name in enumerate(plan.stage_axis_names):
        norms, attn = seq_sharded_norms(plan, axis), context_parallel_attention(plan, axis)
        experts = expert_sharded(plan, axis)
        parts = [f"SP norms {len(norms)}/{norms_total}"] if norms else []
        ring = ring_attention(plan, axis)
        if len(attn) > len(ring):
            parts.append(f"CP attention {len(attn) - len(ring)}/{attn_total} (K/V all-gathered)")
        if ring:
            fwd, bwd = ring_traffic(plan, axis)
            parts.append(
                f"CP ring attention {len(ring)}/{attn_total} (K/V passes per step "
                f"{fmt_bytes(fwd)} forward, {fmt_bytes(bwd)} backward)"
            )
        if experts:
            parts.append(f"EP expert weights {len(experts)}/{experts_total}")
        dispatched = region_all_to_all(plan, axis)
        if dispatched:
            parts.append(
                f"EP regions {len(dispatched)} (all-to-all per step {fmt_bytes(sum(dispatched))}"
                f" forward, {fmt_bytes(2 * sum(dispatched))} backward)"
            )
        if not parts:
            continue
        traffic = axis_traffic(plan) if traffic is None else traffic
        moved = ", ".join(f"{k} {fmt_bytes(b)}" for k, b in sorted(traffic.get(name, {}).items()))
        lines.append(f"{name}: {', '.join(parts)}; forward traffic per step {moved or 'none'}")
    return lines


def memory_levers(plan: Plan) -> str:
    """One line: recompute per policy, FSDP reshard, precision policy, ZeRO stage."""
    m = plan.memory
    parts = []
    for policy in ("selective", "full"):
        layers = [layer for layer, p in m.recompute if p == policy]
        if layers:
            parts.append(f"{policy} recompute in {len(layers)} layer(s)")
    if m.reshard_after_forward:
        parts.append(f"reshard after forward in {len(m.reshard_after_forward)} layer(s)")
    if m.param_dtype:
        scaling = ", loss scaling" if m.loss_scaling else ""
        parts.append(f"compute {m.param_dtype}, reduce {m.reduce_dtype}{scaling}")
    if m.shard_optimizer:
        parts.append("ZeRO-2" if m.shard_gradients else "ZeRO-1")
    return "; ".join(parts) or "none"


def _pipeline_lines(plan: Plan, d: dict) -> list[str]:
    p = plan.pipeline
    if p.pp == 1:  # one pipeline rank: the gradients accumulate over the microbatches
        return [
            f"gradient accumulation: {p.microbatches} microbatches, {len(p.stage_cuts)} "
            f"stage(s) in {p.schedule}'s order, each stage's gradients reduced after its last "
            "backward"
        ]
    lines = [
        f"pipeline: {p.pp} ranks x {len(p.stage_cuts) // p.pp} stages each, schedule "
        f"{p.schedule}, {p.microbatches} microbatches, bubble "
        f"{(d['pipeline']['bubble'] or 0) * 100:.1f}%"
        + (", activations scattered between stages" if p.boundary == "scattered" else "")
    ]
    for st in d["stages"]:
        layers = st["layers"]
        span = f"{layers[0]}..{layers[-1]}" if layers else "-"
        lines.append(
            f"  stage {st['stage']} on pipeline rank {st['pipeline_rank']} "
            f"(devices {st['devices'][0]}..{st['devices'][-1]}): layers {span}"
        )
    return lines


def timeline_text(plan: Plan) -> str:
    """One row per pipeline rank: its actions in order (F/B/W stage.microbatch)."""
    if plan.pipeline is None:
        return ""
    return "\n".join(f"rank {r}: {row}" for r, row in enumerate(plan.pipeline.timeline))


def timeline_lines(plan: Plan, width: int = 100) -> list[str]:
    """`rank r: F0.0 F0.1 ...`, one per pipeline rank; a row longer than `width` keeps its
    head and tail around `… +N …` (N actions left out)."""
    if plan.pipeline is None:
        return []
    return [_fit(f"rank {r}: ", row.split(), width) for r, row in enumerate(plan.pipeline.timeline)]


def _fit(prefix: str, actions: list[str], width: int) -> str:
    line = prefix + " ".join(actions)
    if len(line) <= width:
        return line
    room, n = width - len(prefix), len(actions)

    def text(head: int, tail: int) -> str:
        return " ".join([*actions[:head], f"… +{n - head - tail} …", *actions[n - tail :]])

    head = tail = 0
    while head + tail < n - 1:  # at least one action stays hidden
        more = (head + 1, tail) if head <= tail else (head, tail + 1)
        if len(text(*more)) > room:
            break
        head, tail = more
    return prefix + text(head, tail)
