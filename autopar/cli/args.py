"""Parsing and checking the CLI's options; every mistake ends in `fail` (one line, exit 2).

The `Annotated` option types are shared by the commands in `autopar.cli.commands`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, NoReturn

import typer

from autopar.cli.sources import ModelSource, check_source, resolve_source
from autopar.cluster import PRESETS, Cluster, with_pipeline_axis
from autopar.devices import BACKENDS, choose_backend
from autopar.options import PlanOptions
from autopar.plan import SCHEDULES
from autopar.planning import searches_layout
from autopar.search.pins import ROLES

ERROR_DIR = "AUTOPAR_ERROR_DIR"  # where `autopar run`'s ranks write the error they stop on


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, no traceback."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def parse_model(text: str, config: str | None) -> ModelSource:
    """The model source, imported and checked against the protocol (before any search)."""
    try:
        source = resolve_source(text)
        check_source(source, config)
    except ValueError as exc:
        fail(str(exc))
    return source


def parse_mesh(text: str) -> tuple[int, ...]:
    """`8` -> (8,), `2x4` -> (2, 4)."""
    try:
        mesh = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        mesh = ()
    if not mesh or any(s <= 0 for s in mesh):
        fail(f"--mesh {text!r} is not a mesh: write positive sizes joined by 'x', e.g. 8 or 2x4")
    return mesh


def parse_backend(text: str | None, nproc: int, gpus: int | None = None) -> str:
    """`--backend` for `nproc` local processes (`autopar.devices.choose_backend`): without
    one NCCL when every process has a GPU, else gloo; nccl without enough GPUs fails."""
    try:
        return choose_backend(text, nproc, gpus)
    except ValueError as exc:
        fail(f"--backend: {exc}")


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


def parse_schedule(name: str | None) -> str | None:
    if name is not None and name not in SCHEDULES:
        fail(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}")
    return name


def make_cluster(preset: str, nodes: int, mesh: str | None, axis_names: str | None) -> Cluster:
    if preset.endswith(".json"):
        return _cluster_file(preset, nodes, mesh, axis_names)
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


def _cluster_file(path: str, nodes: int, mesh: str | None, axis_names: str | None) -> Cluster:
    """A cluster file (`autopar calibrate -o`, `Cluster.save`), re-meshed by `--mesh`."""
    if nodes != 1:
        fail(f"--nodes does not apply to a cluster file ({path}): it describes its machine")
    try:
        cluster = Cluster.load(path)
        if mesh:
            shape = parse_mesh(mesh)
            names = parse_names(axis_names) or tuple(f"axis{i}" for i in range(len(shape)))
            cluster = cluster.reshaped(shape, names)
        elif axis_names:
            cluster = cluster.reshaped(cluster.mesh_shape, parse_names(axis_names))
    except ValueError as exc:
        fail(str(exc))
    return cluster


@dataclass(frozen=True, slots=True)
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

    def worker_args(self) -> list[str]:
        """The same options for `autopar.cli.worker` (only those given)."""
        out = []
        for flag, value in (
            ("--pipeline-stages", self.pipeline_stages),
            ("--microbatches", self.microbatches),
            ("--schedule", self.schedule),
        ):
            if value is not None:
                out += [flag, str(value)]
        return out


@dataclass(frozen=True, slots=True)
class PrecisionArgs:
    """The memory levers: `--mixed-precision`, `--shard-optimizer`, `--shard-gradients`,
    `--activation-checkpointing`, as `autopar.plan` and `autopar.compile` take them."""

    mixed_precision: str | None = None
    shard_optimizer: bool = False
    shard_gradients: bool = False
    activation_checkpointing: str = "auto"

    def __post_init__(self) -> None:
        """Checked as `autopar.plan` checks them, before any search or process starts."""
        try:
            PlanOptions(**self.kwargs())
        except ValueError as exc:
            fail(str(exc))

    def kwargs(self) -> dict:
        return {
            "mixed_precision": self.mixed_precision,
            "shard_optimizer": self.shard_optimizer or self.shard_gradients,
            "shard_gradients": self.shard_gradients,
            "activation_checkpointing": self.activation_checkpointing,
        }

    def worker_args(self) -> list[str]:
        out = ["--mixed-precision", self.mixed_precision] if self.mixed_precision else []
        out += ["--shard-optimizer"] if self.shard_optimizer else []
        out += ["--activation-checkpointing", self.activation_checkpointing]
        return out + (["--shard-gradients"] if self.shard_gradients else [])


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
    searched_layout = searches_layout(PlanOptions(strategy=strategy), cluster)
    if pipe.pipeline_stages is not None:
        searched_layout = False
    if not (pipelined or searched_layout) and (
        pipe.microbatches is not None or pipe.schedule is not None
    ):
        fail(
            "--microbatches/--schedule need pipelining: pass --pipeline-stages N (N > 1), "
            "name the first mesh axis 'pp', or leave --mesh out (the layout is searched)"
        )
    if pipe.microbatches is not None and batch_size % pipe.microbatches:
        fail(
            f"--microbatches {pipe.microbatches} does not divide --batch-size {batch_size}; "
            "pick a divisor"
        )
    axes = [n for n in searched.axis_names if n != "pp"] if pipelined else list(cluster.axis_names)
    if isinstance(strategy, tuple) and len(strategy) != len(axes):
        where = (
            f"a pipeline stage has {len(axes)} ({','.join(axes)}): give one role per axis but 'pp'"
            if pipelined
            else f"the mesh has {len(axes)} axes"
        )
        fail(f"--strategy names {len(strategy)} axis roles but {where}")


# ---------------------------------------------------------------- options shared by commands
MODEL_HELP = (
    "the model: a sample of this checkout (gpt, llama, mlp), module:factory or "
    "path/to/file.py:factory (the factory returns the model; its module defines "
    "example_batch(model, batch_size))"
)
ModelArg = Annotated[str, typer.Argument(help=MODEL_HELP, metavar="MODEL")]
ConfigOpt = Annotated[
    str | None,
    typer.Option("--config", "-c", help="config name passed to the factory (samples: tiny)"),
]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-b", min=1, help="global batch size")]
ClusterOpt = Annotated[
    str,
    typer.Option(
        "--cluster", help="cluster preset (" + ", ".join(PRESETS) + ") or a cluster.json file"
    ),
]
NodesOpt = Annotated[int, typer.Option("--nodes", min=1, help="number of nodes")]
BackendOpt = Annotated[
    str | None,
    typer.Option(
        "--backend",
        help=f"collective backend: {'|'.join(BACKENDS)} (default nccl with a GPU per process, "
        "else gloo)",
    ),
]
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
        help="pipeline stages: splits the first mesh axis (or name that axis pp); 1: no "
        "pipeline. Default: searched with the layout when --mesh is left out",
    ),
]
MicrobatchesOpt = Annotated[
    int | None,
    typer.Option("--microbatches", min=1, help="pipeline microbatches (divides the batch)"),
]
MixedPrecisionOpt = Annotated[
    str | None,
    typer.Option(
        "--mixed-precision",
        help="bf16 or fp16: compute in that dtype, fp32 master weights and optimizer state",
    ),
]
ShardOptimizerOpt = Annotated[
    bool, typer.Option("--shard-optimizer", help="ZeRO-1: shard master and optimizer state")
]
ShardGradientsOpt = Annotated[
    bool, typer.Option("--shard-gradients", help="ZeRO-2: shard the gradients too")
]
CheckpointingOpt = Annotated[
    str,
    typer.Option(
        "--activation-checkpointing",
        help="auto (searched per layer), none, selective or full",
    ),
]
ScheduleOpt = Annotated[
    str | None,
    typer.Option("--schedule", help="pipeline schedule: " + ", ".join(SCHEDULES)),
]
