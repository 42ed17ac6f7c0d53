"""Models beyond decoder-only language models train with single-device parity.

* A ResNet-style CNN with BatchNorm (``samples/cnn.py``): the running statistics and batch
  counters are state the step updates, and batch-sharded BatchNorm uses the global batch's
  statistics (SyncBatchNorm semantics), so loss, gradients, parameters *and buffers* match
  one device.
* A ViT (``samples/vit.py``, patch-embedding convolution + encoder) and an encoder-decoder
  with cross-attention (``samples/encdec.py``).
* A Hugging Face GPT-2 (``tests/models/hf_gpt2.py``) with dropout 0.1 on the embeddings,
  the attention probabilities and both residual branches: a sharded random op draws the
  whole tensor and keeps its shard (``passes.strategies.rules.random_ops``), so every mask
  is the single-device run's and dropout trains with exact parity under data and tensor
  parallelism.
* A mixture-of-experts layer that dispatches with ``F.one_hot``: the index-range check
  ``one_hot`` inserts (``aten._assert_async.msg``) is dropped at capture, never reaching a rank.
* A Hugging Face Mixtral (``tests/models/hf_mixtral.py``) with its experts as gathers and
  batched matmuls (``_experts_implementation = "batched_mm"``); with Hugging Face's default
  (an opaque custom op) planning stops with the op, its line and that setting as the fix.
* A Hugging Face BERT (``tests/models/hf_families.py``): an encoder with a tied masked-LM head,
  whose attention keys' bias has a gradient of float noise in both runs (compared against
  the step's gradient scale, ``testing.parity.GRAD_NOISE_FLOOR``).

All multi-process cases share one set of 4 ranks (tiny configs, 2 steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from autopar.capture import capture
from autopar.capture.export import RUNTIME_CHECKS
from autopar.testing.parity import ParityCase, run_parity

STEPS = 2
MOE = f"{Path(__file__).resolve()}:build_moe"
HF_GPT2 = "tests/models/hf_gpt2.py:build"
HF_MIXTRAL = "tests/models/hf_mixtral.py:build"
HF_FAMILIES = "tests/models/hf_families.py:build"


class OneHotMoE(nn.Module):
    """Top-1 routed experts computed densely and combined with a ``one_hot`` mask."""

    def __init__(self, dim: int = 16, experts: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(dim, experts)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) * 0.1)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.1)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        logits = self.router(x)  # [B, T, E]
        mask = F.one_hot(logits.argmax(-1), self.experts).to(x.dtype)
        gate = torch.softmax(logits, -1) * mask
        h = F.gelu(torch.einsum("btd,edh->bteh", x, self.w1))
        out = (torch.einsum("bteh,ehd->bted", h, self.w2) * gate.unsqueeze(-1)).sum(2)
        return F.mse_loss(self.out(out + x), y)


def build_moe(config_name: str = "tiny") -> OneHotMoE:
    return OneHotMoE()


def example_batch(model: OneHotMoE, batch_size: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(batch_size, 4, 16, generator=gen) for _ in range(2))
    return x, y


def test_one_hot_runtime_checks_are_dropped_at_capture() -> None:
    torch.manual_seed(0)
    model = build_moe()
    captured = capture(model, example_batch(model, 8))
    checks = [n for n in captured.gm.graph.nodes if n.target in RUNTIME_CHECKS]
    assert not checks
    # the condition the check computed (any(index >= num_classes)) is gone with it
    assert not [n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.any.dims]


def test_hf_gpt2_dropout_is_in_the_captured_step() -> None:
    """The parity case below would pass trivially with dropout off: the captured training
    step draws the embedding and residual masks, and attention drops probabilities."""
    from autopar.cli.sources import load_model

    model, batch = load_model(HF_GPT2, "tiny", 8)
    nodes = list(capture(model, batch).gm.graph.nodes)
    dropouts = [n for n in nodes if n.target == torch.ops.aten.native_dropout.default]
    # the embeddings' and the block's two residual branches' (one block)
    assert len(dropouts) == 3 and all(n.args[1] == 0.1 for n in dropouts)
    sdpa = [n for n in nodes if n.target == torch.ops.aten.scaled_dot_product_attention.default]
    assert len(sdpa) == 1 and all(n.args[4] == 0.1 for n in sdpa)


# dp, fsdp and dp x tp for the CNN (BatchNorm's statistics batch-sharded, running
# statistics compared); fsdp and dp x tp (its dp axis the plain data parallelism) for the ViT
# and the encoder-decoder; the one-hot MoE and GPT-2 with
# dropout under dp x tp. Cases of one model share its capture in each rank. The CNN's fsdp
# runs beside tp: under fsdp on 4 ranks the gradient of the convolution feeding BatchNorm
# (whose backward cancels most of it) differs from one device's by ~1e-5 of its largest
# entry, the tolerance's edge; on 2 x 2 by 3e-6.
ONE_D, TWO_D = ((4,), ("dp",)), ((2, 2), ("dp", "tp"))
STRATEGIES = {
    "cnn": ((*ONE_D, "dp"), (*TWO_D, ("fsdp", "tp")), (*TWO_D, ("dp", "tp"))),
    "vit": ((*ONE_D, "fsdp"), (*TWO_D, ("dp", "tp"))),
    "encdec": ((*ONE_D, "fsdp"), (*TWO_D, ("dp", "tp"))),
}
CASES = [
    ParityCase(sample, mesh, names, strategy, steps=STEPS)
    for sample, runs in STRATEGIES.items()
    for mesh, names, strategy in runs
] + [
    ParityCase(MOE, *TWO_D, ("dp", "tp"), steps=STEPS),
    ParityCase(HF_GPT2, *TWO_D, ("dp", "tp"), steps=STEPS),
    ParityCase(HF_MIXTRAL, *TWO_D, ("dp", "tp"), config="batched_mm", steps=STEPS),
    ParityCase(HF_FAMILIES, *TWO_D, ("dp", "tp"), config="bert", steps=STEPS),
]


@pytest.fixture(scope="module")
def results():
    return {r.label: r for r in run_parity(CASES)}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", CASES, ids=[c.label.rsplit("/", 1)[-1] for c in CASES])
def test_parity(case: ParityCase, results) -> None:
    res = results[case.label]
    assert res.error is None, res.error
    assert len(res.losses) == STEPS
    assert res.loss_rel_err <= 1e-5, res
    assert res.grad_err <= 1e-5, res
    assert res.param_err <= 1e-3 * STEPS, res  # AdamW's lr bounds float noise per step
    assert res.buffer_err <= 1e-5, res  # running statistics and counters


@pytest.mark.multiproc
def test_batch_norm_statistics_are_global(results) -> None:
    """Under data parallelism the statistics are the global batch's (DDP's local ones
    differ), so the running statistics match one device's."""
    res = results[CASES[0].label]
    assert res.roles == {"dp": "dp"}, res.roles
    assert res.buffer_err <= 1e-5 < res.ddp_param_err, res


def test_hugging_face_moe_names_its_fix() -> None:
    """Hugging Face's default experts run `transformers::grouped_mm_fallback` (a custom op
    no strategy covers): the error names the setting under which the same model plans."""
    import autopar
    from autopar.cli.sources import load_model
    from autopar.passes.strategies.from_dtensor import UnsupportedOpError

    model, batch = load_model(HF_MIXTRAL, "grouped_mm", 8)
    cluster = autopar.Cluster.preset("cpu", mesh=(4,))
    with pytest.raises(UnsupportedOpError, match=r"(?s)grouped_mm_fallback.*moe\.py.*batched_mm"):
        autopar.plan(model, batch, cluster=cluster)
