"""The whole model's graph built from its two-block template equals the whole model's trace.

`Template.whole_model` (`autopar.capture.expand`) repeats the template's block 1 instead of
tracing every block. The graph it builds must be the one `capture` traces: the same nodes
with the same names, ops, arguments and metadata, the same placeholders and roles, the same
fingerprint, so that a plan made on it runs on the traced graph. Where the template does
not show how the blocks repeat, it builds nothing and the caller traces.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autopar.capture import capture
from autopar.capture.export import layer_of
from autopar.capture.template import capture_template
from autopar.cli.sources import load_model
from autopar.cluster import Cluster
from autopar.options import PlanOptions
from autopar.planning import prepare
from samples import get_sample


def _row(n: torch.fx.Node) -> tuple:
    val = n.meta.get("val")
    stack = n.meta.get("nn_module_stack") or {}
    return (
        n.op,
        n.name,
        str(n.target),
        str(n.args),
        str(n.kwargs),
        tuple(val.shape) if isinstance(val, torch.Tensor) else None,
        layer_of(n),
        n.meta.get("autopar_role"),
        n.meta.get("autopar_layer"),
        tuple(stack.values()),
        n.meta.get("stack_trace"),
    )


def _assert_same_graph(built, traced) -> None:
    assert built is not None, "the template did not build the whole graph"
    assert [_row(n) for n in built.gm.graph.nodes] == [_row(n) for n in traced.gm.graph.nodes]
    assert built.fingerprint == traced.fingerprint
    assert built.params == traced.params and built.aliases == traced.aliases
    assert built.buffers == traced.buffers and built.user_inputs == traced.user_inputs
    assert built.mutated_buffers == traced.mutated_buffers
    assert built.constants.keys() == traced.constants.keys()


class _Residual(nn.Module):
    """The residual add in the parent's loop (`x = x + layer(x)`), a loss function apart."""

    def __init__(self, depth: int, first_twice: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(16, 4)
        self.first_twice = first_twice

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = x + layer(x)
            if self.first_twice and i == 0:  # the first block differs from the others
                x = x * 2
        return self.head(x)


def _loss(out, target):
    return nn.functional.cross_entropy(out, target)


def _hf_gpt2(depth: int, rows: int = 2):
    transformers = pytest.importorskip("transformers")
    from tests.models.hf_gpt2 import VOCAB, LanguageModelLoss

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=depth, n_head=2
    )
    model = LanguageModelLoss(transformers.GPT2LMHeadModel(config))
    ids = torch.randint(0, VOCAB, (rows, 16))
    return model, (ids, ids), None


def _hf_family(config: str):
    """A tiny Hugging Face encoder-decoder: two stacks, each expanded (T5's first blocks,
    with the relative position bias, unlike the others)."""
    pytest.importorskip("transformers")
    model, batch = load_model("tests/models/hf_families.py:build", config, 2)
    return model, batch, None


def _sample(name: str, rows: int = 4):
    sample = get_sample(name)
    model = sample.build("tiny4", device="meta")
    return model, sample.example_batch(model, rows, device="meta"), None


def _residual(depth: int = 5):
    return _Residual(depth), (torch.randn(8, 16), torch.randint(0, 4, (8,))), _loss


