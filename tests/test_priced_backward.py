"""The backward runs the moves the search priced, not ones DTensor picks on its own.

The search prices each node's backward from its gradient arriving in the node's output
placement with Partials made Replicate (`CostContext._grad_source`) and each edge's gradient
moved back to its producer's placement. DTensor, left alone, keeps a gradient Partial as far
as its ops allow and lets each backward op choose how to move what arrives (a Llama under
tp gathered weights and reduce-scattered [batch, seq, ffn] activations that no edge priced:
its step ran 1.4x the prediction). Lowering pins each node's gradient to that placement
(`passes.lower.pin_gradient`); here every lowering records the moves DTensor picks itself
(its implicit redistributions): none but the loss's scalar count of targets (nll_loss's
`total_weight`, Partial over dp, read whole by its backward: one scalar's latency).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist

import autopar
from autopar._compat import FakeStore, implicit_redistributions
from autopar.cli.sources import load_model
from autopar.options import PlanOptions
from autopar.passes import lower
from autopar.rank_plans import plan_for_ranks
from autopar.runtime.parallel_model import ParallelModel

PLANS = {
    "tp": ((4,), ("tp",), "tp"),
    "dp x tp": ((2, 2), ("dp", "tp"), ("dp", "tp")),
    "fsdp x tp": ((2, 2), ("dp", "tp"), ("fsdp", "tp")),
}


@pytest.fixture(scope="module")
def fake_group() -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def _unpriced_moves(sample: str, plan_name: str) -> list:
    shape, names, strategy = PLANS[plan_name]
    model, batch = load_model(sample, "tiny", 8, seed=0)
    cluster = autopar.Cluster.local(mesh=shape, axis_names=names)
    options = PlanOptions(strategy=strategy, activation_checkpointing="none")
    plan, captured, mesh = plan_for_ranks(model, batch, cluster, None, options, None)
    with implicit_redistributions() as moves:
        ParallelModel(model, captured, plan, mesh)
    return [m for m in moves if m[1] != ()]


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("sample", ["llama", "gpt"])
def test_every_backward_move_is_one_the_plan_makes(fake_group, sample, plan_name) -> None:
    assert _unpriced_moves(sample, plan_name) == []


def test_unpinned_gradients_make_dtensor_move_on_its_own(fake_group, monkeypatch) -> None:
    # the check above can fail: without the pins, Llama's tp backward reduce-scatters a
    # Partial gradient DTensor kept unreduced
    monkeypatch.setattr(lower, "pin_gradient", lambda out: out)
    moves = _unpriced_moves("llama", "tp")
    assert any("backward" in message for message, *_ in moves), moves
