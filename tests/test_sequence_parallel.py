"""Sequence parallelism (Megatron-SP) is found by the search and trains like one device.

- Planning only (fake process group, meta device): Llama-3-8B's layers at a long sequence on
  one DGX-H100 node with TP=8; the search, not a pin, puts every RMSNorm (decomposed:
  ``x * rsqrt(mean(x**2) + eps)``) on the sequence dim, so `inspect` names the axis
  "tp+sp" and lists the reduce-scatter / all-gather traffic.
- Parity (4 gloo processes, one spawn for SP and context parallelism): ``strategy="sp"``
  pins TP with sequence-sharded norms, TP = 2 (x DP 2) for an RMSNorm model (Llama) and
  TP = 4 for a LayerNorm one (GPT); context parallelism splits attention on the sequence,
  ``"cp-gather"`` with all-gathered K/V and ``"cp-ring"`` with ring attention (K/V blocks
  passed around the axis, ``rules.ring``): all-gathered K/V with CP = 2 x DP 2, causal (Llama)
  and non-causal (the encoder of ``tests/test_context_parallel.py``); ring attention on the
  encoder's "tiny-mixed" config (a non-causal block then a causal one) with CP = 2 x DP 2 and
  CP = 4 under full activation checkpointing; ``strategy="ep"`` splits
  tokens and stacked expert weights (``samples/moe.py``), EP = 4 (top-2, shared expert),
  EP = 2 x DP 2 (top-1), and EP x TP+SP (top-2; the expert axis must show "dp+ep"); the
  drop-less MoE (a region, ``samples/_moe_dropless.py``, top-2) under EP = 2 x DP 2 (its
  all-to-alls inside the region, on the second axis's process group).
  Losses, gradients and parameters match the single-device run (which drops the same
  tokens: routing is the same computation).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import autopar
from autopar.cluster import Cluster
from autopar.plan import MemoryPlan
from autopar.testing.parity import LR, ParityCase, ParityResult, Tolerance, check, run_parity
from autopar.views import axis_roles, summary
from autopar.views.describe import seq_sharded_norms
from samples.llama import Llama, LlamaConfig, example_batch

STEPS = 3
TOL = Tolerance(loss=1e-5, grad=1e-5, param=LR * STEPS)  # test_parity's

ENCODER = "tests/test_context_parallel.py:build_encoder"
MIXED = "tiny-mixed"  # a non-causal then a causal block: both ring paths in one case
# full recompute re-runs the ring's forward passes in backward (every rank the same passes)
FULL_AC = MemoryPlan(recompute=(("blocks.0", "full"), ("blocks.1", "full")))
CASES = {  # case -> the role the plan's last axis must show
    ParityCase("llama", (2, 2), ("dp", "tp"), ("dp", "sp"), steps=STEPS): "tp+sp",
    ParityCase("gpt", (4,), ("tp",), "sp", steps=STEPS): "tp+sp",
    ParityCase("llama", (2, 2), ("dp", "cp"), ("dp", "cp-gather"), steps=STEPS): "cp",
    ParityCase(ENCODER, (2, 2), ("dp", "cp"), ("dp", "cp-gather"), steps=STEPS): "cp",
    ParityCase(ENCODER, (2, 2), ("dp", "cp"), ("dp", "cp-ring"), config=MIXED, steps=STEPS): "cp",
    ParityCase(ENCODER, (4,), ("cp",), "cp-ring", config=MIXED, steps=STEPS, memory=FULL_AC): "cp",
    ParityCase("moe", (4,), ("ep",), "ep", config="tiny-shared", steps=STEPS): "dp+ep",
    ParityCase("moe", (2, 2), ("dp", "ep"), ("dp", "ep"), config="tiny-top1", steps=STEPS): "dp+ep",
    ParityCase("moe", (2, 2), ("ep", "tp"), ("ep", "sp"), steps=STEPS): "tp+sp",
    ParityCase(
        "moe", (2, 2), ("dp", "ep"), ("dp", "ep"), config="tiny-dropless", steps=STEPS
    ): "dp+ep",
}


def test_long_sequence_tp8_shards_every_norm_on_the_sequence() -> None:
    # Llama-3-8B's width, heads and vocabulary; 2 of its 32 identical blocks keep this fast
    cfg = dataclasses.replace(LlamaConfig.llama3_8b(), max_seq_len=32768, n_layers=2)
    with torch.device("meta"):
        model = Llama(cfg)
    batch = example_batch(cfg, 1, device="meta")
    cluster = Cluster.preset("dgx-h100", nodes=1)
    plan = autopar.plan(model, batch, cluster=cluster, strategy="tp")
    assert axis_roles(plan) == ["tp+sp"], summary(plan)
    norms = [n for n in plan.nodes if n.op == "rsqrt.default"]
    assert len(norms) == 2 * cfg.n_layers + 1
    assert seq_sharded_norms(plan, 0) == norms, summary(plan)
    assert plan.predicted_peak_memory <= cluster.device.memory_bytes
    text = summary(plan)
    assert "gpu: SP norms 5/5" in text and "reduce_scatter" in text, text


@pytest.mark.multiproc
def test_sequence_context_and_expert_parallel_match_single_device() -> None:
    cases = list(CASES)
    check(cases, run_parity(cases), TOL, _expected_roles)


def _expected_roles(case: ParityCase, res: ParityResult) -> list[str]:
    failures = []
    axis, role = case.axis_names[-1], CASES[case]
    if res.roles[axis] != role:
        failures.append(f"{res.label}: axis {axis} plays {res.roles[axis]}, not {role}")
    if "ep" in case.axis_names and res.roles["ep"] != "dp+ep":
        failures.append(f"{res.label}: axis ep plays {res.roles['ep']}, not dp+ep")
    return failures
