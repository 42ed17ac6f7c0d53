"""A mean cross-entropy over a padded batch (targets `ignore_index` on the padding, spread
unevenly over the rows) trains like the single-device model on every layout: the loss a
step returns, the gradients and the updated parameters. DTensor's rule averages the ranks'
means (`Partial("avg")`) and the pipelines weighted each microbatch's mean by its rows:
both right only where every rank and microbatch counts as many targets
(`passes.loss_weight.global_mean_loss`, `runtime.loss_shares`)."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import capture
from autopar.cli.sources import load_model
from autopar.runtime.loss_shares import loss_shares, target_counter, weighted_mean_loss
from autopar.testing.parity import LR, ParityCase, Tolerance, check, run_parity

SOURCE = "tests/models/padded_gpt.py:build"
STEPS = 2
TOL = Tolerance(loss=1e-5, grad=1e-5, param=LR * STEPS)
PIPE = dict(config="tiny4", steps=STEPS, schedule="1f1b")
EMPTY = {**PIPE, "config": "tiny4-empty"}
WEIGHTED = {**PIPE, "config": "tiny4-weighted"}


@pytest.mark.multiproc
def test_a_padded_batch_trains_like_one_device() -> None:
    cases = [
        ParityCase(SOURCE, (2,), ("dp",), "dp", steps=STEPS),
        ParityCase(SOURCE, (2,), ("dp",), "fsdp", steps=STEPS),
        # averaged over two axes in turn: one all-reduce per axis, the count's alike
        ParityCase(SOURCE, (2, 2), ("dp", "fsdp"), ("dp", "fsdp"), steps=STEPS),
        ParityCase(SOURCE, (2, 2), ("pp", "dp"), "dp", microbatches=2, **PIPE),
        # microbatches of 3, 3 and 2 rows: two schedule runs, each its own graph
        ParityCase(SOURCE, (2, 2), ("pp", "dp"), "dp", microbatches=3, **PIPE),
        # gradient accumulation (a pipeline on a "pp" axis of 1)
        ParityCase(SOURCE, (1, 2), ("pp", "dp"), "dp", microbatches=2, **PIPE),
        # a rank, and a microbatch, without any target: it adds nothing (its mean is 0/0)
        ParityCase(SOURCE, (2,), ("dp",), "dp", config="tiny-empty", steps=STEPS),
        ParityCase(SOURCE, (2, 2), ("pp", "dp"), "dp", microbatches=2, **EMPTY),
        # a class-weighted mean divides by its targets' weights: the microbatches' shares too
        ParityCase(SOURCE, (2, 2), ("pp", "dp"), "dp", microbatches=3, **WEIGHTED),
        ParityCase(SOURCE, (1, 2), ("pp", "dp"), "dp", microbatches=2, **WEIGHTED),
    ]
    check(cases, run_parity(cases), TOL)


def test_the_ranks_and_microbatches_count_different_targets() -> None:
    # what makes the cases above worth running: rows' shares would weigh them wrong
    _, (_, targets) = load_model(SOURCE, "tiny", 8)
    counted = (targets != -100).sum(dim=1)
    assert counted[:4].sum() != counted[4:].sum()  # the two dp halves
    assert len({int(c) for c in counted}) == 8


def test_microbatch_shares_follow_the_counted_targets() -> None:
    model, batch = load_model(SOURCE, "tiny", 8)
    rows = [4, 4]
    halves = [tuple(t[:4] for t in batch), tuple(t[4:] for t in batch)]
    counter = target_counter(capture(model, halves[0]))
    assert counter is not None
    counts = [float((b[1] != -100).sum()) for b in halves]
    assert [float(counter(b)) for b in halves] == counts
    shares = loss_shares(rows, [counter], [halves])
    torch.testing.assert_close(shares, torch.tensor(counts) / sum(counts), rtol=0, atol=0)
    # no counter (a loss that is not a mean NLL): each microbatch's rows
    torch.testing.assert_close(loss_shares(rows, [None], [halves]), torch.tensor([0.5, 0.5]))


def test_shifted_labels_are_counted_as_the_loss_reads_them() -> None:
    # Hugging Face pads the labels by one ignored token and shifts them (`view(-1)` of the
    # slice, replayed as `reshape`): each row counts all its tokens but the first
    model, batch = load_model("tests/models/hf_families.py:build", "llama:4", 4)
    counter = target_counter(capture(model, batch))
    assert counter is not None
    rows, seq = batch[-1].shape
    assert float(counter(batch)) == rows * (seq - 1)


def test_a_class_weighted_mean_counts_its_targets_weights() -> None:
    # cross_entropy(weight=w) divides by w[target] summed over the counted targets: the
    # counter reads w from the captured buffers (a microbatch's share, not its rows)
    model, batch = load_model(SOURCE, "tiny-weighted", 8)
    captured = capture(model, batch)
    state = {name: model.get_buffer(fqn) for name, fqn in captured.buffers.items()}
    counter = target_counter(captured, state)
    assert counter is not None
    targets = batch[1]
    kept = targets != -100
    expected = model.class_weight[targets[kept]].double().sum()
    torch.testing.assert_close(counter(batch), expected)
    assert target_counter(captured) is None  # its weight unknown: rows, as before


def test_class_weights_read_from_a_parameter_are_not_counted() -> None:
    # weights computed from a parameter (detached: a loss takes no gradient in its weight)
    # move every step: not read ahead (the pipeline warns that its microbatches weigh by
    # rows, `PipelineModel`)
    model, batch = load_model(SOURCE, "tiny-weighted", 8)
    model.learned = torch.nn.Parameter(model.class_weight.clone())
    model.class_weight = None

    def forward(idx, targets):
        logits = model.logits(idx).view(-1, model.config.vocab_size)
        weight = model.learned.detach().exp()
        return torch.nn.functional.cross_entropy(logits, targets.view(-1), weight=weight)

    model.forward = forward
    captured = capture(model, batch)
    assert weighted_mean_loss(captured)
    state = dict(model.named_parameters())
    known = {name: state[fqn] for name, fqn in captured.params.items()}
    assert target_counter(captured, known) is None
    plain, plain_batch = load_model(SOURCE, "tiny", 8)
    assert not weighted_mean_loss(capture(plain, plain_batch))
