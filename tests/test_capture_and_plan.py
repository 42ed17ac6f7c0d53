"""Capture (roles, tied weights, fingerprints, clear errors) and the Plan as data."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autopar
from autopar.capture import CaptureError, capture
from autopar.cluster import Cluster
from autopar.options import PlanOptions
from autopar.plan import Plan
from autopar.rank_plans import check_plan_matches
from autopar.views import describe, summary
from samples import get_sample


def _tiny(name: str, batch_size: int = 8):
    sample = get_sample(name)
    torch.manual_seed(0)
    model = sample.build("tiny")
    return model, sample.example_batch(model, batch_size)


def test_tied_weights_become_one_parameter() -> None:
    model, batch = _tiny("gpt")
    captured = capture(model, batch)
    fqns = list(captured.params.values())
    assert "wte.weight" in fqns and "lm_head.weight" not in fqns
    assert captured.aliases == {"wte.weight": ["lm_head.weight"]}
    assert len(fqns) == len(list(model.parameters()))  # parameters() dedups tied weights


def test_roles_and_layers() -> None:
    model, batch = _tiny("llama")
    captured = capture(model, batch)
    roles = {n.name: n.meta["autopar_role"] for n in captured.placeholders()}
    assert sorted(captured.user_inputs) == sorted(k for k, v in roles.items() if v == "input")
    layers = {captured.layer_of(n) for n in captured.gm.graph.nodes} - {None}
    assert layers == {"layers.0", "layers.1"}


def test_fingerprint_is_stable_and_shape_sensitive() -> None:
    model, batch = _tiny("mlp")
    a = capture(model, batch).fingerprint
    assert a == capture(model, batch).fingerprint
    _, other = _tiny("mlp", batch_size=4)
    assert a != capture(model, other).fingerprint


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent Python control flow: not traceable
            return y.mean()
        return y.sum()


def test_untraceable_model_names_cause_and_line() -> None:
    with pytest.raises(CaptureError) as info:
        capture(_DataDependent(), (torch.randn(2, 4),))
    text = str(info.value)
    assert "test_capture_and_plan.py" in text and "if y.sum() > 0" in text
    assert "Fix:" in text


def test_non_scalar_output_asks_for_loss_fn() -> None:
    lin = nn.Linear(4, 4)
    with pytest.raises(CaptureError, match="loss_fn"):
        capture(lin, (torch.randn(2, 4),))
    captured = capture(
        lin, (torch.randn(2, 4), torch.randn(2, 4)), loss_fn=lambda out, y: ((out - y) ** 2).mean()
    )
    assert sorted(captured.params.values()) == ["bias", "weight"]  # no wrapper prefix


class _ShiftedRight(nn.Module):
    """Hugging Face T5's decoder inputs: the labels shifted right into a fresh tensor by
    slice assignment (functionalized to `aten.copy`, which no strategy table covers)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        shifted = labels.new_zeros(labels.shape)
        shifted[..., 1:] = labels[..., :-1].clone()
        shifted[..., 0] = 3
        logits = self.head(self.emb(shifted))
        return nn.functional.cross_entropy(logits.view(-1, 16), labels.view(-1))


def test_a_slice_assignment_is_captured_as_the_values_it_copies() -> None:
    model, labels = _ShiftedRight(), torch.randint(0, 16, (4, 6))
    captured = capture(model, (labels,))
    ops = {n.target for n in captured.gm.graph.nodes}
    assert torch.ops.aten.copy.default not in ops and torch.ops.aten.slice_scatter.default in ops
    params = dict(model.named_parameters())
    values = {**{k: params[v] for k, v in captured.params.items()}, **captured.constants}
    args = [values.get(n.name, labels) for n in captured.placeholders()]
    torch.testing.assert_close(captured.gm(*args)[0], model(labels), rtol=0, atol=0)
    plan = autopar.plan(model, (labels,), cluster=Cluster.preset("cpu", mesh=(2,)))
    assert plan.tensors


@pytest.fixture(scope="module")
def gpt_plan() -> Plan:
    model, batch = _tiny("gpt")
    return autopar.plan(
        model, batch, cluster=Cluster.preset("cpu", mesh=(2, 2), axis_names=("dp", "tp"))
    )


def test_plan_json_round_trips_exactly(gpt_plan: Plan, tmp_path) -> None:
    path = tmp_path / "plan.json"
    gpt_plan.save(path)
    loaded = Plan.load(path)
    assert loaded == gpt_plan and loaded.content_hash == gpt_plan.content_hash
    data = json.loads(path.read_text())
    assert data["schema_version"] == 4 and data["graph_fingerprint"] == gpt_plan.graph_fingerprint
    assert data["fusion"] == "none" and data["fused_regions"] == []


