"""The `autopar` commands. Each parses its options (`autopar.cli.args`), calls the API or a
view (`autopar.views`) and prints; nothing here renders a plan or plans one itself."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from autopar.cli.args import (
    ERROR_DIR,
    BackendOpt,
    BatchOpt,
    CheckpointingOpt,
    ClusterOpt,
    ConfigOpt,
    MeshOpt,
    MicrobatchesOpt,
    MixedPrecisionOpt,
    ModelArg,
    NamesOpt,
    NodesOpt,
    PipelineArgs,
    PrecisionArgs,
    ScheduleOpt,
    ShardGradientsOpt,
    ShardOptimizerOpt,
    StagesOpt,
    StrategyOpt,
    TimeOpt,
    check_pipeline,
    fail,
    make_cluster,
    parse_backend,
    parse_mesh,
    parse_model,
    parse_names,
    parse_schedule,
    parse_strategy,
)
from autopar.cli.progress import search_progress
from autopar.cli.sources import ModelSource, load_model
from autopar.cluster import Cluster
from autopar.plan import Plan
from autopar.views import BenchRow, bench_table, render_plan, summary, write_bench_csv

app = typer.Typer(
    name="autopar",
    help="Compiler-driven auto-parallelizer for PyTorch training.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # a docstring's line breaks joined, as one paragraph
)

BENCH_STRATEGIES = ("auto", "dp", "fsdp", "tp")


def search(
    source: ModelSource,
    config: str | None,
    batch_size: int,
    cluster: Cluster,
    strategy: str | tuple[str, ...],
    time_limit: float,
    pipeline: PipelineArgs | None = None,
    precision: PrecisionArgs | None = None,
) -> Plan:
    """`autopar.plan` on the model built on the meta device; raises what the search raises."""
    from autopar.api import plan as plan_api

    model, batch = load_model(source, config, batch_size, meta=True)
    return plan_api(
        model,
        batch,
        cluster=cluster,
        strategy=strategy,
        time_limit_s=time_limit,
        **(pipeline or PipelineArgs()).kwargs(),
        **(precision or PrecisionArgs()).kwargs(),
    )


@app.command("plan")
def plan_cmd(
    model: ModelArg,
    config: ConfigOpt = None,
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
    mixed_precision: MixedPrecisionOpt = None,
    shard_optimizer: ShardOptimizerOpt = False,
    shard_gradients: ShardGradientsOpt = False,
    activation_checkpointing: CheckpointingOpt = "auto",
    profile: Annotated[
        bool, typer.Option("--profile", help="print the seconds each search phase took")
    ] = False,
    progress: Annotated[
        bool | None,
        typer.Option(
            "--progress/--no-progress",
            help="show the search's progress on stderr (default: when it is a terminal)",
        ),
    ] = None,
) -> None:
    """Search a plan for MODEL on a cluster preset (no processes; built on the meta device)."""
    source = parse_model(model, config)
    roles = parse_strategy(strategy)
    pipe = PipelineArgs(pipeline_stages, microbatches, parse_schedule(schedule))
    the_cluster = make_cluster(cluster, nodes, mesh, axis_names)
    check_pipeline(the_cluster, pipe, roles, batch_size)
    precision = PrecisionArgs(
        mixed_precision, shard_optimizer, shard_gradients, activation_checkpointing
    )
    try:
        with search_progress(progress, profile):
            result = search(
                source, config, batch_size, the_cluster, roles, time_limit, pipe, precision
            )
    except Exception as exc:  # the search's errors are messages for the user
        fail(f"planning failed: {exc}", code=1)
    typer.echo(summary(result))
    if output is not None:
        result.save(output)
        typer.echo(f"wrote {output}")


@app.command("inspect")
def inspect_cmd(
    plan_file: Annotated[Path, typer.Argument(help="a plan JSON written by `autopar plan -o`")],
) -> None:
    """Show a saved plan: header, pipeline stages and timeline, fusion, and the placements
    of every node and parameter, layer group by layer group."""
    try:
        plan = Plan.load(plan_file)
    except FileNotFoundError:
        fail(f"no such plan file: {plan_file}")
    except (ValueError, KeyError, TypeError) as exc:
        fail(f"{plan_file} is not an autopar plan: {exc}")
    render_plan(_console(), plan)


# a plan's tables written to a file or a pager: as wide as their specs and collectives
# need (rich would take 80 columns and fold `S(1),S(0)` mid-token)
PIPED_WIDTH = 160


def _console() -> Console:
    """The terminal's width on a terminal, `PIPED_WIDTH` where the output is not one."""
    return Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)


