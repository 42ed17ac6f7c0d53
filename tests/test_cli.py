"""The `autopar` command line: plan, inspect, bench (in process), run (one torchrun job),
and the models it takes (samples by name, module:factory, path/to/file.py:factory)."""

from __future__ import annotations

import csv
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from autopar.cli import app
from autopar.cli.args import ERROR_DIR
from autopar.cli.commands import rank_errors
from autopar.cli.sources import load_model
from autopar.devices import free_port
from autopar.plan import Plan
from autopar.views import (
    BenchRow,
    bench_table,
    describe,
    edge_collectives,
    group_layers,
    timeline_lines,
    write_bench_csv,
)

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
    # written to a pipe (not a terminal): the tables as wide as they need, no op name folded
    assert "embedding.default" in out and "nll_loss_forward.default" in out
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
    stages = describe(plan)["stages"]
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


def test_a_pipelined_plan_reads_as_written_with_or_without_its_boundary(
    pp_plan_file: Path, tmp_path: Path
) -> None:
    """The default boundary ("placed") is left out of the file and of the content hash: a
    plan written before `PipelinePlan.boundary` existed loads unchanged; a scattered one
    keeps it, and `inspect` names it."""
    import dataclasses
    import json

    plan = Plan.load(pp_plan_file)
    assert plan.pipeline.boundary == "placed"
    assert "boundary" not in json.loads(pp_plan_file.read_text())["pipeline"]
    scattered = dataclasses.replace(
        plan, pipeline=dataclasses.replace(plan.pipeline, boundary="scattered")
    )
    path = tmp_path / "scattered.json"
    scattered.save(path)
    assert json.loads(path.read_text())["pipeline"]["boundary"] == "scattered"
    loaded = Plan.load(path)
    assert loaded == scattered and loaded.content_hash != plan.content_hash
    assert re.search(r"│ stage boundary\s+│ scattered", invoke("inspect", str(path)))


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
    assert all(r["error"] == "" for r in rows), rows  # every strategy fits the tiny GPT
    auto = float(rows[0]["predicted_step_time_s"])
    for r in rows:
        step = float(r["predicted_step_time_s"])
        assert step > 0 and float(r["predicted_peak_memory_bytes"]) > 0, r
        assert float(r["ratio_vs_auto"]) == pytest.approx(step / auto), r
        # the search considers every forced plan, so none is predicted faster than its pick
        assert step >= auto * (1 - 1e-6), r
        assert re.search(rf"│ {r['strategy']}\s+│ {re.escape(r['axis_roles'])}\s+│", out), out
    forced = {r["strategy"]: r["axis_roles"] for r in rows[1:]}
    assert forced == {"dp": "axis0=dp", "fsdp": "axis0=fsdp", "tp": "axis0=tp"}


def test_bench_rows_with_errors() -> None:
    """A strategy the search refuses is reported, not priced: blank in the CSV, absent from
    the table, and no ratio against a failed "auto"."""
    ok, bad = BenchRow("dp", "dp=dp", 2e-3, 1024.0), BenchRow("tp", error="does not fit")
    table = bench_table([ok, bad], 1e-3, "t")
    assert table.row_count == 1 and ok.ratio(1e-3) == pytest.approx(2.0)
    assert math.isnan(ok.ratio(math.nan)) and math.isnan(bad.ratio(1e-3))


def test_bench_csv_with_errors(tmp_path: Path) -> None:
    path = tmp_path / "bench.csv"
    rows = [BenchRow("auto", error="infeasible"), BenchRow("dp", "dp=dp", 2e-3, 1024.0)]
    write_bench_csv(path, rows, math.nan)
    got = list(csv.DictReader(path.open()))
    assert got[0] == {
        "strategy": "auto",
        "axis_roles": "",
        "predicted_step_time_s": "",
        "predicted_peak_memory_bytes": "",
        "ratio_vs_auto": "",
        "error": "infeasible",
    }
    assert got[1]["predicted_step_time_s"] == "0.002" and got[1]["ratio_vs_auto"] == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["plan", "nope"],
            "unknown sample 'nope'; known samples: cnn, encdec, gpt, llama, mlp, moe, vit",
        ),
        (["plan", "nope"], "module:factory"),
        (["plan", "no_such_module_xyz:build"], "cannot import no_such_module_xyz"),
        (["plan", "missing/model.py:build"], "no such file missing/model.py"),
        (["plan", "gpt.py:"], "is not a model source"),
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
        (["plan", *TINY_CPU, "--mixed-precision", "fp8"], "mixed_precision='fp8': choose"),
        (["run", "gpt", "--activation-checkpointing", "often"], "activation_checkpointing="),
    ],
)
def test_bad_input_is_one_line(args: list[str], message: str) -> None:
    out = invoke(*args, code=2)
    assert message in out
    assert len(out.strip().splitlines()) == 1


