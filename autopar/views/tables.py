"""A plan as rich tables: the header, pipeline stages, fused regions, and per layer group the
placements of every node and parameter with the collectives on their edges.

`render_plan` prints them all in the order `autopar inspect` shows them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.table import Table

from autopar.cluster import Cluster
from autopar.plan import Plan, mixed_shapes
from autopar.views.describe import (
    axis_roles,
    describe,
    memory_levers,
    parallelism_lines,
    timeline_lines,
)
from autopar.views.layers import (
    LayerGroup,
    Produced,
    fmt_bytes,
    group_layers,
    has_edges,
    node_edges,
    param_uses,
    producers,
    relative_name,
)

_GiB = 2**30


def _stage_meshes_text(plan: Plan) -> str:
    """The stage mesh, or each pipeline rank's where their shapes differ."""
    pipe, names = plan.pipeline, plan.stage_axis_names
    if not mixed_shapes(pipe.rank_meshes):
        return _mesh_text(names, plan.stage_mesh_shape)
    return (
        "; ".join(f"rank {r}: {_mesh_text(names, pipe.mesh_of(r))}" for r in range(pipe.pp))
        + f" (activations cross {pipe.boundary})"
    )


def header_table(plan: Plan) -> Table:
    cluster = Cluster.from_dict(plan.cluster)
    roles = axis_roles(plan)
    params = [t for t in plan.tensors if t.kind == "param"]
    numel = sum(math.prod(t.shape) for t in params)
    peak = plan.predicted_peak_memory
    table = Table(title=f"autopar plan {plan.content_hash}", show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rows = {
        "strategy": plan.strategy,
        "fusion": plan.fusion,
        "graph": plan.graph_fingerprint,
        "devices": f"{cluster.world_size} × {cluster.device.name} ({cluster.backend})",
        "mesh": _mesh_text(plan.axis_names, plan.mesh_shape),
        **({"stage mesh": _stage_meshes_text(plan)} if plan.pipeline is not None else {}),
        "axis roles": ", ".join(
            f"{n}={r}" for n, r in zip(plan.stage_axis_names, roles, strict=True)
        ),
        "links": ", ".join(
            f"{n}: {lk}" for n, lk in zip(plan.axis_names, cluster.links, strict=True)
        ),
        "step time": step_text(plan),
        "peak memory": f"{fmt_bytes(peak)} per device (predicted, "
        f"{100 * peak / cluster.device.memory_bytes:.1f}% of "
        f"{cluster.device.memory_bytes / _GiB:.0f} GiB)",
        **{
            f"split on {axis}": text
            for axis, text in (line.split(": ", 1) for line in parallelism_lines(plan))
        },
        "memory levers": memory_levers(plan),
        "parameters": f"{len(params)} tensors, {numel / 1e6:.2f} M elements; "
        + ", ".join(f"{s}×{k}" for s, k in Counter(t.spec for t in params).most_common()),
        "inputs": ", ".join(f"{t.fqn}={t.spec}" for t in plan.tensors if t.kind == "input"),
        **_pipeline_rows(plan),
        "solver": _solver_text(plan.solver),
    }
    for key, value in rows.items():
        table.add_row(key, value)
    return table


def _mesh_text(names: Sequence[str], shape: Sequence[int]) -> str:
    return " × ".join(f"{n}={s}" for n, s in zip(names, shape, strict=True))


def _pipeline_rows(plan: Plan) -> dict[str, str]:
    p = plan.pipeline
    if p is None:
        return {}
    stages = len(p.rank_of_stage)
    bubble = plan.solver.get("bubble")
    return {
        "pipeline": f"{p.pp} ranks on axis pp, {stages} stages "
        f"({stages // p.pp} per rank), {len(p.layers)} layers cut at {list(p.stage_cuts)}",
        "schedule": p.schedule,
        "microbatches": f"{p.microbatches}{_microbatch_rows(plan)}",
        "stage boundary": p.boundary,
        "bubble": "(unknown)" if bubble is None else f"{100 * bubble:.1f}% (predicted)",
    }


def _microbatch_rows(plan: Plan) -> str:
    """The rows of one microbatch (the captured batch is one microbatch when pipelining)."""
    inputs = [t for t in plan.tensors if t.kind == "input" and t.shape]
    return f" × {inputs[0].shape[0]} rows" if inputs else ""


def step_text(plan: Plan) -> str:
    """The predicted step, what the program does with its collectives, and the ILP's bound."""
    c, bound = plan.comm, plan.solver.get("ilp_step_time_bound")
    if plan.pipeline is not None:
        how = _pipeline_step(plan)
    elif c is None:
        how = "collectives waited at once"
    else:
        buckets = (
            f"buckets {c.first_bucket_bytes / 2**20:g}/{c.bucket_bytes / 2**20:g} MiB"
            if c.bucket
            else "one collective per tensor"
        )
        how = f"{buckets}, {'overlapped' if c.overlap else 'waited at once'}"
    extra = "" if bound is None else f"; ILP bound {bound * 1e3:.3f} ms"
    return f"{plan.predicted_step_time * 1e3:.3f} ms (predicted: {how}{extra})"


def _pipeline_step(plan: Plan) -> str:
    """What a pipelined step is made of: the schedule over the microbatches, each stage's
    microbatch (forward + backward, as its programs run with the communication pass) and
    what the gradient reduction adds beyond the timeline: each stage's goes out at its
    last backward, under the rank's other work (`search.inter_op.PricedSchedule.info`)."""
    p, s = plan.pipeline, plan.solver
    overlap = "overlapped" if plan.comm is not None and plan.comm.overlap else "waited at once"
    text = f"{p.schedule} schedule over {p.microbatches} microbatches"
    times = s.get("stage_times")
    if times:
        ms = ", ".join(f"{t * 1e3:.3f}" for t in times)
        text += f"; stage microbatch fwd+bwd [{ms}] ms, collectives {overlap}"
    if s.get("bubble") is not None:
        text += f"; bubble {100 * s['bubble']:.1f}%"
    if s.get("gradient_sync") is not None:
        text += f"; gradient sync beyond the timeline {s['gradient_sync'] * 1e3:.3f} ms"
    return text


def _solver_text(s: dict) -> str:
    if not s:
        return "(no solver info)"
    return (
        f"{s.get('status')}, gap {s.get('gap', 0):.2g}, ILP {s.get('solve_time_s', 0):.2f}s "
        f"({s.get('ilp_decisions')} decisions of {s.get('decisions')}, {s.get('edges')} "
        f"edges), search {s.get('search_time_s', 0):.2f}s"
    )


def _distinct(specs: Iterable[str | None]) -> str:
    seen = list(dict.fromkeys(s for s in specs if s is not None))
    return "  ".join(seen) if seen else "—"


def node_table(plan: Plan, group: LayerGroup, produced: dict[str, Produced] | None) -> Table:
    table = Table(title=group.title, title_justify="left", title_style="bold")
    for col in ("node", "op", "input specs", "output"):
        table.add_column(col, overflow="fold")
    if produced is not None:
        table.add_column("collectives on inputs", overflow="fold")
    for n in group.nodes:
        out = _distinct(n.outputs)
        row = [n.name, n.op, _distinct(n.inputs), f"[yellow]{out}[/]" if "P" in out else out]
        if produced is not None:
            row.append("\n".join(f"{p}: {t}" for p, t in node_edges(plan, n, produced)))
        table.add_row(*row)
    return table


def param_table(
    plan: Plan, group: LayerGroup, produced: dict[str, Produced] | None
) -> Table | None:
    if not group.params:
        return None
    used = param_uses(plan, group, produced) if produced is not None else None
    table = Table(title=f"parameters of {group.title}", title_justify="left")
    for col in ("parameter", "shape", "dtype", "storage spec"):
        table.add_column(col, overflow="fold")
    if used is not None:
        table.add_column("to consumers", overflow="fold")
    for t in group.params:
        row = [
            relative_name(t.fqn, group.layers[0]),
            "×".join(map(str, t.shape)) or "()",
            t.dtype,
            t.spec,
        ]
        if used is not None:
            row.append("\n".join(used.get(t.name, [])) or "as stored")
        table.add_row(*row)
    return table


def _span(items: Sequence, sep: str = "..") -> str:
    if not items:
        return "—"
    return str(items[0]) if len(items) == 1 else f"{items[0]}{sep}{items[-1]}"


def stage_table(plan: Plan) -> Table:
    """One row per pipeline stage: where it runs and which layers it holds."""
    table = Table(title="pipeline stages", title_justify="left", title_style="bold")
    for col in ("stage", "pipeline rank", "devices", "layers", "count"):
        table.add_column(col, justify="right" if col in ("stage", "count") else "left")
    for st in describe(plan)["stages"]:
        table.add_row(
            str(st["stage"]),
            str(st["pipeline_rank"]),
            _span(st["devices"]),
            _span(st["layers"]),
            str(len(st["layers"])),
        )
    return table


def fusion_table(plan: Plan) -> Table:
    """How the planned graph was fused: one row per region swapped for one kernel call, or
    one row for the whole program when torch.compile (inductor) runs it."""
    table = Table(
        title=f"fused regions (fusion={plan.fusion})", title_justify="left", title_style="bold"
    )
    for col in ("kernel", "node", "replaced nodes"):
        table.add_column(col, overflow="fold")
    if plan.fusion == "inductor":
        table.add_row("inductor", "—", "every op of each rank's program (torch.compile)")
    for region in plan.fused_regions:
        table.add_row(region.kernel, region.node, ", ".join(region.replaced))
    return table


def render_plan(console: Console, plan: Plan) -> None:
    """Header, pipeline stages and timeline (if pipelined), fusion (if any), then per layer
    group the placements of every node (on a stage's mesh when pipelined)."""
    console.print(header_table(plan))
    if plan.pipeline is not None:
        console.print(stage_table(plan))
        console.print(f"[bold]timeline[/] ({plan.pipeline.schedule}: F/B/W stage.microbatch)")
        for line in timeline_lines(plan, max(console.width, 40)):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    if plan.fusion != "none":
        console.print(fusion_table(plan))
    produced = producers(plan) if has_edges(plan) else None
    if produced is None:
        console.print(
            "[dim]this plan does not link node inputs to their producers; "
            "showing placements only (no per-edge collectives)[/]"
        )
    for group in group_layers(plan):
        console.print(node_table(plan, group, produced))
        params = param_table(plan, group, produced)
        if params is not None:
            console.print(params)