def test_edited_plan_is_rejected(gpt_plan: Plan) -> None:
    data = gpt_plan.to_dict()
    data["tensors"][0]["spec"] = "S(0),S(0)" if data["tensors"][0]["spec"] != "S(0),S(0)" else "R,R"
    with pytest.raises(ValueError, match="content hash"):
        Plan.from_dict(data)
    data = gpt_plan.to_dict()
    data["schema_version"] = 99
    with pytest.raises(ValueError, match="schema version"):
        Plan.from_dict(data)


def test_version_1_plan_asks_for_a_new_plan(gpt_plan: Plan) -> None:
    """Version 1 recorded fusion as a list of regions ("*" for inductor)."""
    data = gpt_plan.to_dict()
    del data["fused_regions"]
    data.update(schema_version=1, fusion=[{"kernel": "inductor", "node": "*", "replaced": []}])
    with pytest.raises(ValueError, match=r"schema version 1 .*older autopar.*re-plan"):
        Plan.from_dict(data)
    data = {**gpt_plan.to_dict(), "schema_version": 2}  # priced without overlap, no `comm`
    with pytest.raises(ValueError, match=r"schema version 2 .*overlap.*re-plan"):
        Plan.from_dict(data)
    data = {**gpt_plan.to_dict(), "schema_version": 3}  # nodes named as export left them
    with pytest.raises(ValueError, match=r"schema version 3 .*numbered in graph order"):
        Plan.from_dict(data)
    with pytest.raises(ValueError, match="fusion='xla'"):
        replace(gpt_plan, fusion="xla")


def test_describe_and_summary(gpt_plan: Plan) -> None:
    d = describe(gpt_plan)
    json.dumps(d)
    stage = d["stages"][0]
    assert stage["mesh"] == [2, 2] and set(stage["axis_roles"]) == {"dp", "tp"}
    assert d["predicted_step_time"] > 0 and d["predicted_peak_memory"] > 0
    assert "mesh (2, 2)" in summary(gpt_plan)


def test_plan_for_another_model_or_mesh_is_rejected(gpt_plan: Plan) -> None:
    model, batch = _tiny("llama")
    with pytest.raises(ValueError, match="another model"):
        check_plan_matches(gpt_plan, capture(model, batch), Cluster.preset("cpu", mesh=(2, 2)))
    model, batch = _tiny("gpt")
    with pytest.raises(ValueError, match=r"mesh \(2, 2\).*\(4,\)"):
        check_plan_matches(gpt_plan, capture(model, batch), Cluster.preset("cpu", mesh=(4,)))


def test_memory_no_plan_fits_names_smallest_cluster() -> None:
    model = get_sample("llama").build("llama3-70b", device="meta")
    batch = get_sample("llama").example_batch(model, 8, device="meta")
    with pytest.raises(autopar.MemoryInfeasible, match=r"at least \d+ devices.*nodes=\d+"):
        autopar.plan(model, batch, cluster=Cluster.preset("p3.16xlarge", nodes=1))


def test_forced_strategy_must_name_known_roles() -> None:
    model, batch = _tiny("mlp")
    with pytest.raises(ValueError, match="unknown strategy 'zero'"):
        autopar.plan(model, batch, cluster=Cluster.preset("cpu", mesh=(2,)), strategy="zero")
    with pytest.raises(ValueError, match="names 2 axis roles but the mesh has 1"):
        autopar.plan(model, batch, cluster=Cluster.preset("cpu", mesh=(2,)), strategy=("dp", "tp"))


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fingerprint_does_not_depend_on_the_device(name: str) -> None:
    """A plan made on the meta device (`autopar plan`) applies to the real model."""
    sample = get_sample(name)
    prints = []
    for device in (None, "meta"):
        model = sample.build("tiny", device=device)
        prints.append(capture(model, sample.example_batch(model, 8, device=device)).fingerprint)
    assert prints[0] == prints[1]


