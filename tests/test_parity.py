"""End-to-end parity: every strategy family trains like the single-device model.

For each sample (MLP, GPT with tied head, Llama with GQA/RoPE/SwiGLU), on gloo processes,
on meshes (2,) as dp, (2,) as tp and (2, 2) as dp x tp, the plan the search picks and the
forced plans (pure DP, ZeRO-3/FSDP, Megatron TP, their 2-D combinations) train 3 AdamW steps.

Tolerances (fp32): loss relative error <= 1e-5; gradient shards: max |g - g_ref| <= 1e-5 x
max |g_ref| per parameter and step; parameters after 3 AdamW steps: <= lr x steps. The last
is the float-noise yardstick for Adam: it divides by sqrt(v), so a near-zero gradient whose
sign flips in the last bit moves a parameter by up to ~lr per step under *any*
parallelization -- torch's own DDP included, whose deviation on the same model and batch is
measured in the same run, reported beside ours and held to the same bound (the yardstick
must itself stay inside it).

The ranks run on the backend the environment picks (`autopar.testing.parity.test_backend`:
`AUTOPAR_TEST_BACKEND`, else NCCL when there is a GPU per rank, else gloo); the `multigpu`
test runs the same cases on NCCL, one GPU per rank, and is skipped only without 4 GPUs.
"""

from __future__ import annotations

import pytest
import torch

from autopar.testing.parity import (
    LR,
    ParityCase,
    ParityResult,
    Tolerance,
    check,
    run_parity,
    summary,
)

STEPS = 3
WORLD = 4
TOL = Tolerance(loss=1e-5, grad=1e-5, param=LR * STEPS)

CASES = [  # one-dimensional meshes on 2 ranks (half the CPU of 4 on CI's 2 cores), 2-D on 4
    ((2,), ("dp",), "auto"),
    ((2,), ("dp",), "dp"),
    ((2,), ("dp",), "fsdp"),
    ((2,), ("tp",), "auto"),
    ((2,), ("tp",), "tp"),
    ((2, 2), ("dp", "tp"), "auto"),
    ((2, 2), ("dp", "tp"), ("dp", "tp")),
    ((2, 2), ("dp", "tp"), ("fsdp", "tp")),
]

EXPECTED_ROLES = {"dp": "dp", "fsdp": "fsdp", "tp": "tp"}


SAMPLES = ("mlp", "gpt", "llama")


@pytest.mark.multiproc
@pytest.mark.parametrize("sample", SAMPLES)
def test_every_strategy_matches_single_device(sample: str) -> None:
    cases = parity_cases(sample)
    check(cases, run_parity(cases), TOL, _yardstick_and_roles)


@pytest.mark.multiproc
@pytest.mark.multigpu
@pytest.mark.skipif(
    torch.cuda.device_count() < WORLD,
    reason=f"NCCL parity needs {WORLD} GPUs (one per rank); "
    f"this machine has {torch.cuda.device_count()}",
)
@pytest.mark.parametrize("sample", SAMPLES)
def test_every_strategy_matches_single_device_on_nccl(sample: str) -> None:
    cases = parity_cases(sample)
    check(cases, run_parity(cases, backend="nccl"), TOL, _yardstick_and_roles)


def parity_cases(sample: str) -> list[ParityCase]:
    return [ParityCase(sample, mesh, names, strat, steps=STEPS) for mesh, names, strat in CASES]


def _yardstick_and_roles(case: ParityCase, res: ParityResult) -> list[str]:
    """DDP's own deviation stays inside the parameter bound; forced axes play their role."""
    failures = []
    if not 0 <= res.ddp_param_err <= LR * STEPS:
        failures.append(f"DDP's own deviation is outside the bound: {summary(res)}")
    forced = (case.strategy,) * len(case.mesh) if isinstance(case.strategy, str) else case.strategy
    for axis, role in zip(case.axis_names, forced, strict=True):
        if role != "auto" and res.roles[axis] != EXPECTED_ROLES[role]:
            failures.append(f"{res.label}: axis {axis} plays {res.roles[axis]}, not {role}")
    return failures
