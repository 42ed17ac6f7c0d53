"""The `autopar` command line: plan | inspect | run | bench.

    autopar plan gpt --config gpt2-124m --cluster dgx-h100 --nodes 2 -o plan.json
    autopar inspect plan.json
    autopar plan gpt --config tiny4 --cluster cpu --mesh 2x2 --axis-names pp,dp --schedule 1f1b
    autopar run gpt --nproc 4 --mesh 2x2 --axis-names dp,tp --steps 5
    autopar bench gpt --config gpt2-1.5b --cluster dgx-h100 --nodes 1 --csv bench.csv

Pipelining: name the first mesh axis `pp` or pass `--pipeline-stages N` (which splits the
first axis); `--microbatches` and `--schedule` pin what the search would choose.

Bad input (unknown sample, config, preset, strategy, schedule, a malformed mesh) ends with
one line `error: ...` on stderr and exit code 2; a search that fails ends with `error: ...`
and 1.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, NoReturn

import torch
import typer
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.distributed.tensor import Replicate

from autopar.cluster import PRESETS, Cluster, with_pipeline_axis
from autopar.cost_models.comm import Collective, redistribute_plan, transition_kind
from autopar.cost_models.memory import local_numel
from autopar.plan import SCHEDULES, NodePlan, Plan, TensorPlan, parse_spec
from autopar.plan_views import axis_roles, describe
from autopar.search.pins import ROLES

app = typer.Typer(
    name="autopar",
    help="Compiler-driven auto-parallelizer for PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

BENCH_STRATEGIES = ("auto", "dp", "fsdp", "tp")
OUTSIDE = "(outside layers)"
_GiB = 2**30


# ---------------------------------------------------------------- argument parsing
def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def parse_mesh(text: str) -> tuple[int, ...]:
    """`8` -> (8,), `2x4` -> (2, 4)."""
    try:
        mesh = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        mesh = ()
    if not mesh or any(s <= 0 for s in mesh):
        fail(f"--mesh {text!r} is not a mesh: write positive sizes joined by 'x', e.g. 8 or 2x4")
    return mesh


def parse_names(text: str | None) -> tuple[str, ...] | None:
    return None if text is None else tuple(s.strip() for s in text.split(","))


def parse_strategy(text: str) -> str | tuple[str, ...]:
    """`auto` -> "auto"; `dp,tp` -> ("dp", "tp") (one role per mesh axis)."""
    roles = tuple(r.strip() for r in text.split(","))
    bad = [r for r in roles if r not in ROLES]
    if bad:
        fail(
            f"unknown strategy {', '.join(bad)!s}; choose from {', '.join(ROLES)} "
            "(one for every axis, or one per axis joined by ',')"
        )
    return roles[0] if len(roles) == 1 else roles


def check_strategy(strategy: str | tuple[str, ...], ndim: int) -> None:
    if isinstance(strategy, tuple) and len(strategy) != ndim:
        fail(f"--strategy names {len(strategy)} axis roles but the mesh has {ndim} axes")


@dataclass(frozen=True)
class PipelineArgs:
    """`--pipeline-stages`, `--microbatches`, `--schedule`, as `autopar.plan` takes them."""

    pipeline_stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None

    def kwargs(self) -> dict:
        return {
            "pipeline_stages": self.pipeline_stages,
            "microbatches": self.microbatches,
            "schedule": self.schedule,
        }

    def launch_args(self) -> list[str]:
        """The same options for `autopar.runtime.launch` (only those given)."""
        out = []
        for flag, value in (
            ("--pipeline-stages", self.pipeline_stages),
            ("--microbatches", self.microbatches),
            ("--schedule", self.schedule),
        ):
            if value is not None:
                out += [flag, str(value)]
        return out


def parse_schedule(name: str | None) -> str | None:
    if name is not None and name not in SCHEDULES:
        fail(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    return name


def check_pipeline(
    cluster: Cluster, pipe: PipelineArgs, strategy: str | tuple[str, ...], batch_size: int
) -> None:
    """The pipeline options against the mesh; the strategy names one role per STAGE axis
    (the mesh without its "pp" axis) when pipelining."""
    try:
        searched = with_pipeline_axis(cluster, pipe.pipeline_stages)
    except ValueError as exc:
        fail(str(exc).replace("pipeline_stages=", "--pipeline-stages "))
    pipelined = "pp" in searched.axis_names
    if not pipelined and (pipe.microbatches is not None or pipe.schedule is not None):
        fail(
            "--microbatches/--schedule need pipelining: pass --pipeline-stages N (N > 1) "
            "or name the first mesh axis 'pp'"
        )
    if pipe.microbatches is not None and batch_size % pipe.microbatches:
        fail(
            f"--microbatches {pipe.microbatches} does not divide --batch-size {batch_size}; "
            "pick a divisor"
        )
    stage_axes = [n for n in searched.axis_names if n != "pp"] if pipelined else None
    if isinstance(strategy, tuple) and stage_axes is not None and len(strategy) != len(stage_axes):
        fail(
            f"--strategy names {len(strategy)} axis roles but a pipeline stage has "
            f"{len(stage_axes)} ({','.join(stage_axes)}): give one role per axis but 'pp'"
        )
    if stage_axes is None:
        check_strategy(strategy, cluster.ndim)


def load_sample(name: str, config: str):
    """The sample `name` (from `samples`), after checking it has `config`."""
    from samples import SAMPLES

    if name not in SAMPLES:
        fail(f"unknown sample {name!r}; known samples: {', '.join(sorted(SAMPLES))}")
    sample = SAMPLES[name]
    if config not in sample.configs:
        fail(f"unknown config {config!r} for sample {name!r}; known: {', '.join(sample.configs)}")
    return sample


def make_cluster(preset: str, nodes: int, mesh: str | None, axis_names: str | None) -> Cluster:
    if preset not in PRESETS:
        fail(f"unknown cluster preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}")
    try:
        return Cluster.preset(
            preset,
            nodes=nodes,
            mesh=parse_mesh(mesh) if mesh else None,
            axis_names=parse_names(axis_names),
        )
    except ValueError as exc:
        fail(str(exc))


def build_model_and_batch(
    sample, config: str, batch_size: int
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Tiny configs are built for real; others on the meta device (no memory)."""
    device = None if config.startswith("tiny") else "meta"
    torch.manual_seed(0)
    model = sample.build(config, device=device)
    return model, tuple(sample.example_batch(model, batch_size, seed=0, device=device))


