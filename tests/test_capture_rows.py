"""One trace for every microbatch size (`autopar.capture.rows`) gives the graphs tracing gives.

The layout search captures a template at every microbatch count's rows; `AnyRows` traces
the model at the batch's rows and at half of them (in a forked process), pairs the two
(`autopar.capture.affine_rows`: every size the same or on a line through them) and makes
the graph at each size; where they do not pair it exports the model once with the batch
dim symbolic and evaluates that graph. The graph it makes at a size must be the one
`torch.export` traces at that size: the same nodes, names, ops, arguments, shapes and
metadata, the same fingerprint, at one row too. Where that cannot hold (a model that
traces neither way with its batch free, an op that drops a dim of one row, a size the
batch clamps, rows above the first call's) it traces as given.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.capture import capture
from autopar.capture.rows import AnyRows, shapes_hold
from autopar.capture.template import capture_template
from samples import SAMPLES
from tests.test_expand import _assert_same_graph, _hf_gpt2, _Residual


def _rows(batch, rows: int) -> tuple:
    return tuple(t[:rows] if t.ndim else t for t in batch)


def _sample(name: str, config: str = "tiny"):
    sample = SAMPLES[name]
    model = sample.build(config)
    return model, sample.example_batch(model, 8), None


def _hf_llama(rows: int):
    """Hugging Face's Llama: its causal mask indexes the batch by `arange(rows)` (a Scalar
    end in the op's schema, a size all the same)."""
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_mixtral import SEQ, VOCAB, LanguageModelLoss

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    config._attn_implementation = "sdpa"
    model = LanguageModelLoss(transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, VOCAB, (rows, SEQ))
    return model, (ids, ids.clone()), None


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
    assert tracer.rows_of is not None, "the traces at 8 and 4 rows did not pair"


def test_a_batch_arange_pairs() -> None:
    """Hugging Face's Llama builds its causal mask from `arange(rows)` (whose end is a
    Scalar in the op's schema): the traces at 8 and 4 rows pair, and the graph made at 2
    rows is the one traced there. (At one row its mask code skips an `expand` in Python,
    every shape the same: the graph made there holds that one no-op more, which prices
    the same; a final plan's graph is checked against a trace anyway.)"""
    model, batch, loss_fn = _hf_llama(rows=8)
    tracer = AnyRows()
    for rows in (8, 2):
        made = capture(model, _rows(batch, rows), loss_fn, tracer)
        _assert_same_graph(made, capture(model, _rows(batch, rows), loss_fn))
    assert tracer.rows_of is not None, "the traces at 8 and 4 rows did not pair"


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


class _EveryOther(nn.Module):
    """A stack forward does not iterate over (it runs every other block), so no two-block
    template can stand for the model."""

    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList(nn.Linear(8, 8) for _ in range(5))

    def forward(self, x):
        for layer in self.enc[::2]:
            x = torch.relu(layer(x))
        return x.sum()


class _Interleaved(nn.Module):
    """Two stacks whose blocks alternate (attention i, then MLP i): a template of each
    stack's first two blocks would repeat one stack's after the other's."""

    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.mlp = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for attn, mlp in zip(self.attn, self.mlp, strict=True):
            x = mlp(torch.relu(attn(x)))
        return x.sum()


def test_stacks_whose_blocks_alternate_are_traced_whole() -> None:
    model, x = _Interleaved(), torch.randn(8, 8)
    assert capture_template(model, (x,), keep=2).total_layers is None


def test_a_model_no_template_cuts_is_made_at_each_size_whole() -> None:
    """The template falls back to the whole model, which the tracer then serves at any rows
    as it serves a template: two traces paired at the first size, every other size made
    (Hugging Face BART, before its template cut both stacks, traced the whole model again
    at each microbatch size, ~4 s each)."""
    model, x = _EveryOther(), torch.randn(8, 8)
    tracer = AnyRows()
    assert capture_template(model, (x,), keep=2, tracer=tracer).total_layers is None
    (whole,) = tracer._others.values()
    assert whole.rows_of is not None, "the whole model's traces at 8 and 4 rows did not pair"
    made = capture_template(model, (x[:2],), keep=2, tracer=tracer)
    _assert_same_graph(made.captured, capture(model, (x[:2],)))


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
    assert tracer.rows_of is not None  # 4 and 2 rows paired
    assert not shapes_hold(tracer.evaluated(1))  # the line through 4 and 2 keeps the dim
    one = capture(model, (x[:1],), None, tracer)
    assert one.loss_node.args[0].meta["val"].shape == (4,)
    _assert_same_graph(one, capture(model, (x[:1],)))
    more = torch.randn(6, 4)
    _assert_same_graph(capture(model, (more,), None, tracer), capture(model, (more,)))


class _Clamped(nn.Module):
    """A size the batch clamps: `x[:min(rows, 4)]` is 4 rows at 8 and at 4, 2 rows at 2."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x[: min(x.shape[0], 4)]).sum()


def test_a_size_the_batch_clamps_is_traced_below_the_paired_rows() -> None:
    model, tracer, x = _Clamped(), AnyRows(), torch.randn(8, 4)
    capture(model, (x,), None, tracer)
    assert tracer.rows_of is not None
    assert not shapes_hold(tracer.evaluated(2))  # made: a slice of 4 rows out of 2
    _assert_same_graph(capture(model, (x[:2],), None, tracer), capture(model, (x[:2],)))
    _assert_same_graph(capture(model, (x[:6],), None, tracer), capture(model, (x[:6],)))


class _Squared(nn.Module):
    """A number that follows the rows off a line: the sum over rows * rows."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x).sum() / (x.shape[0] * x.shape[0])


def test_a_number_off_a_line_is_not_made_from_two_traces() -> None:
    """Two traces fit a line through any two values: a number (not a size) that differs
    between them is not made from them; the symbolic export makes the graphs instead."""
    model, tracer, x = _Squared(), AnyRows(), torch.randn(8, 4)
    capture(model, (x,), None, tracer)
    assert tracer.rows_of is None and tracer.traced is not None and not tracer.failed
    for rows in (6, 3, 2):
        made = capture(model, (x[:rows],), None, tracer)
        _assert_same_graph(made, capture(model, (x[:rows],)))


class _Branches(nn.Module):
    """Another op above 4 rows: the traces at 8 and 4 rows differ in their ops."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        return (y.relu() if x.shape[0] > 4 else y).sum()


def test_traces_whose_ops_differ_do_not_pair() -> None:
    model, tracer, x = _Branches(), AnyRows(), torch.randn(8, 4)
    capture(model, (x,), None, tracer)
    assert tracer.rows_of is None
    for rows in (6, 4, 2):
        made = capture(model, (x[:rows],), None, tracer)
        _assert_same_graph(made, capture(model, (x[:rows],)))
