"""Mixed precision (FSDP2's policy): bf16/fp16 compute, fp32 master, gradients reduced in
`reduce_dtype`, fp16 dynamic loss scaling; and a bf16 model trained as it is.

Parity (gloo processes: 2 for 1-D meshes, 4 for 2-D; one spawn per size): GPT and Llama samples under dp, tp and
a pipeline, 3 AdamW steps, against
* the single-device reference applying the same casts (`testing.reference`, parameters and
  floating inputs cast, fp32 gradients into the fp32 master): loss <= 1e-2 relative (under
  3 bf16 ulps: the loss itself is a bf16 value whose reduction order differs), gradient
  shards <= 0.1 x max |g_ref| (bf16 partial sums rounded in another order), parameters
  <= 2 x lr x steps (Adam's float-noise bound of test_parity, doubled: in bf16 near-zero
  gradients flip sign often, and the two runs then step lr apart in opposite directions);
* the fp32 reference: loss <= 2e-2 relative, parameters <= 2 x lr x steps; and the loss
  must differ from fp32 by more than fp32 noise (1e-5): the step did compute in bf16.
What a rank holds for its parameters (ParallelModel) equals the memory model's breakdown
(`cost_models.memory.param_state_breakdown`) within AdamW's step counters.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cluster import Cluster
from autopar.testing.parity import (
    LR,
    ParityCase,
    ParityResult,
    Tolerance,
    check,
    held_mismatches,
    run_parity,
    summary,
)

STEPS = 3
PARAM_TOL = 2 * LR * STEPS
SAME_CASTS = Tolerance(loss=1e-2, grad=0.1, param=PARAM_TOL)

CASES = [
    ParityCase("gpt", (2,), ("dp",), "dp", mixed_precision="bf16"),
    ParityCase("gpt", (2,), ("tp",), "tp", mixed_precision="bf16"),
    ParityCase("llama", (2, 2), ("dp", "tp"), ("dp", "tp"), mixed_precision="bf16"),
    ParityCase(
        "llama",
        (2, 2),
        ("pp", "dp"),
        "dp",
        config="tiny4",
        schedule="1f1b",
        microbatches=4,
        mixed_precision="bf16",
    ),
    ParityCase("gpt", (2,), ("dp",), "fsdp", mixed_precision="fp16"),
]


@pytest.mark.multiproc
def test_mixed_precision_matches_references() -> None:
    check(CASES, run_parity(CASES), SAME_CASTS, _fp32_and_held)


def _fp32_and_held(case: ParityCase, res: ParityResult) -> list[str]:
    """Against the fp32 reference; what a rank holds (ParallelModel) is what is priced."""
    failures = []
    if not 1e-5 < res.fp32_loss_rel_err <= 2e-2 or res.fp32_param_err > PARAM_TOL:
        failures.append(f"fp32 tolerance exceeded (or no low-precision compute): {summary(res)}")
    if case.schedule is None:
        failures += held_mismatches(res)
    return failures


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).square().mean()


def _plan(model, **kw):
    cluster = Cluster.preset("cpu", mesh=(2,), axis_names=("dp",))
    return autopar.plan(model, (torch.randn(4, 8),), cluster=cluster, strategy="dp", **kw)


def test_policy_is_recorded_and_captured_in_the_compute_dtype() -> None:
    plan = _plan(_Tiny(), mixed_precision="bf16", reduce_dtype="bfloat16")
    m = plan.memory
    assert (m.param_dtype, m.reduce_dtype, m.loss_scaling) == ("bfloat16", "bfloat16", False)
    assert {t.dtype for t in plan.tensors} == {"bfloat16"}  # params and the float input
    fp16 = _plan(_Tiny(), mixed_precision="fp16").memory
    assert (fp16.param_dtype, fp16.reduce_dtype, fp16.loss_scaling) == (
        "float16",
        "float32",
        True,
    )
    assert _plan(_Tiny()).memory.param_dtype is None


def test_policy_wants_the_fp32_model() -> None:
    with pytest.raises(ValueError, match="hand over the fp32 model"):
        _plan(_Tiny().to(torch.bfloat16), mixed_precision="bf16")


def test_the_search_prices_parameters_as_they_run() -> None:
    """A bf16 model trains in bf16 (no master: 2 B param + grad + 2 AdamW states); the policy
    (captured in bf16) holds the fp32 master, its bf16 cast, an fp32 gradient and fp32
    states; ZeRO-2 splits master, states and gradient over the replicas."""
    from autopar.capture import capture
    from autopar.options import PlanOptions
    from autopar.passes.strategies import NodeStrategy
    from autopar.search.costs import CostContext
    from autopar.search.pins import SearchOptions

    captured = capture(_Tiny().to(torch.bfloat16), (torch.randn(4, 8).bfloat16(),))
    weight = next(n for n in captured.gm.graph.nodes if n.name in captured.params)
    rep = NodeStrategy((), ((Replicate(),),))
    cluster = Cluster.preset("cpu", mesh=(2,), axis_names=("dp",))
    numel = weight.meta["val"].numel()
    for options, per_element in [
        (PlanOptions(), 2 * 4),
        (PlanOptions(mixed_precision="bf16"), 4 + 2 + 4 + 8),
        (
            PlanOptions(mixed_precision="bf16", shard_optimizer=True, shard_gradients=True),
            2 + (4 + 12) / 2,
        ),
    ]:
        search = SearchOptions.from_options(options)
        ctx = CostContext(
            cluster,
            shard_optimizer=search.shard_optimizer,
            shard_gradients=search.shard_gradients,
            mixed_precision=search.mixed_precision,
        )
        assert ctx.node_memory(weight, rep) == numel * per_element, options


def test_gradient_reductions_are_priced_in_reduce_dtype() -> None:
    """DP's all-reduce of a bf16-captured weight's gradient moves fp32 under the default
    reduce_dtype: twice the bytes of the bf16 value, nothing changes forward."""
    from autopar.capture import capture
    from autopar.capture.operands import tensor_operands
    from autopar.passes.strategies import NodeStrategy
    from autopar.search.costs import CostContext

    captured = capture(_Tiny().to(torch.bfloat16), (torch.randn(4, 8).bfloat16(),))
    addmm = next(n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.addmm.default)
    pos, bias = next(
        (p, op) for p, op in tensor_operands(addmm) if op.producer.name in captured.params
    )
    cluster = Cluster.preset("cpu", mesh=(2,), axis_names=("dp",))
    r, s0 = (Replicate(),), (Shard(0),)
    dp = NodeStrategy((r, s0, r), (s0,))  # batch-split addmm: the weight's grad is Partial
    parts = [
        CostContext(cluster, reduce_itemsize=size).edge_parts(bias, r, addmm, dp, pos)
        for size in (None, 4)
    ]
    assert parts[0][0] == parts[1][0] == 0.0
    assert parts[1][1] > parts[0][1] > 0.0