def search(
    sample_name: str,
    config: str,
    batch_size: int,
    cluster: Cluster,
    strategy: str | tuple[str, ...],
    time_limit: float,
    pipeline: PipelineArgs | None = None,
) -> Plan:
    """`autopar.plan` on the sample; raises what the search raises."""
    from autopar.api import plan as plan_api

    sample = load_sample(sample_name, config)
    model, batch = build_model_and_batch(sample, config, batch_size)
    return plan_api(
        model,
        batch,
        cluster=cluster,
        strategy=strategy,
        time_limit_s=time_limit,
        **(pipeline or PipelineArgs()).kwargs(),
    )


# ---------------------------------------------------------------- options shared by commands
SampleArg = Annotated[str, typer.Argument(help="sample model: gpt, llama, mlp")]
ConfigOpt = Annotated[str, typer.Option("--config", "-c", help="sample config")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="global batch size")]
ClusterOpt = Annotated[str, typer.Option("--cluster", help="cluster preset: " + ", ".join(PRESETS))]
NodesOpt = Annotated[int, typer.Option("--nodes", min=1, help="number of nodes")]
MeshOpt = Annotated[str | None, typer.Option("--mesh", help="mesh shape, e.g. 8 or 2x4")]
NamesOpt = Annotated[str | None, typer.Option("--axis-names", help="e.g. node,gpu")]
StrategyOpt = Annotated[
    str, typer.Option("--strategy", "-s", help="auto|dp|fsdp|tp, or per axis: dp,tp")
]
TimeOpt = Annotated[float, typer.Option("--time-limit", help="ILP time limit (s)")]
StagesOpt = Annotated[
    int | None,
    typer.Option(
        "--pipeline-stages",
        min=1,
        help="pipeline stages: splits the first mesh axis (or name that axis pp)",
    ),
]
MicrobatchesOpt = Annotated[
    int | None,
    typer.Option("--microbatches", min=1, help="pipeline microbatches (divides the batch)"),
]
ScheduleOpt = Annotated[
    str | None,
    typer.Option("--schedule", help="pipeline schedule: " + ", ".join(SCHEDULES)),
]


