"""fusion="inductor": the plan records it, `autopar inspect` shows it, and each rank's step
program, handed to torch.compile (inductor's C++ backend on CPU), trains like the single
device.

Tolerances as in test_parity.py (fp32): loss relative error <= 1e-5, gradient shards
<= 1e-5 x max |g_ref| per parameter and step (inductor reorders float sums), parameters
after the steps <= lr x steps (Adam's float-noise yardstick); pipelined, gradients
<= 1e-4 as in test_pipeline.py (microbatch gradients are summed in another order).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import autopar
from autopar.capture import capture
from autopar.cli import app
from autopar.options import PlanOptions
from autopar.plan import Plan
from autopar.planning import PlanJob
from autopar.runtime import inductor
from autopar.testing.parity import LR, ParityCase, ParityResult, run_parity
from samples import get_sample


@pytest.fixture(scope="module")
def gpt() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    sample = get_sample("gpt")
    torch.manual_seed(0)
    model = sample.build("tiny")
    return model, tuple(sample.example_batch(model, 4))


def test_plan_records_inductor_and_keeps_the_graph(gpt, tmp_path: Path) -> None:
    model, batch = gpt
    cluster = autopar.Cluster.preset("cpu", mesh=(2,), axis_names=("dp",))
    plan = autopar.plan(model, batch, cluster=cluster, strategy="dp", fusion="inductor")
    assert plan.fusion == "inductor" and plan.fused_regions == ()
    # the captured graph is not rewritten: the plan applies to the unfused graph
    assert plan.graph_fingerprint == capture(model, batch).fingerprint
    assert not any(n.op.startswith("autopar.") for n in plan.nodes)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan
    # a saved inductor plan compiles with inductor again
    job = PlanJob.make(PlanOptions(), cluster, batch, plan=Plan.load(path))
    assert job.fusion == "inductor"
    out = CliRunner().invoke(app, ["inspect", str(path)])
    assert out.exit_code == 0, out.output
    assert "inductor" in out.output and "torch.compile" in out.output


def test_bad_fusion_choice(gpt) -> None:
    model, batch = gpt
    cluster = autopar.Cluster.preset("cpu", mesh=(2,), axis_names=("dp",))
    with pytest.raises(ValueError, match="fusion='xla': choose one of none, triton, inductor"):
        autopar.plan(model, batch, cluster=cluster, fusion="xla")


def test_cache_dir_in_the_build_area(monkeypatch: pytest.MonkeyPatch) -> None:
    from autopar._compat import default_inductor_cache_dir

    # torch fills in its default as soon as torch._dynamo is imported: that counts as unset
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_inductor_cache_dir())
    compiled = inductor.compile_program(lambda x: x + 1)
    want = Path(__file__).resolve().parent.parent / "build" / "inductor"
    assert inductor.cache_dir() == want
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(want)
    # a directory the user chose is kept
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/some/where")
    inductor.compile_program(lambda x: x)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/some/where"
    assert callable(compiled)


STEPS = 2
CASES = {
    # GPT tiny on 2 gloo ranks (dp), each rank's program compiled by inductor (C++)
    "dp": ParityCase("gpt", (2,), ("dp",), "dp", steps=STEPS, fusion="inductor"),
    # GPT (4 layers) in 2 pipeline stages (1F1B): each stage's forward and backward graphs
    # are compiled by inductor
    "pp": ParityCase(
        "gpt",
        (2,),
        ("pp",),
        config="tiny4",
        steps=STEPS,
        schedule="1f1b",
        microbatches=2,
        fusion="inductor",
    ),
}


@pytest.fixture(scope="module")
def compiled_runs() -> dict[str, ParityResult]:
    """Both compiled cases in one run on one set of ranks: a rank's first compile pays for
    inductor's set-up (its imports, the CPU's vector-ISA probes, the precompiled header),
    which the second case then finds done."""
    return dict(zip(CASES, run_parity(list(CASES.values())), strict=True))


# compiled cases share no capture with the other multi-process tests (own_ranks); they
# share the fixture's run with each other (one pytest worker: their own group)
@pytest.mark.multiproc
@pytest.mark.own_ranks
@pytest.mark.xdist_group("inductor")
def test_inductor_step_trains_like_single_device(compiled_runs) -> None:
    """GPT tiny on 2 gloo ranks (dp), each rank's program compiled by inductor (C++)."""
    res = compiled_runs["dp"]
    assert res.error is None, res.error
    line = (
        f"{res.label}: loss {res.loss_rel_err:.1e} grad {res.grad_err:.1e} "
        f"param {res.param_err:.1e} (ddp {res.ddp_param_err:.1e})"
    )
    print(line)
    assert res.fusion == ["inductor"]
    assert res.step_program == "OptimizedModule"  # torch.compile's wrapper ran every step
    assert res.loss_rel_err <= 1e-5 and res.grad_err <= 1e-5, line
    assert res.param_err <= LR * STEPS, line


@pytest.mark.multiproc
@pytest.mark.own_ranks
@pytest.mark.xdist_group("inductor")
def test_inductor_pipeline_stages_train_like_single_device(compiled_runs) -> None:
    """GPT (4 layers) in 2 pipeline stages (1F1B): each stage's forward and backward graphs
    are compiled by inductor."""
    res = compiled_runs["pp"]
    assert res.error is None, res.error
    line = f"{res.label}: loss {res.loss_rel_err:.1e} grad {res.grad_err:.1e} param {res.param_err:.1e}"
    print(line)
    assert res.fusion == ["inductor"]
    assert res.loss_rel_err <= 1e-5 and res.grad_err <= 1e-4, line
    assert res.param_err <= LR * STEPS, line
