"""Uneven shardings: dims the mesh axis does not divide shard as DTensor's ``torch.chunk``.

Planning (fake process group, meta model): GPT-2 124M with its real vocabulary of 50257 on
8 H100s under ``strategy="fsdp"`` shards the token embedding (tied with the head) on the
vocabulary, 6283 rows on ranks 0-6 and 6276 on rank 7, and the predicted parameter memory is
exactly the largest shard of every parameter (``cost_models.memory.local_shape``: ceil).

Run time (4 gloo processes, one spawn): a tiny GPT with the prime vocabulary 97 (25, 25, 25,
22 rows per rank) and batches the data-parallel degree does not divide trains like the
single device under tp (vocabulary-parallel embedding and head), dp x tp and a 2-stage
pipeline over fsdp (microbatches split unevenly over dp); under fsdp on dp=4, a vocabulary
and a batch of 3 (shards of 1, 1, 1, 0 rows); and a 2-stage pipeline whose 7 rows do not divide
into its 3 microbatches (3, 2, 2: two schedule steps, losses weighted by rows), at
test_parity's tolerances (loss <= 1e-5 relative, gradient shards <= 1e-5 x max |g_ref|,
parameters <= lr x steps).

This file is also the model source of those cases (``build`` / ``example_batch``).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import Shard

import autopar
from autopar.cluster import Cluster
from autopar.cost_models.memory import local_shape
from autopar.passes.strategies import is_valid_spec
from autopar.plan import parse_spec
from autopar.runtime.shards import chunk_of
from autopar.search.schedules import microbatch_groups, microbatch_rows, simulate
from autopar.testing.parity import LR, ParityCase, ParityResult, Tolerance, check, run_parity
from samples.gpt import GPT, GPTConfig
from samples.gpt import example_batch as gpt_batch

CONFIGS = {
    "vocab97": GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32),
    "vocab3": GPTConfig(vocab_size=3, block_size=16, n_layer=2, n_head=4, n_embd=32),
}
SOURCE = f"{Path(__file__).resolve()}:build"
STEPS = 2
TOL = Tolerance(loss=1e-5, grad=1e-5, param=LR * STEPS)  # test_parity's


def build(config: str = "vocab97") -> GPT:
    return GPT(CONFIGS[config])


def example_batch(model: GPT, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gpt_batch(model.config, batch_size)


def test_chunk_semantics() -> None:
    """The shards DTensor makes: ceil-sized pieces, the last smaller, missing ones empty."""
    t = torch.arange(6)
    assert [chunk_of(t, 0, 4, i).tolist() for i in range(4)] == [[0, 1], [2, 3], [4, 5], []]
    assert [len(chunk_of(torch.arange(97), 0, 4, i)) for i in range(4)] == [25, 25, 25, 22]
    # storage shards any dim; an op's operand needs a piece per rank; rules may ask even
    assert is_valid_spec((Shard(0),), (2, 8), (4,), storage=True)
    assert not is_valid_spec((Shard(0),), (2, 8), (4,))
    assert not is_valid_spec((Shard(0), Shard(0)), (3, 8), (2, 2))  # DTensor: a row per shard
    assert is_valid_spec((Shard(0),), (97, 8), (4,))
    assert not is_valid_spec((Shard(0),), (97, 8), (4,), even=True)
    assert local_shape((97, 8), (Shard(0), Shard(0)), (2, 2)) == (25, 8)


def test_gpt2_vocab_50257_fsdp_plans_padded_shards() -> None:
    cfg = dataclasses.replace(GPTConfig.gpt2_124m(), vocab_size=50257)
    with torch.device("meta"):
        model = GPT(cfg)
    batch = gpt_batch(cfg, 8, device="meta")
    cluster = Cluster.preset("dgx-h100")
    plan = autopar.plan(model, batch, cluster=cluster, strategy="fsdp")
    params = [t for t in plan.tensors if t.kind == "param"]
    wte = next(t for t in params if t.shape[0] == 50257)
    assert wte.spec == "S(0)", wte
    assert all(t.spec == "S(0)" for t in params if t.shape[0] > 1), params
    mesh = plan.stage_mesh_shape
    padded = sum(math.prod(local_shape(t.shape, parse_spec(t.spec), mesh)) for t in params)
    assert padded > sum(math.prod(t.shape) for t in params) / 8  # the padding is counted
    assert plan.predicted_memory["parameters"] == padded * 4
    assert plan.predicted_memory["optimizer_state"] >= 2 * padded * 4  # AdamW's two moments


def test_dimension_below_the_axis_is_stored_with_an_empty_shard() -> None:
    """A vocabulary of 3 under fsdp on 4 ranks: the embedding is stored 1, 1, 1, 0 rows
    (and so is a batch of 3), priced at the largest shard; no op reads a dim cut into more
    pieces than it has rows (DTensor's rule), so such values are gathered before use."""
    model = build("vocab3")
    batch = example_batch(model, 3)
    plan = autopar.plan(model, batch, cluster=Cluster.preset("cpu", mesh=(4,)), strategy="fsdp")
    specs = {t.name: t.spec for t in plan.tensors}
    assert specs["p_wte_weight"] == specs["idx"] == "S(0)", specs
    pieces = [len(chunk_of(torch.arange(3), 0, 4, i)) for i in range(4)]
    assert pieces == [1, 1, 1, 0]
    assert is_valid_spec((Shard(0),), (3, 32), (4,), storage=True)
    assert not is_valid_spec((Shard(0),), (3, 32), (4,))
    params = [t for t in plan.tensors if t.kind == "param"]
    held = sum(math.prod(local_shape(t.shape, parse_spec(t.spec), (4,))) for t in params)
    assert plan.predicted_memory["parameters"] == held * 4


def test_microbatch_count_need_not_divide_the_batch() -> None:
    """7 rows in 3 microbatches: 3, 2, 2 (torch.tensor_split: always the count asked for,
    where torch.chunk cuts 5 rows in 4 into 2, 2, 1). The plan is captured and priced at
    the largest microbatch, its two sizes run as two schedule steps (priced so: a second
    fill and drain); a prime batch with `pipeline_stages="auto"` still plans."""
    assert microbatch_rows(7, 3) == (3, 2, 2) and microbatch_groups(7, 3) == (1, 2)
    assert microbatch_rows(5, 4) == (2, 1, 1, 1) and len(torch.arange(5).chunk(4)) == 3
    assert microbatch_groups(6, 3) == (3,)
    with pytest.raises(ValueError, match="cannot split a batch of 7 rows"):
        microbatch_rows(7, 8)
    one_run = simulate("1f1b", [1.0, 1.0], [2.0, 2.0], 3, 2)
    two_runs = simulate("1f1b", [1.0, 1.0], [2.0, 2.0], (1, 2), 2)
    assert two_runs.step_time > one_run.step_time
    model = build()
    cluster = Cluster.preset("cpu", mesh=(4,))
    plan = autopar.plan(
        model, example_batch(model, 7), cluster=cluster, pipeline_stages=2, microbatches=3
    )
    assert plan.pipeline is not None and plan.pipeline.microbatches == 3
    assert {t.name: t.shape for t in plan.tensors}["idx"] == (3, 16)  # the largest
    assert all(f"F{s}.2" in row for s, row in enumerate(plan.pipeline.timeline))
    auto = autopar.plan(
        model,
        example_batch(model, 5),
        cluster=Cluster.preset("cpu", mesh=(2,)),
        pipeline_stages="auto",
    )
    assert auto.solver["layout"], auto.solver
    pinned = autopar.plan(
        model,
        example_batch(model, 7),
        cluster=Cluster.preset("cpu", mesh=(2,)),
        pipeline_stages="auto",
        microbatches=3,
    )
    tried = pinned.solver["layout_candidates"]
    assert any(k.startswith("pp2 ") and " m3" in k for k in tried), tried  # 3, 2, 2 rows


def _two_stages_over_fsdp(rows: int, microbatches: int) -> ParityCase:
    return ParityCase(
        SOURCE,
        (2, 2),
        ("pp", "dp"),
        "fsdp",
        config="vocab97",
        batch_size=rows,
        schedule="1f1b",
        microbatches=microbatches,
        steps=STEPS,
    )


CASES = [  # batches of 3 on dp=4 (1, 1, 1, 0 rows), 7 on dp=2 (4, 3 rows)
    # a vocabulary and a batch of 3 on dp=4: shards of 1, 1, 1, 0 rows
    ParityCase(SOURCE, (4,), ("dp",), "fsdp", config="vocab3", batch_size=3, steps=STEPS),
    # the vocabulary pinned sharded (the search may shard the embedding's features instead)
    ParityCase(
        SOURCE,
        (4,),
        ("tp",),
        "tp",
        config="vocab97",
        batch_size=6,
        steps=STEPS,
        placements=(("wte.weight", "S(0)"),),
    ),
    ParityCase(
        SOURCE,
        (2, 2),
        ("dp", "tp"),
        ("dp", "tp"),
        config="vocab97",
        batch_size=7,
        steps=STEPS,
        placements=(("wte.weight", "R,S(0)"),),
    ),
    # two stages, two microbatches of 3 rows, each split 2 + 1 over dp=2
    _two_stages_over_fsdp(rows=6, microbatches=2),
    # 7 rows in 3 microbatches: 3, 2, 2 (split 2 + 1, 1 + 1 over dp=2), run as two schedule
    # steps (one microbatch, then two), each microbatch's loss weighted by its rows
    _two_stages_over_fsdp(rows=7, microbatches=3),
]


@pytest.mark.multiproc
def test_prime_vocabulary_matches_single_device() -> None:
    check(CASES, run_parity(CASES), TOL, _vocabulary_sharded)


def _vocabulary_sharded(case: ParityCase, res: ParityResult) -> list[str]:
    if "S(0)" in res.param_specs["wte.weight"]:  # 97 rows: 25, 25, 25, 22; 3: 1, 1, 1, 0
        return []
    return [f"{res.label}: the vocabulary is not sharded: specs {res.param_specs}"]
