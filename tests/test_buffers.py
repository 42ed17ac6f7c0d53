"""Buffers the forward updates are state, not outputs.

* Capture records them (``Captured.mutated_buffers``, from torch.export's buffer mutations):
  the graph returns ``(loss, *new values)``, so a BatchNorm model's one scalar loss is the
  loss (it used to fail as "returns 7 outputs").
* The lowered program returns each rank's new local values, ``ParallelModel`` keeps them,
  and ``full_state_dict()`` returns them: after training steps they equal eager PyTorch's.
* ``eval()`` BatchNorm uses the running statistics (elementwise, nothing mutated).
* An in-place update of a user input is refused at capture with the fix.
* A pipeline is refused for such a model (per-microbatch BatchNorm statistics are not the
  batch's), with the fix, at planning time; so it is for a model that draws random numbers
  (dropout: the stages would repeat each other's masks).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import autopar
from autopar.capture import CaptureError, capture
from autopar.capture.batch_norm import STATS
from autopar.testing.reference import LR, train_single_device


class Counted(nn.Module):
    """Conv -> BatchNorm -> ReLU -> pool -> linear, plus buffers updated by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)  # a bias before BN has no gradient
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 5)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("feature_ema", torch.zeros(4))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = F.relu(self.bn(self.conv(x))).mean(dim=(2, 3))
        self.calls.add_(1)
        self.feature_ema.copy_(0.9 * self.feature_ema + 0.1 * h.detach().mean(0))
        return F.cross_entropy(self.head(h), y)


def batch() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 6, 6, generator=gen) * 2 + 1, torch.randint(0, 5, (4,), generator=gen)


BUFFERS = ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "calls", "feature_ema"]


def test_capture_records_buffer_mutations() -> None:
    torch.manual_seed(0)
    captured = capture(Counted(), batch())
    mutated = [captured.buffers[n] for n in captured.mutated_buffers]
    assert sorted(mutated) == sorted(BUFFERS)
    assert captured.loss_node.meta["val"].shape == ()
    out = next(n for n in captured.gm.graph.nodes if n.op == "output")
    assert out.args[0][0] is captured.loss_node
    assert list(captured.buffer_updates()) == captured.mutated_buffers
    # training-mode statistics are one per-channel reduction (the batch-sharded all-reduce)
    assert len([n for n in captured.gm.graph.nodes if n.target == STATS]) == 1


def test_eval_batch_norm_uses_running_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(1))
    x = torch.randn(4, 3, 6, 6)
    model(x)  # materialize the lazy layer; one update of the running statistics
    model.eval()
    captured = capture(model, (x,), loss_fn=lambda out: out.square().mean())
    assert captured.mutated_buffers == []
    assert not [n for n in captured.gm.graph.nodes if n.target == STATS]
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    names = {**captured.params, **captured.buffers}
    args = [state[names[p.name]] for p in captured.placeholders() if p.name in names]
    (loss,) = captured.gm(*args, x)
    torch.testing.assert_close(loss, model(x).square().mean())


class InPlaceInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        x.mul_(2)
        return self.lin(x).sum()


def test_in_place_update_of_an_input_is_refused() -> None:
    with pytest.raises(CaptureError, match=r"updates its input\(s\).*x = x \+ 1"):
        capture(InPlaceInput(), (torch.randn(2, 4),))


@pytest.fixture()
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_training_updates_buffers_like_eager(one_rank: None) -> None:
    """Two steps: the loss, parameters and every buffer (statistics, counters, the hand
    written moving average) as eager PyTorch has them, through full_state_dict()."""
    torch.manual_seed(0)
    model, data = Counted(), batch()
    ref = train_single_device(model, data, steps=2)
    pm = autopar.compile(
        model,
        data,
        cluster=autopar.Cluster.local(mesh=(1,), axis_names=("dp",)),
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
    )
    losses = [pm.step(*data) for _ in range(2)]
    assert losses == pytest.approx(ref.losses, rel=1e-5)
    full = pm.full_state_dict()
    assert set(BUFFERS) <= set(full)
    for name in BUFFERS:
        torch.testing.assert_close(full[name], ref.state[name], rtol=1e-5, atol=1e-6, msg=name)
    assert int(full["calls"]) == 2 and int(full["bn.num_batches_tracked"]) == 2
    assert float(model.calls) == 0  # the user's model is left as it was


def test_pipelines_refuse_models_that_update_buffers() -> None:
    """Microbatches would each normalize by their own BatchNorm statistics: the error says
    so and names the fix, before any process or weight is touched."""
    from autopar.cli.sources import load_model

    model, batch_ = load_model("cnn", "tiny", 8)
    cluster = autopar.Cluster.preset("cpu", mesh=(4,))
    with pytest.raises(ValueError, match=r"per-microbatch statistics.*pipeline_stages=1"):
        autopar.plan(model, batch_, cluster=cluster, pipeline_stages=2)


def test_pipelines_refuse_models_that_draw_random_numbers() -> None:
    """Each pipeline stage would draw its dropout masks on its own ranks, once per
    microbatch, from the generator state every rank starts the step in: the stages would
    repeat each other's masks. A pipeline asked for is refused with the op and the fix; the
    layout search leaves pipelines out (GPT-2's dropout, attention's included)."""
    from autopar.cli.sources import load_model
    from autopar.passes.strategies.rules.random_ops import random_draws

    model, batch_ = load_model("tests/models/hf_gpt2.py:build", "tiny", 8)
    draws = random_draws(capture(model, batch_).gm)
    assert {str(n.target) for n in draws} == {
        "aten.native_dropout.default",
        "aten.scaled_dot_product_attention.default",
    }
    cluster = autopar.Cluster.preset("cpu", mesh=(4,))
    with pytest.raises(
        ValueError, match=r"(?s)draws random numbers.*native_dropout.*pipeline_stages=1"
    ):
        autopar.plan(model, batch_, cluster=cluster, pipeline_stages=2)
    plan = autopar.plan(model, batch_, cluster=cluster, pipeline_stages="auto")
    assert plan.pipeline is None