def default_axis_names(ndim: int) -> tuple[str, ...]:
    return ("dp", "tp") if ndim == 2 else tuple(f"axis{i}" for i in range(ndim))


def launch_command(nproc: int, worker_args: Sequence[str]) -> list[str]:
    """torchrun on this interpreter (`autopar.cli.launch`: its failure report one line).
    `--standalone` rendezvouses on `localhost:0`: the OS picks a free port, so concurrent
    runs never collide."""
    return [
        sys.executable,
        "-m",
        "autopar.cli.launch",
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "autopar.cli.worker",
        *worker_args,
    ]


@app.command("run")
def run_cmd(
    model: ModelArg,
    nproc: Annotated[int, typer.Option("--nproc", min=1, help="processes (= mesh size)")] = 4,
    mesh: Annotated[str, typer.Option("--mesh", help="mesh shape, e.g. 2x2")] = "2x2",
    axis_names: NamesOpt = None,
    strategy: StrategyOpt = "auto",
    steps: Annotated[int, typer.Option("--steps", min=1)] = 5,
    config: ConfigOpt = None,
    batch_size: BatchOpt = 8,
    plan: Annotated[
        Path | None, typer.Option("--plan", help="apply this saved plan instead of searching")
    ] = None,
    pipeline_stages: StagesOpt = None,
    microbatches: MicrobatchesOpt = None,
    schedule: ScheduleOpt = None,
    mixed_precision: MixedPrecisionOpt = None,
    shard_optimizer: ShardOptimizerOpt = False,
    shard_gradients: ShardGradientsOpt = False,
    activation_checkpointing: CheckpointingOpt = "auto",
    backend: BackendOpt = None,
) -> None:
    """Train MODEL on NPROC local processes (one per GPU under NCCL, CPU under gloo) and
    compare with single-device training."""
    source = parse_model(model, config)
    shape = parse_mesh(mesh)
    names = parse_names(axis_names) or default_axis_names(len(shape))
    if math.prod(shape) != nproc:
        fail(f"--mesh {mesh} has {math.prod(shape)} devices but --nproc is {nproc}")
    if len(names) != len(shape):
        fail(f"--axis-names {','.join(names)} names {len(names)} axes; the mesh has {len(shape)}")
    pipe = PipelineArgs(pipeline_stages, microbatches, parse_schedule(schedule))
    # only the mesh's shape is checked here: the preset's device and links do not matter
    check_pipeline(
        make_cluster("cpu", 1, mesh, ",".join(names)), pipe, parse_strategy(strategy), batch_size
    )
    args = ["--model", source.spec, "--batch-size", str(batch_size), "--mesh", mesh]
    args += ["--axis-names", ",".join(names), "--strategy", strategy, "--steps", str(steps)]
    args += ["--backend", parse_backend(backend, nproc)]
    args += [*(["--config", config] if config is not None else []), *pipe.worker_args()]
    args += PrecisionArgs(
        mixed_precision, shard_optimizer, shard_gradients, activation_checkpointing
    ).worker_args()
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
        errors = Path(tmp, "errors")
        errors.mkdir()
        env[ERROR_DIR] = str(errors)
        sys.stdout.flush()
        rc = subprocess.run(launch_command(nproc, args), env=env, check=False).returncode
        stopped_on = rank_errors(errors)
    if rc != 0:
        if stopped_on:  # the ranks' own words (`worker.report`), once for all that said them
            fail(stopped_on, code=rc)
        typer.echo(f"error: autopar run failed (torchrun exit code {rc})", err=True)
        raise typer.Exit(rc)