class _CountsForwards(nn.Module):
    """A model whose forward must not run: capture would call it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        raise RuntimeError("forward ran: the model was captured")


BAD_OPTIONS = [
    ({"fusion": "xla"}, "fusion='xla': choose one of none, triton, inductor"),
    ({"schedule": "zigzag"}, "schedule='zigzag': choose one of gpipe, 1f1b"),
    ({"microbatches": 0}, "microbatches=0: give a count >= 1"),
    ({"pipeline_stages": 0}, "pipeline_stages=0: give a number of stages"),
    ({"pipeline_stages": "many"}, "pipeline_stages='many'"),
    ({"time_limit_s": 0}, r"time_limit_s=0: give the solver's time limit in seconds \(> 0\)"),
    ({"memory_limit": -1.0}, "memory_limit=-1.0: give bytes per device"),
    ({"stage_cuts": (0, 2, 1)}, "stage_cuts=.*starting at 0 and increasing"),
    ({"stage_cuts": (1, 2)}, "stage_cuts=.*starting at 0"),
    ({"strategy": "zero"}, "unknown strategy 'zero'; choose from auto, dp, fsdp, tp"),
    ({"placements": {"lin.weight": "X"}}, r"placements\['lin.weight'\] = 'X'"),
    ({"shard_optimizer": "yes"}, "shard_optimizer='yes'"),
    (
        {"pipeline_stages": "auto", "strategy": ("dp", "tp")},
        "pipeline_stages='auto' chooses the mesh",
    ),
    ({"pipeline_stages": "auto", "stage_cuts": (0, 1)}, "stage_cuts pins the stages"),
    # checked against the cluster, still before capture
    ({"strategy": ("dp", "tp")}, "names 2 axis roles but the mesh has 1"),
    ({"pipeline_stages": 2, "schedule": "1f1b", "stage_cuts": (0,)}, "stage_cuts has 1 entries"),
    ({"pipeline_stages": 2, "microbatches": 5}, "microbatches=5 cannot split a batch of 4"),
    ({"pipeline_stages": 3}, "pipeline_stages=3 does not divide the first mesh axis"),
]


@pytest.mark.parametrize(("options", "match"), BAD_OPTIONS, ids=[m for _, m in BAD_OPTIONS])
def test_bad_option_fails_before_capture(options: dict, match: str) -> None:
    model = _CountsForwards()
    batch = (torch.randn(4, 4),)
    with pytest.raises(ValueError, match=match) as info:
        autopar.plan(model, batch, cluster=Cluster.preset("cpu", mesh=(2,)), **options)
    assert type(info.value) is ValueError  # not a CaptureError: nothing was captured
    assert model.calls == 0


def test_compile_checks_options_before_anything() -> None:
    """No process group runs here: the option error still comes first."""
    model = _CountsForwards()
    with pytest.raises(ValueError, match="fusion='xla'"):
        autopar.compile(model, (torch.randn(4, 4),), cluster=Cluster.preset("cpu"), fusion="xla")
    with pytest.raises(RuntimeError, match="needs a process group"):
        autopar.compile(model, (torch.randn(4, 4),), cluster=Cluster.preset("cpu"))
    assert model.calls == 0


def test_options_are_frozen_and_normalized() -> None:
    placements = {"lin.weight": "S(0)"}
    options = PlanOptions(strategy=["dp", "tp"], placements=placements, stage_cuts=[0, 2])
    placements["lin.bias"] = "R"  # the caller's dict is copied
    assert options.strategy == ("dp", "tp") and options.stage_cuts == (0, 2)
    assert options.placements == {"lin.weight": "S(0)"}
    with pytest.raises(AttributeError):
        options.fusion = "triton"  # type: ignore[misc]


def test_plan_profile_and_progress() -> None:
    """`autopar plan --profile` prints every search phase; `--progress` draws the progress
    line on stderr (and erases it), never on stdout."""
    from typer.testing import CliRunner

    from autopar.cli import app
    from autopar.search.progress import PHASES

    args = ["plan", "gpt", "--cluster", "cpu", "--mesh", "4", "--profile", "--progress"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    profile = result.stdout.split("search profile", 1)[1]
    for name in (*PHASES, "total"):
        assert re.search(rf"^\s+{re.escape(name)}\s+\d+\.\d\d s$", profile, re.M), name
    assert "searching: " in result.stderr and "searching: " not in result.stdout


def test_planning_leaves_the_process_excepthook_alone() -> None:
    """Each fake group `init_process_group` makes wraps `sys.excepthook` (a "[rank0]: "
    prefix on every traceback line); planning restores it, so a process that plans many
    times prints its next error once, unprefixed."""
    from autopar.planning import fake_group

    before = sys.excepthook
    for _ in range(2):
        with fake_group(4):
            assert dist.is_initialized()
    assert sys.excepthook is before
    assert not dist.is_initialized()