@app.command("plan")
def plan_cmd(
    sample: SampleArg,
    config: ConfigOpt = "tiny",
    batch_size: BatchOpt = 8,
    cluster: ClusterOpt = "dgx-h100",
    nodes: NodesOpt = 1,
    mesh: MeshOpt = None,
    axis_names: NamesOpt = None,
    strategy: StrategyOpt = "auto",
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="write the plan JSON")
    ] = None,
    time_limit: TimeOpt = 30.0,
    pipeline_stages: StagesOpt = None,
    microbatches: MicrobatchesOpt = None,
    schedule: ScheduleOpt = None,
) -> None:
    """Search a plan for SAMPLE on a cluster preset (no processes, no weights)."""
    load_sample(sample, config)
    roles = parse_strategy(strategy)
    pipe = PipelineArgs(pipeline_stages, microbatches, parse_schedule(schedule))
    the_cluster = make_cluster(cluster, nodes, mesh, axis_names)
    check_pipeline(the_cluster, pipe, roles, batch_size)
    try:
        result = search(sample, config, batch_size, the_cluster, roles, time_limit, pipe)
    except Exception as exc:  # the search's errors are messages for the user
        fail(f"planning failed: {exc}", code=1)
    typer.echo(result.summary())
    if output is not None:
        result.save(output)
        typer.echo(f"wrote {output}")


# ---------------------------------------------------------------- inspect
@dataclass(frozen=True)
class LayerGroup:
    """Layers with identical plans: the first one's nodes and parameters stand for all."""

    layers: tuple[str | None, ...]
    nodes: tuple[NodePlan, ...]
    params: tuple[TensorPlan, ...]

    @property
    def title(self) -> str:
        first = self.layers[0]
        if first is None:
            return OUTSIDE
        if len(self.layers) == 1:
            return f"layer {first}"
        return f"layer {first}  ×{len(self.layers)} identical: {_compact(self.layers)}"


def _compact(names: Sequence[str | None], keep: int = 3) -> str:
    shown = [str(n) for n in names]
    if len(shown) <= keep + 1:
        return ", ".join(shown)
    return ", ".join(shown[:keep]) + f", …, {shown[-1]}"


def _layer_of_param(fqn: str, layers: Iterable[str]) -> str | None:
    owners = [lay for lay in layers if fqn.startswith(lay + ".")]
    return max(owners, key=len) if owners else None


def _relative(fqn: str, layer: str | None) -> str:
    return fqn if layer is None else fqn[len(layer) + 1 :]


def group_layers(plan: Plan) -> list[LayerGroup]:
    """Nodes grouped by `NodePlan.layer` (in graph order); identical layers collapsed."""
    nodes: dict[str | None, list[NodePlan]] = {}
    for n in plan.nodes:
        nodes.setdefault(n.layer, []).append(n)
    layers = [lay for lay in nodes if lay is not None]
    params: dict[str | None, list[TensorPlan]] = {lay: [] for lay in nodes}
    for t in plan.tensors:
        if t.kind == "param":
            params.setdefault(_layer_of_param(t.fqn, layers), []).append(t)
    same: dict[tuple, list[str | None]] = {}
    for lay in params:
        sig = (OUTSIDE,) if lay is None else _signature(nodes.get(lay, []), params[lay], lay)
        same.setdefault(sig, []).append(lay)
    return [
        LayerGroup(tuple(group), tuple(nodes.get(group[0], [])), tuple(params[group[0]]))
        for group in same.values()
    ]


def _signature(nodes: Sequence[NodePlan], params: Sequence[TensorPlan], layer: str) -> tuple:
    return (
        tuple((n.op, n.inputs, n.outputs) for n in nodes),
        tuple((_relative(t.fqn, layer), t.spec, t.shape, t.dtype) for t in params),
    )


