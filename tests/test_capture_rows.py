"""One trace for every microbatch size (`autopar.capture.rows`) gives the graphs tracing gives.

The layout search captures a template at every microbatch count's rows; `AnyRows` exports
the model once with the batch dim symbolic and evaluates the graph at each size. The graph
it makes at a size must be the one `torch.export` traces at that size: the same nodes,
names, ops, arguments, shapes and metadata, the same fingerprint, at one row too. Where
that cannot hold (a model that does not export with a symbolic batch, an op that drops a
dim of one row, rows above the first call's) it traces as given.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.capture import capture
from autopar.capture.rows import AnyRows, at_rows, shapes_hold
from autopar.capture.template import capture_template
from samples import SAMPLES
from tests.test_expand import _assert_same_graph, _hf_gpt2, _Residual


def _rows(batch, rows: int) -> tuple:
    return tuple(t[:rows] if t.ndim else t for t in batch)


def _sample(name: str, config: str = "tiny"):
    sample = SAMPLES[name]
    model = sample.build(config)
    return model, sample.example_batch(model, 8), None


CASES = {name: (lambda name=name: _sample(name)) for name in SAMPLES}
CASES["hugging face gpt2"] = lambda: _hf_gpt2(3, rows=8)
CASES["residual in the parent, loss_fn"] = lambda: (
    _Residual(3),
    (torch.randn(8, 16), torch.randint(0, 4, (8,))),
    lambda out, target: nn.functional.cross_entropy(out, target),
)


@pytest.mark.parametrize("case", CASES)
def test_the_graph_made_at_each_size_is_the_traced_one(case: str) -> None:
    model, batch, loss_fn = CASES[case]()
    tracer = AnyRows()
    for rows in (batch[0].shape[0], 2, 1):  # the first call exports, the others evaluate
        made = capture(model, _rows(batch, rows), loss_fn, tracer)
        _assert_same_graph(made, capture(model, _rows(batch, rows), loss_fn))
    assert tracer.traced is not None and not tracer.failed, "the symbolic export was refused"


def test_templates_at_each_size_are_the_traced_ones() -> None:
    model, batch, _ = _sample("llama", "tiny4")
    tracer = AnyRows()
    capture_template(model, batch, keep=2, tracer=tracer)  # exports at 8 rows
    made = capture_template(model, _rows(batch, 4), keep=2, tracer=tracer)
    traced = capture_template(model, _rows(batch, 4), keep=2)
    _assert_same_graph(made.captured, traced.captured)
    assert made.weights == traced.weights and made.total_layers == traced.total_layers
    # the whole model built from the made template is the whole model traced
    built = made.whole_model(model, _rows(batch, 4))
    _assert_same_graph(built, capture(model, _rows(batch, 4)))


class _FixedBatch(nn.Module):
    """A forward that hard-codes its batch size: it does not export with a symbolic one."""

    def __init__(self, rows: int):
        super().__init__()
        self.rows = rows
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x.view(self.rows, 2, 4)).sum()


def test_a_model_that_fixes_its_batch_is_traced_at_each_size() -> None:
    tracer = AnyRows()
    x = torch.randn(8, 8)
    made = capture(_FixedBatch(8), (x,), None, tracer)
    assert tracer.failed and tracer.traced is None
    _assert_same_graph(made, capture(_FixedBatch(8), (x,)))


class _Squeezes(nn.Module):
    """A graph that differs at one row: `squeeze(0)` drops the batch dim only there."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x.squeeze(0)).sum()


def test_a_graph_that_differs_at_one_row_and_rows_above_the_first_are_traced() -> None:
    model, tracer = _Squeezes(), AnyRows()
    x = torch.randn(4, 4)
    capture(model, (x,), None, tracer)
    assert tracer.traced is not None
    assert not shapes_hold(at_rows(tracer.traced, 1))  # the symbol was exported as >= 2
    one = capture(model, (x[:1],), None, tracer)
    assert one.loss_node.args[0].meta["val"].shape == (4,)
    _assert_same_graph(one, capture(model, (x[:1],)))
    more = torch.randn(6, 4)
    _assert_same_graph(capture(model, (more,), None, tracer), capture(model, (more,)))