USER_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn

    CONFIGS = ("narrow", "wide")


    class Regressor(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 16))

        def forward(self, x, y):
            return nn.functional.mse_loss(self.net(x), y)


    def make(config="narrow"):
        return Regressor(64 if config == "wide" else 32)


    def example_batch(model, batch_size):
        return torch.randn(batch_size, 16), torch.randn(batch_size, 16)
    """
)


@pytest.fixture
def user_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory holding `regressor.py` (a model module), as the current directory."""
    (tmp_path / "regressor.py").write_text(USER_MODEL)
    (tmp_path / "no_batch.py").write_text(
        "from torch import nn\n\ndef make():\n    return nn.Linear(2, 2)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader adds the cwd for module:factory
    return tmp_path


@pytest.mark.parametrize("form", ["file", "module"])
def test_plan_any_model_by_factory(user_dir: Path, form: str) -> None:
    model = str(user_dir / "regressor.py") + ":make" if form == "file" else "regressor:make"
    path = user_dir / "plan.json"
    out = invoke(
        "plan", model, "--config", "wide", "--cluster", "cpu", "--mesh", "2", "-o", str(path)
    )
    assert out.startswith("autopar plan ") and f"wrote {path}" in out
    plan = Plan.load(path)
    shapes = {t.fqn: t.shape for t in plan.tensors if t.kind == "param"}
    assert shapes["net.0.weight"] == (64, 16)  # "wide" reached the factory
    assert {t.fqn: t.shape for t in plan.tensors if t.kind == "input"} == {
        "x": (8, 16),
        "y": (8, 16),
    }


def test_model_protocol_errors(user_dir: Path) -> None:
    out = invoke("plan", "regressor:make", "--config", "huge", code=2)
    assert "unknown config 'huge' for 'regressor:make'; known: narrow, wide" in out
    out = invoke("plan", "no_batch.py:make", code=2)
    assert "no_batch.py defines no function example_batch()" in out
    out = invoke("plan", "regressor.py:build", code=2)
    assert "regressor.py defines no function build()" in out
    # sample names resolve beside the autopar package when the cwd has no samples/
    out = invoke("plan", "nope", code=2)
    assert "known samples: cnn, encdec, gpt, llama, mlp, moe, vit" in out


def test_load_model_meta_and_real(user_dir: Path) -> None:
    model, batch = load_model("regressor.py:make", None, 4, meta=True)
    assert all(p.is_meta for p in model.parameters()) and all(t.is_meta for t in batch)
    m1, b1 = load_model("regressor.py:make", "narrow", 4, seed=1)
    m2, b2 = load_model("regressor.py:make", "narrow", 4, seed=1)
    assert not any(p.is_meta for p in m1.parameters())
    assert all(torch.equal(a, b) for a, b in zip(b1, b2, strict=True))
    for (k1, v1), (k2, v2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert k1 == k2 and torch.equal(v1, v2), k1
    assert torch.isfinite(m1(*b1))


def _python(code: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    return proc.stdout.strip()


def test_samples_load_by_path_and_are_not_installed(tmp_path: Path) -> None:
    """Outside the checkout no `samples` package is importable (autopar does not install
    one), and loading a sample by name imports none; a sample that imports its siblings
    finds them (the directory holding its package goes on the path)."""
    assert (
        _python("import importlib.util; print(importlib.util.find_spec('samples'))", tmp_path)
        == "None"
    )
    code = (
        "import sys; from autopar.cli.sources import load_model; "
        "m, b = load_model('mlp', 'tiny', 2); "
        "print(type(m).__name__, [tuple(t.shape) for t in b], 'samples' in sys.modules)"
    )
    assert _python(code, tmp_path) == "MLP [(2, 32), (2, 32)] False"
    # a sample importing its siblings (moe: samples.llama, samples._moe_dropless) loads too
    code = (
        "from autopar.cli.sources import load_model; "
        "m, b = load_model('moe', 'tiny-dropless', 2); print(type(m.layers[0].moe).__name__)"
    )
    assert _python(code, tmp_path) == "DroplessMoE"


@pytest.mark.multiproc
@pytest.mark.own_ranks  # `autopar run` starts its own processes
def test_run_matches_single_device() -> None:
    """Hugging Face's GPT-2 with its dropout: rank 0 trains the single-device reference
    first, and every rank's generator is put back where it started before the parallel
    run draws its masks (rank 0's alone had moved on: 1.8e-3 off at the first step)."""
    cmd = [
        sys.executable,
        "-m",
        "autopar",
        "run",
        "tests/models/hf_gpt2.py:build",
        "--config",
        "tiny",
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


@pytest.mark.multiproc
@pytest.mark.own_ranks  # `autopar run` starts its own processes
@pytest.mark.parametrize("case", ["few layers", "no loss"])
def test_run_stopped_by_the_planner_prints_its_error_not_torchruns(
    case: str, tmp_path: Path
) -> None:
    """Every rank stops in planning (an interleaved schedule on too few layers; a model that
    returns no loss, on which rank 0's single-device reference fails first): `autopar run`
    prints the planner's message once, no rank's traceback and nothing of torchrun's own
    report (its agent's log lines, `ChildFailedError`'s traceback and banner)."""
    if case == "few layers":
        model = ["gpt", "--config", "tiny", "--axis-names", "pp", "--pipeline-stages", "2"]
        model += ["--microbatches", "4", "--schedule", "zbv"]
        expected = "error: no pipeline schedule fits: zbv:"
    else:
        source = tmp_path / "logits.py"
        source.write_text(
            "import torch\n"
            "def build(config=None):\n    return torch.nn.Linear(4, 4)\n"
            "def example_batch(model, batch_size):\n    return (torch.randn(batch_size, 4),)\n"
        )
        model = [f"{source}:build"]
        expected = "error: the model must return one scalar loss"
    cmd = [sys.executable, "-m", "autopar", "run", *model, "--nproc", "2", "--mesh", "2"]
    proc = subprocess.run([*cmd, "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith(expected), said
    for torchruns in ("Traceback", "ChildFailedError", "FAILED", "elastic", "SIGTERM"):
        assert torchruns not in proc.stderr, proc.stderr


def test_a_crashed_rank_is_named_with_how_it_stopped() -> None:
    """Where no rank wrote an error (a crash), the launcher names the rank that failed
    first, not one torchrun stopped after it, and its exit code or signal."""
    from types import SimpleNamespace

    from autopar.cli.launch import failure_line, root_failure

    def failed(code: int, when: int):
        name = signal.Signals(-code).name if code < 0 else "<N/A>"
        return SimpleNamespace(exitcode=code, timestamp=when, signal_name=lambda: name)

    stopped = {0: failed(-signal.SIGTERM, 5), 1: failed(-signal.SIGKILL, 7), 2: failed(3, 9)}
    rank, first = root_failure(stopped)
    assert rank == 1
    assert failure_line(rank, first.exitcode) == (
        "rank 1 was killed by SIGKILL (the host's out-of-memory killer sends it)"
    )
    assert root_failure({0: failed(-signal.SIGTERM, 5)})[0] == 0  # torchrun's alone
    assert failure_line(2, 3) == "rank 2 exited with code 3"
    assert failure_line(0, -signal.SIGSEGV) == "rank 0 was killed by SIGSEGV"


def test_a_rank_stopped_by_the_planner_says_why_once(tmp_path: Path) -> None:
    """A worker of `autopar run` whose compile fails writes the planner's message for the
    command to print (not a traceback per rank) and exits non-zero; messages that differ
    between ranks are each printed once with their ranks."""
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        ERROR_DIR: str(tmp_path),
    }
    args = ["--model", "gpt", "--mesh", "1", "--axis-names", "dp", "--steps", "1"]
    args += ["--pipeline-stages", "2", "--backend", "gloo"]
    cmd = [sys.executable, "-m", "autopar.cli.worker", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    said = rank_errors(tmp_path)
    assert "pipeline_stages=2 does not divide the first mesh axis" in said, said
    (tmp_path / "rank1.txt").write_text(said)
    (tmp_path / "rank2.txt").write_text("another")
    assert rank_errors(tmp_path).splitlines() == [f"ranks 0, 1: {said}", "ranks 2: another"]