def fmt_bytes(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def edge_collectives(
    src: str,
    dst: str,
    shape: Sequence[int] | None,
    dtype: str | None,
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
) -> str:
    """`S(0)→R all_gather@gpu 1.5 MiB`: the steps DTensor takes from `src` to `dst`.

    Bytes per step are those of the tensor unsharded over that step's axis (the cost model's
    convention); they are left out when `shape` is unknown.
    """
    parts = []
    itemsize = getattr(torch, dtype).itemsize if dtype else 0
    for axis, before, cur, tgt in redistribute_plan(parse_spec(src), parse_spec(dst), mesh_shape):
        kind = transition_kind(cur, tgt)
        if kind is None:
            return f"{src}→{dst} unsupported"
        if kind is Collective.LOCAL:
            continue
        text = f"{kind}@{axis_names[axis]}"
        if shape is not None and itemsize:
            full = list(before)
            full[axis] = Replicate()
            text += f" {fmt_bytes(local_numel(shape, full, mesh_shape) * itemsize)}"
        parts.append(text)
    return f"{src}→{dst} " + (", ".join(parts) or "local")


@dataclass(frozen=True)
class _Produced:
    spec: str | None
    shape: tuple[int, ...] | None
    dtype: str | None


def _producers(plan: Plan) -> dict[str, _Produced]:
    """Output of every node (`name`, `name[k]`) and every placeholder, by name."""
    out = {t.name: _Produced(t.spec, t.shape, t.dtype) for t in plan.tensors}
    for n in plan.nodes:
        shapes = getattr(n, "shapes", None) or (None,) * len(n.outputs)
        dtypes = getattr(n, "dtypes", None) or (None,) * len(n.outputs)
        for k, (spec, shape, dtype) in enumerate(zip(n.outputs, shapes, dtypes, strict=False)):
            item = _Produced(spec, tuple(shape) if shape else None, dtype)
            out[f"{n.name}[{k}]"] = item
            if k == 0:
                out[n.name] = item
    return out


def has_edges(plan: Plan) -> bool:
    """Plans connect a node's inputs to their producers only with a `NodePlan.args` field."""
    return any(getattr(n, "args", None) for n in plan.nodes)


def node_edges(plan: Plan, node: NodePlan, produced: dict[str, _Produced]) -> list[tuple[str, str]]:
    """(producer, collective text) per input edge whose placement changes."""
    out = []
    for producer, dst in zip(getattr(node, "args", None) or (), node.inputs, strict=False):
        src = produced.get(producer) if producer else None
        if src is None or src.spec is None or dst is None or src.spec == dst:
            continue
        text = edge_collectives(
            src.spec, dst, src.shape, src.dtype, plan.stage_mesh_shape, plan.stage_axis_names
        )
        out.append((producer, text))
    return out


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
        "graph": plan.graph_fingerprint,
        "devices": f"{cluster.world_size} × {cluster.device.name} ({cluster.backend})",
        "mesh": _mesh_text(plan.axis_names, plan.mesh_shape),
        **(
            {"stage mesh": _mesh_text(plan.stage_axis_names, plan.stage_mesh_shape)}
            if plan.pipeline is not None
            else {}
        ),
        "axis roles": ", ".join(
            f"{n}={r}" for n, r in zip(plan.stage_axis_names, roles, strict=True)
        ),
        "links": ", ".join(
            f"{n}: {lk}" for n, lk in zip(plan.axis_names, cluster.links, strict=True)
        ),
        "step time": f"{plan.predicted_step_time * 1e3:.3f} ms (predicted)",
        "peak memory": f"{fmt_bytes(peak)} per device (predicted, "
        f"{100 * peak / cluster.device.memory_bytes:.1f}% of "
        f"{cluster.device.memory_bytes / _GiB:.0f} GiB)",
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
        "bubble": "(unknown)" if bubble is None else f"{100 * bubble:.1f}% (predicted)",
    }


def _microbatch_rows(plan: Plan) -> str:
    """The rows of one microbatch (the captured batch is one microbatch when pipelining)."""
    inputs = [t for t in plan.tensors if t.kind == "input" and t.shape]
    return f" × {inputs[0].shape[0]} rows" if inputs else ""


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


def node_table(plan: Plan, group: LayerGroup, produced: dict[str, _Produced] | None) -> Table:
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
    plan: Plan, group: LayerGroup, produced: dict[str, _Produced] | None
) -> Table | None:
    if not group.params:
        return None
    used = _param_uses(plan, group, produced) if produced is not None else None
    table = Table(title=f"parameters of {group.title}", title_justify="left")
    for col in ("parameter", "shape", "dtype", "storage spec"):
        table.add_column(col, overflow="fold")
    if used is not None:
        table.add_column("to consumers", overflow="fold")
    for t in group.params:
        row = [
            _relative(t.fqn, group.layers[0]),
            "×".join(map(str, t.shape)) or "()",
            t.dtype,
            t.spec,
        ]
        if used is not None:
            row.append("\n".join(used.get(t.name, [])) or "as stored")
        table.add_row(*row)
    return table


