"""The search rediscovers the plans practitioners write by hand (planning only: fake process
group, meta-device models, real cluster presets).

- Data parallelism when memory is ample and the model small: GPT-2 124M on one DGX-H100
  node, the batch split over every device, no TP, no memory lever; its parameters
  replicated (DDP) or FSDP-sharded: with the optimizer's update priced (~1.3 ms a step for
  124M replicated fp32 parameters), sharding the states saves about what the prefetched
  gathers cost, the two within 2%.
- ZeRO/FSDP when parameters + gradients + Adam state exceed a device: GPT-2 1.5B
  (1.56e9 params x 16 B = 25 GB) on 16 GB V100s (p3.16xlarge).
- Megatron column->row pairing on the fast intra-node axis for a large hidden size:
  wq/wk/wv and w1/w3 sharded on their output features (Shard(0) of [out, in]), wo and w2 on
  their input features (Shard(1)), so each attention and MLP block needs one all-reduce
  forward (and one backward); data parallelism goes across nodes. The roles are pinned
  (dp across nodes, tp inside): with the overlap priced, 16-way DP hides this batch's
  gradient all-reduce under its backward and is the faster plan while it fits.
"""

from __future__ import annotations

import torch

import autopar
from autopar.cluster import Cluster
from autopar.views import axis_roles, summary
from samples import get_sample
from samples.llama import Llama, LlamaConfig, example_batch


def _meta_sample(name: str, config: str, batch: int):
    sample = get_sample(name)
    model = sample.build(config, device="meta")
    return model, sample.example_batch(model, batch, device="meta")


def test_small_model_ample_memory_gives_data_parallelism() -> None:
    model, batch = _meta_sample("gpt", "gpt2-124m", 16)
    # the intra-op search on the machine's own mesh (no layout search: pipeline_stages=1)
    plan = autopar.plan(
        model, batch, cluster=Cluster.preset("dgx-h100", nodes=1), pipeline_stages=1
    )
    text = summary(plan)
    assert axis_roles(plan) in (["dp"], ["fsdp"]), text
    assert not plan.memory.recompute and not plan.memory.reshard_after_forward, text
    params = [t for t in plan.tensors if t.kind == "param"]
    if axis_roles(plan) == ["dp"]:  # the tied embedding may be sharded
        assert sum(t.spec == "R" for t in params) >= len(params) - 1, text
    inputs = {t.name: t.spec for t in plan.tensors if t.kind == "input"}
    assert inputs["targets"] == "S(0)", text  # the batch split over all 8
    # the token ids split too, or read whole by the (tied) embedding sharded on its hidden
    # dim: each device looks up its slice of every token and an all-to-all splits the
    # batch, cheaper than gathering the 154 MB table and copying it out of its buffer
    wte = next(t.spec for t in plan.tensors if t.fqn == "wte.weight")
    assert inputs["idx"] == "S(0)" or (inputs["idx"] == "R" and wte == "S(1)"), text


def test_states_exceeding_a_device_give_fsdp() -> None:
    model, batch = _meta_sample("gpt", "gpt2-1.5b", 8)
    cluster = Cluster.preset("p3.16xlarge", nodes=1)
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params * 16 > cluster.device.memory_bytes  # DP cannot fit
    plan = autopar.plan(model, batch, cluster=cluster, pipeline_stages=1)
    # every device shards the states (on a 1-D mesh, or a 2-D one fsdp on both axes: the
    # overlapped step prices the two within 0.1%, the hierarchical one's rings shorter)
    assert set(axis_roles(plan)) == {"fsdp"}, summary(plan)
    assert plan.predicted_peak_memory <= cluster.device.memory_bytes
    dp = None
    try:
        dp = autopar.plan(model, batch, cluster=cluster, strategy="dp")
    except autopar.MemoryInfeasible:
        pass
    assert dp is None, "pure DP should not fit"


def test_large_hidden_gives_megatron_pairing_on_the_fast_axis() -> None:
    cfg = LlamaConfig(
        vocab_size=32768,
        max_seq_len=2048,
        n_layers=4,
        dim=8192,
        n_heads=64,
        n_kv_heads=64,
        ffn_hidden_dim=4 * 8192,
    )
    with torch.device("meta"):
        model = Llama(cfg)
    batch = example_batch(cfg, 32, device="meta")
    cluster = Cluster.preset("dgx-h100", nodes=2, axis_names=("node", "gpu"))
    plan = autopar.plan(model, batch, cluster=cluster, strategy=("dp", "tp"))
    roles = axis_roles(plan)
    assert roles[1].startswith("tp") and not roles[0].startswith("tp"), summary(plan)
    spec = {t.fqn: t.spec.split(",")[1] for t in plan.tensors if t.kind == "param"}
    for i in range(cfg.n_layers):
        column = [f"layers.{i}.attention.w{x}.weight" for x in "qkv"]
        column += [f"layers.{i}.feed_forward.w1.weight", f"layers.{i}.feed_forward.w3.weight"]
        row = [f"layers.{i}.attention.wo.weight", f"layers.{i}.feed_forward.w2.weight"]
        assert all(spec[name] == "S(0)" for name in column), {n: spec[n] for n in column}
        assert all(spec[name] == "S(1)" for name in row), {n: spec[n] for n in row}
    # one forward all-reduce per block: exactly two row-parallel matmuls with a Partial output
    partial = [
        n
        for n in plan.nodes
        if n.layer == "layers.0" and n.op == "mm.default" and n.outputs[0].split(",")[1] == "P"
    ]
    assert len(partial) == 2, [(n.name, n.inputs, n.outputs) for n in partial]
