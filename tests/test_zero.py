"""ZeRO-1 / ZeRO-2 at run time (`shard_optimizer=`, `shard_gradients=` on compile).

Gradients are reduce-scattered in backward over each parameter's replicated axes into a flat
shard, the master and the AdamW state are flat shards updated locally, then all-gathered
into the parameters (`passes.precision`, `runtime.optimizer`). On gloo processes (2 for
1-D meshes, 4 for 2-D), 3 AdamW steps on GPT and Llama under dp, fsdp x tp and dp x tp:
the same tolerances as test_parity against the unsharded single-device optimizer (loss
<= 1e-5 relative, flat gradient shards <= 1e-5 x max |g_ref|, parameters <= lr x steps),
the bf16 policy combined with ZeRO at test_precision's. What a rank holds for its parameters
equals `cost_models.memory.param_state_breakdown` (ZeRO-2 holds no full-size gradient).
Pipelines (pp x dp, interleaved 1F1B and GPipe, ZeRO-1 and ZeRO-2 with the bf16 policy)
reduce-scatter each stage's gradients from its last backward, at the same tolerances.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar.capture import capture
from autopar.rank_plans import check_plan_matches
from autopar.testing.parity import (
    LR,
    ParityCase,
    ParityResult,
    Tolerance,
    check,
    held_mismatches,
    run_parity,
)

STEPS = 3
FP32_TOL = Tolerance(loss=1e-5, grad=1e-5, param=LR * STEPS)
BF16_TOL = Tolerance(loss=1e-2, grad=0.1, param=2 * LR * STEPS)  # test_precision's

CASES = [
    ParityCase("gpt", (2,), ("dp",), "dp", shard_optimizer=True),
    ParityCase("gpt", (2,), ("dp",), "dp", shard_optimizer=True, shard_gradients=True),
    ParityCase(
        "llama", (2, 2), ("dp", "tp"), ("dp", "tp"), shard_optimizer=True, shard_gradients=True
    ),
    ParityCase("gpt", (2, 2), ("dp", "tp"), ("fsdp", "tp"), shard_optimizer=True),
    ParityCase(
        "llama",
        (4,),
        ("dp",),
        "dp",
        mixed_precision="bf16",
        shard_optimizer=True,
        shard_gradients=True,
    ),
]
# pipelined: one reduce-scatter per stage and step, from its last backward (runtime.stage_grads)
PIPELINED = [
    ParityCase(
        "gpt",
        (2, 2),
        ("pp", "dp"),
        "dp",
        config="tiny4",
        schedule="interleaved1f1b",  # two stages a rank: each reduce-scatters at its end
        microbatches=2,
        shard_optimizer=True,
    ),
    ParityCase(
        "llama",
        (2, 2),
        ("pp", "dp"),
        "dp",
        config="tiny4",
        schedule="gpipe",
        microbatches=2,
        mixed_precision="bf16",
        shard_optimizer=True,
        shard_gradients=True,
    ),
]
CASES += PIPELINED


@pytest.mark.multiproc
def test_zero_matches_the_unsharded_optimizer() -> None:
    check(CASES, run_parity(CASES), _tolerance, _held)


def _tolerance(case: ParityCase) -> Tolerance:
    return BF16_TOL if case.mixed_precision else FP32_TOL


def _held(case: ParityCase, res: ParityResult) -> list[str]:
    """What a rank holds is what the memory model prices; ZeRO-2 no full-size gradient."""
    failures = held_mismatches(res)
    if res.late_syncs:  # a pipeline stage's reduce-scatter goes out at its last backward
        failures.append(f"{res.label}: {res.late_syncs} reductions after the schedule")
    if case.shard_gradients and res.held and res.held["gradients"] >= res.held["parameters"]:
        failures.append(f"{res.label}: ZeRO-2 holds a full-size gradient: {res.held}")
    return failures


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).square().mean()


def test_zero_plans_are_recorded_and_accepted() -> None:
    """plan.memory carries ZeRO; a saved ZeRO plan passes compile's check (it used to be
    refused as plan-only)."""
    model, batch = _Tiny(), (torch.randn(4, 8),)
    cluster = autopar.Cluster.preset("cpu", mesh=(2,), axis_names=("dp",))
    zero2 = {"shard_optimizer": True, "shard_gradients": True}
    plan = autopar.plan(model, batch, cluster=cluster, strategy="dp", **zero2)
    assert plan.memory.shard_optimizer and plan.memory.shard_gradients
    check_plan_matches(plan, capture(model, batch), cluster)
    with pytest.raises(ValueError, match="add shard_optimizer=True"):
        autopar.plan(model, batch, cluster=cluster, shard_gradients=True)


def test_flat_shard_layout() -> None:
    """N local elements padded to a multiple of the replicas; Shard(0) on replicated axes."""
    from torch.distributed.tensor import Replicate, Shard

    from autopar.passes.precision import flat_length, flat_spec

    assert flat_length(10, (Replicate(), Shard(0)), (4, 2)) == 12
    assert flat_length(12, (Replicate(), Replicate()), (2, 2)) == 12
    assert flat_length(7, (Shard(0),), (4,)) == 7
    assert flat_spec((Replicate(), Shard(1))) == (Shard(0), Replicate())