def _param_uses(
    plan: Plan, group: LayerGroup, produced: dict[str, _Produced]
) -> dict[str, list[str]]:
    """Per parameter, the distinct collectives that bring it to its consumers' specs."""
    names = {t.name for t in group.params}
    uses: dict[str, list[str]] = {}
    for n in plan.nodes:
        for producer, text in node_edges(plan, n, produced):
            if producer in names and text not in uses.setdefault(producer, []):
                uses[producer].append(text)
    return uses


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


def fusion_table(plan: Plan) -> Table:
    """Regions the fusion pass swapped for one kernel call each."""
    table = Table(title="fused regions (one kernel call each)")
    for col in ("kernel", "node", "replaced nodes"):
        table.add_column(col)
    for region in plan.fusion:
        replaced = ", ".join(region["replaced"])
        if region["kernel"] == "inductor":  # the whole program, no rewritten region
            replaced = "every op of each rank's program (torch.compile)"
        table.add_row(region["kernel"], region["node"], replaced)
    return table


@app.command("inspect")
def inspect_cmd(
    plan_file: Annotated[Path, typer.Argument(help="a plan JSON written by `autopar plan -o`")],
) -> None:
    """Show a saved plan: header, pipeline stages and timeline (if pipelined), then per
    layer group the placements of every node (on a stage's mesh when pipelined)."""
    try:
        plan = Plan.load(plan_file)
    except FileNotFoundError:
        fail(f"no such plan file: {plan_file}")
    except (ValueError, KeyError, TypeError) as exc:
        fail(f"{plan_file} is not an autopar plan: {exc}")
    console = Console()
    console.print(header_table(plan))
    if plan.pipeline is not None:
        console.print(stage_table(plan))
        console.print(f"[bold]timeline[/] ({plan.pipeline.schedule}: F/B/W stage.microbatch)")
        for line in timeline_lines(plan, max(console.width, 40)):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
    if plan.fusion:
        console.print(fusion_table(plan))
    produced = _producers(plan) if has_edges(plan) else None
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


# ---------------------------------------------------------------- run
def default_axis_names(ndim: int) -> tuple[str, ...]:
    return ("dp", "tp") if ndim == 2 else tuple(f"axis{i}" for i in range(ndim))