CASES = {
    "gpt": lambda: _sample("gpt"),
    "llama": lambda: _sample("llama"),
    "residual in the parent, loss_fn": _residual,
    "hugging face gpt2": lambda: _hf_gpt2(4),
    "hugging face bart": lambda: _hf_family("bart:4"),
    "hugging face t5": lambda: _hf_family("t5:4"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_whole_graph_built_from_the_template_is_the_traced_one(case: str) -> None:
    model, batch, loss_fn = CASES[case]()
    tpl = capture_template(model, batch, loss_fn)
    assert tpl.total_layers is not None and tpl.total_layers > 2
    built = tpl.whole_model(model, batch, loss_fn)
    _assert_same_graph(built, capture(model, batch, loss_fn))
    # the template itself is left as it was: a second build is the same graph
    _assert_same_graph(tpl.whole_model(model, batch, loss_fn), built)


def test_blocks_that_do_not_repeat_alike_are_traced_instead() -> None:
    model = _Residual(4, first_twice=True)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    tpl = capture_template(model, batch, _loss)
    assert tpl.total_layers == 4
    assert tpl.whole_model(model, batch, _loss) is None


class _Depth(_Residual):
    """A forward that reads its depth (`/ len(self.layers)`, as an MoE's mean auxiliary
    loss does), or whose last block was built unlike the others (the same parameters)."""

    def __init__(self, depth: int, last_differs: bool):
        super().__init__(depth)
        self.last_differs = last_differs
        self.layers[-1].scaled = last_differs

    def forward(self, x):
        for layer in self.layers:
            y = layer(x)
            x = x + (y * 2 if getattr(layer, "scaled", False) else y)
        out = self.head(x)
        return out if self.last_differs else out / len(self.layers)


@pytest.mark.parametrize("last_differs", [False, True], ids=["reads its depth", "last block"])
def test_a_model_the_template_does_not_show_is_traced_instead(last_differs: bool) -> None:
    """The template cannot tell these from an iteration (its blocks 0 and 1 alike): three
    blocks built differ from blocks 0, 1 and the last traced (`Template._repeats`)."""
    model = _Depth(5, last_differs)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    tpl = capture_template(model, batch, _loss)
    assert tpl.total_layers == 5
    assert tpl.whole_model(model, batch, _loss) is None
    assert tpl.repeats is False


def test_a_template_of_other_shapes_builds_nothing() -> None:
    model, batch, _ = _sample("llama", rows=4)
    tpl = capture_template(model, batch)
    assert tpl.whole_model(model, tuple(t[:2] for t in batch)) is None


def test_planning_without_processes_uses_the_built_graph() -> None:
    """`prepare(solve_first=True)` with a template builds the graph a trace gives, and the
    plan searched on it is the plan searched on the trace."""
    model, batch, _ = _sample("gpt")
    cluster = Cluster.preset("cpu", mesh=(4,))
    options = PlanOptions(pipeline_stages=2, microbatches=2)
    job, traced, _, _ = prepare(model, batch, cluster, None, options)
    tpl = capture_template(model, job.capture_batch(batch))
    _, built, _, _ = prepare(model, batch, cluster, None, options, solve_first=True, given=tpl)
    assert built is not traced
    _assert_same_graph(built, traced)


def test_a_plan_made_on_the_built_graph_names_the_traced_graph() -> None:
    """`autopar.plan` on a model of 8 blocks (the template route) plans on the built graph;
    `compile` traces the model: the plan's fingerprint and node names are the trace's."""
    import autopar
    from autopar.capture.template import BUILT
    from samples.gpt import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig(64, 16, 8, 2, 16))
    idx = torch.zeros(4, 16, dtype=torch.long, device="meta")
    plan = autopar.plan(model, (idx, idx), cluster=Cluster.preset("cpu", mesh=(2,)))
    assert plan.solver.get("graph") == BUILT
    traced = capture(model, (idx, idx))
    assert plan.graph_fingerprint == traced.fingerprint
    names = {n.name: str(n.target) for n in traced.gm.graph.nodes}
    assert all(node.name in names for node in plan.nodes)


@pytest.mark.parametrize("last_differs", [False, True], ids=["reads its depth", "last block"])
def test_a_plan_is_confirmed_on_the_trace_when_the_template_does_not_show_the_model(
    last_differs: bool,
) -> None:
    """`autopar.plan` plans on the built graph while the three-block check runs beside it
    (`Template.whole_model(confirm_later=True)`); where the check finds the blocks do not
    repeat, the plan given out is the one made on the model's trace, with its fingerprint."""
    import autopar
    from autopar.capture.template import BUILT

    model = _Depth(8, last_differs)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    plan = autopar.plan(model, batch, cluster=Cluster.preset("cpu", mesh=(2,)), loss_fn=_loss)
    assert plan.solver.get("graph") != BUILT
    assert plan.graph_fingerprint == capture(model, batch, _loss).fingerprint
    repeating = _Residual(8)
    plan = autopar.plan(repeating, batch, cluster=Cluster.preset("cpu", mesh=(2,)), loss_fn=_loss)
    assert plan.solver.get("graph") == BUILT
    assert plan.graph_fingerprint == capture(repeating, batch, _loss).fingerprint


def test_a_mixed_precision_plan_traces_three_blocks_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout search plans a bf16 copy of the model, and its three-block check traces
    that copy; the final plan is built on the same copy, so the check's answer serves it
    (a new copy would stop the check and trace three blocks again). One microbatch: the
    final graph has the rows the check traced."""
    import autopar
    from autopar.capture import template
    from autopar.capture.template import BUILT

    started, three = [], template._three_traced
    monkeypatch.setattr(template, "_three_traced", lambda *a: started.append(a) or three(*a))
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    cluster = Cluster.preset("cpu", devices_per_node=2)
    plan = autopar.plan(
        _Residual(6), batch, cluster=cluster, loss_fn=_loss, mixed_precision="bf16", microbatches=1
    )
    assert plan.solver.get("graph") == BUILT and plan.solver.get("layout") is not None
    assert len(started) == 1


@pytest.mark.parametrize("last_differs", [None, False, True], ids=["repeats", "depth", "last"])
def test_a_check_started_before_the_template_confirms_its_graph(last_differs) -> None:
    """The layout search starts the three-block check before it captures the template
    (`start_check`, on another core while the template exports); the template adopts it
    and the whole model built from it is confirmed or refused by that check as by its own.
    A check started for other shapes is stopped and the template's own runs instead."""
    from autopar.capture.template import start_check

    model = _Residual(5) if last_differs is None else _Depth(5, last_differs)
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    check = start_check(model, batch, _loss)
    assert check is not None and check.stacks == (("layers", 5, 0),)
    tpl = capture_template(model, batch, _loss)
    tpl.adopt(check)
    built = tpl.whole_model(model, batch, _loss, confirm_later=True)
    assert tpl._check is check  # adopted, not started again
    assert tpl.confirmed() is (last_differs is None)
    if last_differs is None:
        _assert_same_graph(built, capture(model, batch, _loss))
    other = start_check(model, tuple(t[:4] for t in batch), _loss)
    tpl = capture_template(model, batch, _loss)
    tpl.adopt(other)
    tpl.whole_model(model, batch, _loss, confirm_later=True)
    assert tpl._check is not other and other.traced._conn is None  # stopped
    assert tpl.confirmed() is (last_differs is None)
