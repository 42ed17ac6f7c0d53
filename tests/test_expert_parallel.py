"""Expert parallelism: the MoE sample routes with static shapes, and EP is a sharding.

- ``samples/moe.py`` drops exactly the assignments past an expert's capacity (first come,
  first served per group), its aux loss is Switch's, and it exports (no data-dependent op).
- Planning only (fake process group, meta device): the search splits the stacked expert
  weights on their expert dim by itself (``dp+ep``: tokens split, experts split, an
  all-to-all between) for an 8-expert Mixtral (2 of its 32 layers) on one DGX-H100 node and
  for a 64-expert model across the 8 nodes of 64 H100 (GPUs data-parallel).
- Parity for EP = 4 and EP = 2 x DP, top-1 and top-2, and EP x TP+SP runs in the one spawn
  of ``tests/test_sequence_parallel.py``.
"""

from __future__ import annotations

import dataclasses

import torch

import autopar
from autopar.cluster import Cluster
from autopar.views import axis_roles, summary
from samples.moe import MOE_CONFIGS, MoEModel, build, example_batch


def test_capacity_drops_the_late_assignments() -> None:
    cfg = dataclasses.replace(MOE_CONFIGS["tiny"], capacity_factor=0.5)
    torch.manual_seed(0)
    moe = MoEModel(cfg).layers[0].moe
    x = torch.randn(3, cfg.max_seq_len, cfg.dim)
    slot, gate, aux = moe.route(x)
    E, C, k = cfg.n_experts, cfg.capacity, cfg.top_k
    top_e = moe.router(x).softmax(-1).topk(k, dim=-1).indices.reshape(3, -1)
    for g in range(3):
        seen: dict[int, int] = {}
        for a, e in enumerate(top_e[g].tolist()):
            pos = seen.get(e, 0)
            seen[e] = pos + 1
            want = e * C + pos if pos < C else E * C
            assert slot[g, a].item() == want
            assert (gate[g, a].item() == 0.0) == (pos >= C)
    assert float(aux) > 0.0


def test_moe_exports_with_static_shapes() -> None:
    torch.manual_seed(0)
    model = build("tiny-shared")
    batch = example_batch(model, 2)
    ep = torch.export.export(model, batch, strict=False)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("nonzero" in op or "_assert_async" in op for op in ops), ops
    torch.testing.assert_close(ep.module()(*batch), model(*batch))


def _plan(name: str, layers: int, rows: int, cluster: Cluster, strategy="auto"):
    cfg = dataclasses.replace(MOE_CONFIGS[name], n_layers=layers)
    with torch.device("meta"):
        model = MoEModel(cfg)
    batch = example_batch(cfg, rows, device="meta")
    # the expert sharding is the subject: no pipeline layouts (tests/test_layouts.py)
    return autopar.plan(model, batch, cluster=cluster, strategy=strategy, pipeline_stages=1)


def test_search_chooses_ep_for_8_experts_on_a_node() -> None:
    plan = _plan("mixtral-8x7b", 2, 8, Cluster.preset("dgx-h100", nodes=1))
    text = summary(plan)
    # the other weights replicated or FSDP-sharded: at 8 rows the optimizer's update of
    # the replicated attention and embedding weights weighs about as much as their gathers
    assert axis_roles(plan) in (["dp+ep"], ["fsdp+ep"]), text
    assert "EP expert weights 6/6" in text and "all_to_all" in text, text


def test_search_chooses_ep_for_64_experts_on_64_h100() -> None:
    cluster = Cluster.preset("dgx-h100", nodes=8)
    plan = _plan("moe-64e", 2, 64, cluster, strategy=("auto", "dp"))
    text = summary(plan)
    assert axis_roles(plan)[0].endswith("+ep"), text
    assert plan.predicted_peak_memory <= cluster.device.memory_bytes, text
