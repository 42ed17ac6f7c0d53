"""Uneven shardings: dims the mesh axis does not divide shard as DTensor's ``torch.chunk``.

Planning (fake process group, meta model): GPT-2 124M with its real vocabulary of 50257 on
8 H100s under ``strategy="fsdp"`` shards the token embedding (tied with the head) on the
vocabulary, 6283 rows on ranks 0-6 and 6276 on rank 7, and the predicted parameter memory is
exactly the largest shard of every parameter (``cost_models.memory.local_shape``: ceil).

Run time (4 gloo processes, one spawn): a tiny GPT with the prime vocabulary 97 (25, 25, 25,
22 rows per rank) and batches the data-parallel degree does not divide trains like the
single device under fsdp, tp (vocabulary-parallel embedding and head), dp x tp and a
2-stage pipeline over fsdp (microbatches split unevenly over dp), at test_parity's
tolerances (loss <= 1e-5 relative, gradient shards <= 1e-5 x max |g_ref|, parameters
<= lr x steps).

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
from autopar.testing.parity import LR, ParityCase, ParityResult, Tolerance, check, run_parity
from samples.gpt import GPT, GPTConfig
from samples.gpt import example_batch as gpt_batch

CONFIGS = {"vocab97": GPTConfig(vocab_size=97, block_size=16, n_layer=2, n_head=4, n_embd=32)}
SOURCE = f"{Path(__file__).resolve()}:build"
STEPS = 2
WORLD = 4
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


CASES = [  # batches of 6 on dp=4 (2, 2, 2, 0 rows), 7 on dp=2 (4, 3 rows)
    ParityCase(SOURCE, (4,), ("dp",), "fsdp", config="vocab97", batch_size=6, steps=STEPS),
    ParityCase(SOURCE, (4,), ("tp",), "tp", config="vocab97", batch_size=6, steps=STEPS),
    ParityCase(
        SOURCE, (2, 2), ("dp", "tp"), ("dp", "tp"), config="vocab97", batch_size=7, steps=STEPS
    ),
    # two stages, two microbatches of 3 rows, each split 2 + 1 over dp=2
    ParityCase(
        SOURCE,
        (2, 2),
        ("pp", "dp"),
        "fsdp",
        config="vocab97",
        batch_size=6,
        schedule="1f1b",
        microbatches=2,
        steps=STEPS,
    ),
]


@pytest.mark.multiproc
def test_prime_vocabulary_matches_single_device() -> None:
    check(CASES, run_parity(CASES, WORLD), TOL, _vocabulary_sharded)


def _vocabulary_sharded(case: ParityCase, res: ParityResult) -> list[str]:
    if "S(0)" in res.param_specs["wte.weight"]:  # 97 rows: 25, 25, 25, 22
        return []
    return [f"{res.label}: the vocabulary is not sharded: specs {res.param_specs}"]
