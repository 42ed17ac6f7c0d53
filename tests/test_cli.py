"""The `autopar` command line: plan, inspect, bench (in process), run (one torchrun job)."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autopar.cli import app, edge_collectives, group_layers, timeline_lines
from autopar.plan import Plan

runner = CliRunner()
TINY_CPU = ["gpt", "--cluster", "cpu", "--mesh", "4"]
PP_CPU = ["gpt", "--config", "tiny4", "--cluster", "cpu", "--mesh", "2x2", "--axis-names", "pp,dp"]


def invoke(*args: str, code: int = 0) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    out = invoke("plan", *TINY_CPU, "-o", str(path))
    assert out.startswith("autopar plan ") and "mesh (4,)" in out and f"wrote {path}" in out
    return path


def test_plan_writes_a_loadable_plan(plan_file: Path) -> None:
    plan = Plan.load(plan_file)
    assert plan.mesh_shape == (4,)
    assert plan.cluster["device"]["name"] == "cpu"
    assert any(t.kind == "param" for t in plan.tensors)


def test_inspect_collapses_identical_layers(plan_file: Path) -> None:
    out = invoke("inspect", str(plan_file))
    for text in (
        "autopar plan",
        "axis roles",
        "step time",
        "peak memory",
        "solver",
        "(outside layers)",
        "layer h.0  ×2 identical: h.0, h.1",
        "storage spec",
    ):
        assert text in out, text
    assert "layer h.1" not in out
    groups = group_layers(Plan.load(plan_file))
    assert [g.layers for g in groups] == [(None,), ("h.0", "h.1")]


@pytest.fixture(scope="module")
def pp_plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli-pp") / "pp-plan.json"
    out = invoke("plan", *PP_CPU, "--schedule", "1f1b", "--microbatches", "4", "-o", str(path))
    assert "schedule 1f1b, 4 microbatches" in out and f"wrote {path}" in out
    return path


def test_inspect_pipelined_plan_shows_stages_and_timeline(pp_plan_file: Path) -> None:
    plan = Plan.load(pp_plan_file)
    assert plan.pipeline is not None and plan.pipeline.schedule == "1f1b"
    assert plan.mesh_shape == (2, 2) and plan.stage_mesh_shape == (2,)
    out = invoke("inspect", str(pp_plan_file))
    for text in ("stage mesh", "schedule", "microbatches", "4 × 2 rows", "bubble", "timeline"):
        assert text in out, text
    assert re.search(r"│ axis roles\s+│ dp=\w+\s+│", out), out  # roles of the stage mesh only
    header = re.search(r"┃ stage ┃ pipeline rank ┃ devices ┃ layers\s+┃ count ┃", out)
    assert header is not None, out
    rows = re.findall(r"^│\s+(\d+) │ (\d+)\s+│ (\S+)\s+│ (\S+)\s+│\s+(\d+) │$", out, re.M)
    stages = plan.describe()["stages"]
    assert rows == [
        (
            str(st["stage"]),
            str(st["pipeline_rank"]),
            _span(st["devices"]),
            _span(st["layers"]),
            str(len(st["layers"])),
        )
        for st in stages
    ]
    assert sum(len(st["layers"]) for st in stages) == 4
    timeline = re.findall(r"^rank (\d+): ([FBW][\d. FBW]+)$", out, re.M)
    assert timeline == [(str(r), row) for r, row in enumerate(plan.pipeline.timeline)]
    assert all("F" in row and "B" in row for _, row in timeline)


def _span(items: list) -> str:
    return str(items[0]) if len(items) == 1 else f"{items[0]}..{items[-1]}"


def test_timeline_lines_truncate_long_rows(pp_plan_file: Path) -> None:
    plan = Plan.load(pp_plan_file)
    lines = timeline_lines(plan, width=30)
    assert len(lines) == 2
    for r, (line, row) in enumerate(zip(lines, plan.pipeline.timeline, strict=True)):
        actions = row.split()
        assert len(line) <= 30 and line.startswith(f"rank {r}: {actions[0]} ")
        assert line.endswith(f" {actions[-1]}")
        head, hidden, tail = re.fullmatch(rf"rank {r}: (.*) … \+(\d+) … (.*)", line).groups()
        assert len(head.split()) + int(hidden) + len(tail.split()) == len(actions)


def test_edge_collectives_text() -> None:
    mesh, names = (2, 4), ("node", "gpu")
    assert (
        edge_collectives("R,S(0)", "R,R", (128, 32), "float32", mesh, names)
        == "R,S(0)→R,R all_gather@gpu 16.0 KiB"
    )
    assert (
        edge_collectives("P,R", "S(0),R", (128, 32), "float32", mesh, names)
        == "P,R→S(0),R reduce_scatter@node 16.0 KiB"
    )
    assert edge_collectives("R,R", "S(1),R", None, None, mesh, names) == "R,R→S(1),R local"


def test_bench_table_and_csv(tmp_path: Path) -> None:
    path = tmp_path / "bench.csv"
    out = invoke("bench", *TINY_CPU, "--csv", str(path))
    rows = list(csv.DictReader(path.open()))
    assert [r["strategy"] for r in rows] == ["auto", "dp", "fsdp", "tp"]
    assert float(rows[0]["ratio_vs_auto"]) == pytest.approx(1.0)
    for r in rows:
        assert r["error"] or (r["strategy"] in out and float(r["predicted_step_time_s"]) > 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "nope"], "unknown sample 'nope'; known samples: gpt, llama, mlp"),
        (["plan", "gpt", "--config", "huge"], "unknown config 'huge' for sample 'gpt'"),
        (["plan", "gpt", "--cluster", "tpu"], "unknown cluster preset 'tpu'"),
        (["plan", *TINY_CPU[:-1], "2xq"], "--mesh '2xq' is not a mesh"),
        (["plan", "gpt", "--cluster", "dgx-h100", "--mesh", "3"], "mesh (3,) has 3 devices"),
        (["plan", *TINY_CPU, "--strategy", "zero"], "unknown strategy zero"),
        (["run", "gpt", "--nproc", "2", "--mesh", "2x2"], "--mesh 2x2 has 4 devices"),
        (["bench", "nope"], "unknown sample 'nope'"),
        (
            ["plan", *PP_CPU, "--schedule", "zigzag"],
            "unknown schedule 'zigzag'; choose from gpipe, 1f1b, interleaved1f1b, "
            "interleavedzb, zbv, dualpipev",
        ),
        (
            ["run", "gpt", "--nproc", "4", "--axis-names", "pp,dp", "--schedule", "zigzag"],
            "unknown schedule 'zigzag'",
        ),
        (["plan", *TINY_CPU, "--schedule", "1f1b"], "--microbatches/--schedule need pipelining"),
        (["plan", *PP_CPU, "--microbatches", "3"], "--microbatches 3 does not divide"),
        (["plan", *TINY_CPU, "--pipeline-stages", "3"], "--pipeline-stages 3 does not divide"),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    out = invoke(*args, code=2)
    assert message in out
    assert len(out.strip().splitlines()) == 1


@pytest.mark.multiproc
def test_run_matches_single_device() -> None:
    cmd = [
        sys.executable,
        "-m",
        "autopar",
        "run",
        "gpt",
        "--nproc",
        "2",
        "--mesh",
        "2",
        "--steps",
        "2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = re.findall(
        r"^step (\d+)  loss (\S+)  single-device (\S+)  \|diff\| (\S+)$", proc.stdout, re.M
    )
    assert [s[0] for s in steps] == ["1", "2"], proc.stdout
    worst = re.search(r"^max \|loss - single-device\| = (\S+)$", proc.stdout, re.M)
    assert worst is not None, proc.stdout
    assert float(worst.group(1)) < 1e-5