def launch_command(nproc: int, launch_args: Sequence[str]) -> list[str]:
    """torchrun on this interpreter. `--standalone` rendezvouses on `localhost:0`: the OS
    picks a free port, so concurrent runs never collide."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "autopar.runtime.launch",
        *launch_args,
    ]


@app.command("run")
def run_cmd(
    sample: SampleArg,
    nproc: Annotated[int, typer.Option("--nproc", min=1, help="processes (= mesh size)")] = 4,
    mesh: Annotated[str, typer.Option("--mesh", help="mesh shape, e.g. 2x2")] = "2x2",
    axis_names: NamesOpt = None,
    strategy: StrategyOpt = "auto",
    steps: Annotated[int, typer.Option("--steps", min=1)] = 5,
    config: ConfigOpt = "tiny",
    batch_size: BatchOpt = 8,
    plan: Annotated[
        Path | None, typer.Option("--plan", help="apply this saved plan instead of searching")
    ] = None,
    pipeline_stages: StagesOpt = None,
    microbatches: MicrobatchesOpt = None,
    schedule: ScheduleOpt = None,
) -> None:
    """Train SAMPLE on NPROC local gloo processes and compare with single-device training."""
    load_sample(sample, config)
    shape = parse_mesh(mesh)
    names = parse_names(axis_names) or default_axis_names(len(shape))
    if math.prod(shape) != nproc:
        fail(f"--mesh {mesh} has {math.prod(shape)} devices but --nproc is {nproc}")
    if len(names) != len(shape):
        fail(f"--axis-names {','.join(names)} names {len(names)} axes; the mesh has {len(shape)}")
    pipe = PipelineArgs(pipeline_stages, microbatches, parse_schedule(schedule))
    check_pipeline(
        make_cluster("cpu", 1, mesh, ",".join(names)), pipe, parse_strategy(strategy), batch_size
    )
    args = [
        "--sample",
        sample,
        "--config",
        config,
        "--batch-size",
        str(batch_size),
        "--mesh",
        mesh,
        "--axis-names",
        ",".join(names),
        "--strategy",
        strategy,
        "--steps",
        str(steps),
        *pipe.launch_args(),
    ]
    if plan is not None:
        if not plan.is_file():
            fail(f"--plan {plan}: no such file")
        args += ["--plan", str(plan.resolve())]
    with tempfile.TemporaryDirectory(prefix="autopar-run-") as tmp:
        env = {
            **os.environ,
            "TMPDIR": tmp,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        sys.stdout.flush()
        rc = subprocess.run(launch_command(nproc, args), env=env, check=False).returncode
    if rc != 0:
        typer.echo(f"error: autopar run failed (torchrun exit code {rc})", err=True)
        raise typer.Exit(rc)


# ---------------------------------------------------------------- bench
@dataclass(frozen=True)
class BenchRow:
    strategy: str
    roles: str = ""
    step_time: float = math.nan
    peak_memory: float = math.nan
    error: str = ""


def bench_one(
    sample: str, config: str, batch_size: int, cluster: Cluster, strategy: str, time_limit: float
) -> BenchRow:
    try:
        plan = search(sample, config, batch_size, cluster, strategy, time_limit)
    except Exception as exc:  # a strategy that does not fit is a row, not a crash
        return BenchRow(strategy, error=" ".join(str(exc).split()) or type(exc).__name__)
    roles = ", ".join(
        f"{n}={r}" for n, r in zip(plan.stage_axis_names, axis_roles(plan), strict=True)
    )
    return BenchRow(strategy, roles, plan.predicted_step_time, plan.predicted_peak_memory)


def bench_table(rows: Sequence[BenchRow], base: float, title: str) -> Table:
    table = Table(title=title)
    for col in ("strategy", "axis roles", "step time (ms)", "peak memory/device", "vs auto"):
        table.add_column(col, justify="left" if col in ("strategy", "axis roles") else "right")
    for r in rows:
        if r.error:
            continue
        ratio = r.step_time / base if base > 0 else math.nan
        table.add_row(
            r.strategy,
            r.roles,
            f"{r.step_time * 1e3:.3f}",
            fmt_bytes(r.peak_memory),
            f"{ratio:.2f}×",
        )
    return table


def write_bench_csv(path: Path, rows: Sequence[BenchRow], base: float) -> None:
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(
            [
                "strategy",
                "axis_roles",
                "predicted_step_time_s",
                "predicted_peak_memory_bytes",
                "ratio_vs_auto",
                "error",
            ]
        )
        for r in rows:
            ratio = r.step_time / base if base > 0 and not r.error else math.nan
            out.writerow(
                [
                    r.strategy,
                    r.roles,
                    "" if r.error else r.step_time,
                    "" if r.error else r.peak_memory,
                    "" if math.isnan(ratio) else ratio,
                    r.error,
                ]
            )


@app.command("bench")
def bench_cmd(
    sample: SampleArg,
    config: ConfigOpt = "tiny",
    batch_size: BatchOpt = 8,
    cluster: ClusterOpt = "dgx-h100",
    nodes: NodesOpt = 1,
    mesh: MeshOpt = None,
    axis_names: NamesOpt = None,
    csv_path: Annotated[Path | None, typer.Option("--csv", help="also write a CSV")] = None,
    time_limit: TimeOpt = 30.0,
) -> None:
    """Plan SAMPLE with each of auto, dp, fsdp, tp and compare the predictions."""
    load_sample(sample, config)
    the_cluster = make_cluster(cluster, nodes, mesh, axis_names)
    rows = []
    for strategy in BENCH_STRATEGIES:
        row = bench_one(sample, config, batch_size, the_cluster, strategy, time_limit)
        if row.error:
            typer.echo(f"skip {strategy}: {row.error}")
        rows.append(row)
    auto = rows[0]
    base = math.nan if auto.error else auto.step_time
    Console().print(
        bench_table(rows, base, f"{sample} {config} batch {batch_size} on {the_cluster}")
    )
    if csv_path is not None:
        write_bench_csv(csv_path, rows, base)
        typer.echo(f"wrote {csv_path}")


def main() -> None:
    """Console entry point (`autopar`, `python -m autopar`)."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    app()
