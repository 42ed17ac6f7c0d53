"""Capture (roles, tied weights, fingerprints, clear errors) and the Plan as data."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import autopar
from autopar.api import check_plan_matches
from autopar.capture import CaptureError, capture
from autopar.cluster import Cluster
from autopar.plan import Plan
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
    assert data["schema_version"] == 1 and data["graph_fingerprint"] == gpt_plan.graph_fingerprint


def test_edited_plan_is_rejected(gpt_plan: Plan) -> None:
    data = gpt_plan.to_dict()
    data["tensors"][0]["spec"] = "S(0),S(0)" if data["tensors"][0]["spec"] != "S(0),S(0)" else "R,R"
    with pytest.raises(ValueError, match="content hash"):
        Plan.from_dict(data)
    data = gpt_plan.to_dict()
    data["schema_version"] = 99
    with pytest.raises(ValueError, match="schema version"):
        Plan.from_dict(data)


def test_describe_and_summary(gpt_plan: Plan) -> None:
    d = gpt_plan.describe()
    json.dumps(d)
    stage = d["stages"][0]
    assert stage["mesh"] == [2, 2] and set(stage["axis_roles"]) == {"dp", "tp"}
    assert d["predicted_step_time"] > 0 and d["predicted_peak_memory"] > 0
    assert "mesh (2, 2)" in gpt_plan.summary()


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
