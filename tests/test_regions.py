"""Regions (``autopar.Region``): a module captured, planned and lowered as one op.

- The drop-less MoE (``samples/_moe_dropless.py``) computes the same loss and gradients
  through its region op (whose backward re-runs the forward) as its own ``compute`` under
  plain autograd, and captures as one op per layer with nothing data-dependent around it.
- The search prices the region's all-to-alls and splits its experts by itself on a DGX-H100
  node (Mixtral-8x7B's width, 2 layers); ``inspect`` names the regions and their traffic.
- A region's strategies are the declared ones: replicate, batch rows, experts (one axis).
- A region holding a buffer is refused with the fix.
Parity on 4 processes (EP = 2 x DP 2) runs in the spawn of ``tests/test_sequence_parallel.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.capture import capture
from autopar.capture.regions import define
from autopar.cluster import Cluster
from autopar.passes.strategies.rules.regions import (
    EXPERTS,
    REPLICATE,
    ROWS,
    backward_rule,
    forward_rule,
    modes,
)
from autopar.views import axis_roles, summary
from samples._moe_dropless import DroplessMoE
from samples.moe import MOE_CONFIGS, MoEModel, build, example_batch


def _grads(model: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_region_trains_like_its_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = build("tiny-dropless")
    batch = example_batch(model, 3)
    loss = model(*batch)
    loss.backward()
    through_op = _grads(model)
    model.zero_grad()
    monkeypatch.setattr(DroplessMoE, "forward", lambda self, x: self.compute(x))
    plain = model(*batch)
    plain.backward()
    assert torch.equal(loss, plain)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(through_op[name], grad, rtol=0, atol=0, msg=name)
    assert through_op["layers.0.moe.w1"].abs().sum() > 0  # the experts really train


def test_region_is_one_op_per_layer() -> None:
    torch.manual_seed(0)
    model = build("tiny-dropless")
    captured = capture(model, example_batch(model, 2))
    ops = [str(n.target) for n in captured.gm.graph.nodes if n.op == "call_function"]
    regions = [op for op in ops if op.startswith("autopar.region_droplessmoe_")]
    assert len(regions) == model.config.n_layers and len(set(regions)) == 1, regions
    assert not any(w in op for op in ops for w in ("nonzero", "argsort", "bincount")), ops


def test_search_splits_the_experts_of_a_dropless_moe_on_a_node() -> None:
    cfg = dataclasses.replace(MOE_CONFIGS["mixtral-8x7b"], n_layers=2, dropless=True)
    with torch.device("meta"):
        model = MoEModel(cfg)
    batch = example_batch(cfg, 8, device="meta")
    cluster = Cluster.preset("dgx-h100", nodes=1)
    plan = autopar.plan(model, batch, cluster=cluster, pipeline_stages=1)
    text = summary(plan)
    # the other weights replicated or FSDP-sharded (at 8 rows the optimizer's update of
    # the replicated ones weighs about as much as their gathers)
    assert axis_roles(plan) in (["dp+ep"], ["fsdp+ep"]), text
    # per rank and step: 2 regions x (dispatch + combine) of 1/8 of 8 x 4096 tokens x 2
    # choices x 4096 dims in fp32
    per_region = 2 * 8 * 4096 * 2 * 4096 * 4 / 8
    assert f"EP regions 2 (all-to-all per step {2 * per_region / 2**20:.1f} MiB forward" in text
    assert plan.predicted_peak_memory <= cluster.device.memory_bytes, text


def test_region_strategies_are_the_declared_ones() -> None:
    moe = build("tiny-dropless").layers[0].moe
    spec = define(moe, (torch.ones(2, 16, 32),))
    assert modes(spec) == (REPLICATE, ROWS, EXPERTS)
    assert spec.param_names == ("w1", "w3", "w2", "router.weight")
    assert [spec.is_expert(i) for i in range(spec.n_args)] == [False, True, True, True, False]
    experts = forward_rule(spec, EXPERTS)  # [y, aux, x, w1, w3, w2, router]
    assert experts == [Shard(0)] * 6 + [Replicate()]
    grads = backward_rule(spec, EXPERTS)[: spec.n_args]  # x, w1, w3, w2, router
    assert grads == [Shard(0)] * 4 + [Partial()]
    assert backward_rule(spec, ROWS)[: spec.n_args] == [Shard(0)] + [Partial()] * 4


class _WithBuffer(autopar.Region):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def compute(self, x: Tensor) -> Tensor:
        return x * self.scale

    def outputs_like(self, x: Tensor) -> Tensor:
        return x.new_empty(x.shape)


def test_region_with_a_buffer_is_refused() -> None:
    with pytest.raises(TypeError, match="cannot hold buffers.*Fix"):
        _WithBuffer()(torch.ones(2, 4))


def test_ep_pin_splits_a_regions_experts() -> None:
    # the parity case of tests/test_sequence_parallel.py: tiny experts would rather be
    # gathered than reached by all-to-all, but an "ep" axis runs the region expert-parallel
    model = build("tiny-dropless")
    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("dp", "ep"))
    plan = autopar.plan(model, example_batch(model, 8), cluster=cluster, strategy=("dp", "ep"))
    text = summary(plan)
    assert "ep: EP expert weights 6/6, EP regions 2 (all-to-all per step" in text, text
    assert "all_gather" not in text, text  # no expert weight gathered
