"""The whole model planned from its two-block template equals the plan of the full capture.

`autopar.search.template_plan` solves the ILP on the template and replicates a repeated
block's decisions; the full capture's ILP shares those decisions across blocks. Both must
give the same placements for every node and parameter, the same levers per layer and the
same objective (fake process group, meta models: no processes). So for an encoder-decoder
(Hugging Face T5: two stacks, each cut in the template, each first block, the only one
with the relative position bias, kept beside two repeated ones).
"""

from __future__ import annotations

import dataclasses

import pytest

from autopar.capture.template import block_stacks, capture_template
from autopar.cli.sources import load_model
from autopar.cluster import Cluster
from autopar.options import PlanOptions
from autopar.planning import fake_group, prepare
from autopar.search.template_plan import template_nodes
from samples import get_sample

HF_FAMILIES = "tests/models/hf_families.py:build"
CASES = [  # (sample, options, mesh)
    ("gpt", {}, (2, 2)),
    ("llama", {}, (4,)),
    ("gpt", {"memory_limit": 6.0e5}, (4,)),  # tight: the memory levers and sharding decide
    ("llama", {"pipeline_stages": 2, "microbatches": 2}, (2, 4)),
    # two stacks of 4 blocks, each first block unlike the others (BART's two plain
    # stacks: test_an_encoder_decoder_template_cuts_both_stacks, tests/test_expand.py)
    ("hf:t5:4", {"pipeline_stages": 2, "microbatches": 2}, (2, 2)),
]


def _plans(sample_name: str, options: PlanOptions, mesh: tuple[int, ...], pin_from=None):
    """(full capture's plan, template's plan); `pin_from`: a plan whose parameters' and
    inputs' placements the full capture's search is pinned to (its plan only)."""
    if pin_from is not None:
        pins = {t.fqn: t.spec for t in pin_from.tensors}
        options = dataclasses.replace(options, placements=pins)
    if sample_name.startswith("hf:"):
        model, batch = load_model(HF_FAMILIES, sample_name[3:], 8)
    else:
        sample = get_sample(sample_name)
        model = sample.build("tiny4", device="meta")
        batch = sample.example_batch(model, 8, device="meta")
    cluster = Cluster.preset("cpu", mesh=mesh)
    job, captured, regions, _ = prepare(model, batch, cluster, None, options)
    # (`plan` takes the template route from TEMPLATE_MIN_BLOCKS blocks; tiny4 has 4)
    tpl = capture_template(model, job.capture_batch(batch))
    assert tpl.total_layers == sum(len(s.blocks) for s in block_stacks(model))
    assert template_nodes(captured, tpl.captured) is not None
    with fake_group(job.cluster.world_size):
        mesh = job.cluster.device_mesh(device_type="cpu")
        full = job.search(captured, mesh, regions)
        fast = None if pin_from is not None else job.search(captured, mesh, regions, tpl)
    return full, fast


@pytest.mark.parametrize(("sample_name", "extra", "mesh"), CASES)
def test_template_plan_equals_full_plan(sample_name: str, extra: dict, mesh) -> None:
    full, fast = _plans(sample_name, PlanOptions(**extra), mesh)
    assert "template_blocks" in fast.solver and "template_blocks" not in full.solver
    if fast.tensors != full.tensors:
        # two optima of exactly one price (a weight stored S(0) or S(1), gathered whole for
        # use): the full capture's search pinned to the template's storage plans what the
        # template planned, at the same price
        pinned, _ = _plans(sample_name, PlanOptions(**extra), mesh, pin_from=fast)
        assert pinned.predicted_step_time == pytest.approx(full.predicted_step_time, rel=1e-9)
        assert pinned.predicted_peak_memory == pytest.approx(full.predicted_peak_memory, rel=1e-9)
        full = pinned
    assert fast.nodes == full.nodes  # every node's placements, operands and reshards
    assert fast.tensors == full.tensors  # every parameter's and input's storage spec
    assert fast.memory == full.memory  # recompute / reshard-after-forward per layer
    assert fast.pipeline == full.pipeline
    assert fast.predicted_step_time == pytest.approx(full.predicted_step_time, rel=1e-9)
    assert fast.predicted_peak_memory == pytest.approx(full.predicted_peak_memory, rel=1e-9)


@pytest.mark.parametrize(
    ("family", "weighted"),
    [
        ("bart:4", {"model.model.encoder.layers.1": 3.0, "model.model.decoder.layers.1": 3.0}),
        ("t5:4", {"model.encoder.block.2": 2.0, "model.decoder.block.2": 2.0}),
    ],
)
def test_an_encoder_decoder_template_cuts_both_stacks(family: str, weighted: dict) -> None:
    model, batch = load_model(HF_FAMILIES, family, 4)
    tpl = capture_template(model, batch)
    assert tpl.weights == weighted and tpl.total_layers == 8
    assert [len(s.blocks) for s in block_stacks(model)] == [4, 4]  # the model restored