def rank_errors(folder: Path) -> str:
    """The errors the ranks stopped on (`autopar.cli.worker.report`), each once with the
    ranks that raised it; "" where none wrote one."""
    by_message: dict[str, list[int]] = {}
    for f in sorted(folder.glob("rank*.txt"), key=lambda f: int(f.stem[4:])):
        by_message.setdefault(f.read_text(), []).append(int(f.stem[4:]))
    return "\n".join(
        f"ranks {', '.join(map(str, ranks))}: {message}" if len(by_message) > 1 else message
        for message, ranks in by_message.items()
    )


def bench_one(
    source: ModelSource,
    config: str | None,
    batch_size: int,
    cluster: Cluster,
    strategy: str,
    time_limit: float,
) -> BenchRow:
    try:
        plan = search(source, config, batch_size, cluster, strategy, time_limit)
    except Exception as exc:  # a strategy that does not fit is a row, not a crash
        return BenchRow(strategy, error=" ".join(str(exc).split()) or type(exc).__name__)
    return BenchRow.of(strategy, plan)


@app.command("bench")
def bench_cmd(
    model: ModelArg,
    config: ConfigOpt = None,
    batch_size: BatchOpt = 8,
    cluster: ClusterOpt = "dgx-h100",
    nodes: NodesOpt = 1,
    mesh: MeshOpt = None,
    axis_names: NamesOpt = None,
    csv_path: Annotated[Path | None, typer.Option("--csv", help="also write a CSV")] = None,
    time_limit: TimeOpt = 30.0,
) -> None:
    """Plan MODEL with each of auto, dp, fsdp, tp and compare the predictions."""
    source = parse_model(model, config)
    the_cluster = make_cluster(cluster, nodes, mesh, axis_names)
    rows = []
    for strategy in BENCH_STRATEGIES:
        row = bench_one(source, config, batch_size, the_cluster, strategy, time_limit)
        if row.error:
            typer.echo(f"skip {strategy}: {row.error}")
        rows.append(row)
    auto = rows[0]
    base = math.nan if auto.error else auto.step_time
    title = f"{model}{f' {config}' if config else ''} batch {batch_size} on {the_cluster}"
    _console().print(bench_table(rows, base, title))
    if csv_path is not None:
        write_bench_csv(csv_path, rows, base)
        typer.echo(f"wrote {csv_path}")


@app.command("calibrate")
def calibrate_cmd(
    nproc: Annotated[int, typer.Option("--nproc", min=1, help="local processes")] = 4,
    output: Annotated[Path, typer.Option("--output", "-o", help="cluster file to write")] = Path(
        "cluster.json"
    ),
    mesh: MeshOpt = None,
    axis_names: NamesOpt = None,
    backend: BackendOpt = None,
    sizes: Annotated[
        str | None, typer.Option("--sizes", help="tiny|quick|gpu (default: by device)")
    ] = None,
) -> None:
    """Measure this machine (matmul, memory-bound ops, elementwise arithmetic, the optimizer's
    update, attention, every collective on every mesh axis, send/recv) on NPROC processes,
    print the fitted rates and write a cluster file for `--cluster`."""
    from autopar.calibration import calibrate, write_calibration
    from autopar.views.device import device_lines

    shape = parse_mesh(mesh) if mesh else (nproc,)
    if math.prod(shape) != nproc:
        fail(f"--mesh {mesh} has {math.prod(shape)} devices but --nproc is {nproc}")
    names = parse_names(axis_names) or (
        ("dp",) if len(shape) == 1 else default_axis_names(len(shape))
    )
    try:
        cluster, measured = calibrate(
            nproc, shape, names, backend=parse_backend(backend, nproc), sizes=sizes
        )
    except ValueError as exc:
        fail(str(exc))
    write_calibration(cluster, measured, output)
    lines = "\n".join(f"  {line}" for line in device_lines(cluster.device))
    typer.echo(f"{cluster}\n{lines}\nwrote {output}")


def main() -> None:
    """Console entry point (`autopar`, `python -m autopar`)."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    app()
