"""Layout search (Alpa's outer loop) on layer templates, planning only (fake process group).

- A template (two captured blocks, the second weighted) prices exactly like the full graph.
- Block weights are staged, priced and shared with their block.
- Megatron-Core's 1.7B weak-scaling row on 48 H100s: the search keeps TP inside a node,
  fits in 80 GB, and is no slower than Megatron's own (TP 1, PP 1) under the same model.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autopar.capture import capture
from autopar.capture.export import layer_of
from autopar.capture.template import capture_template
from autopar.cluster import Cluster
from autopar.passes.strategies import NodeStrategy
from autopar.planning import fake_group
from autopar.search.costs import CostContext, CostWeights
from autopar.search.intra_op import solve_intra
from autopar.search.layouts import Layout, _Pricer, candidate_layouts, search_layout
from autopar.search.pins import SearchOptions
from samples import get_sample


def _meta_gpt(config: str, batch: int):
    sample = get_sample("gpt")
    model = sample.build(config, device="meta")
    return model, sample.example_batch(model, batch, device="meta")


def test_template_keeps_two_blocks_and_restores_the_model() -> None:
    model, batch = _meta_gpt("tiny4", 4)
    tpl = capture_template(model, batch)
    layers = {layer_of(n) for n in tpl.captured.gm.graph.nodes} - {None}
    assert layers == {"h.0", "h.1"}
    assert tpl.total_layers == 4 and tpl.weights == {"h.1": 3.0}
    assert len(model.h) == 4


def test_block_weights_belong_to_their_block() -> None:
    model, batch = _meta_gpt("tiny4", 4)
    captured = capture(model, batch)
    by_name = {
        fqn: layer_of(n) for n in captured.placeholders() if (fqn := captured.params.get(n.name))
    }
    assert by_name["h.2.attn.c_attn.weight"] == "h.2"
    assert by_name["h.0.ln_1.weight"] == "h.0"
    assert by_name["wte.weight"] is None  # tied: used by the embedding and the head


def test_template_prices_like_the_full_graph() -> None:
    model, batch = _meta_gpt("gpt2-124m", 16)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    with fake_group(cluster.world_size):
        mesh = init_device_mesh("cpu", cluster.mesh_shape, mesh_dim_names=cluster.axis_names)
        full = solve_intra(capture(model, batch), cluster, mesh)
        tpl = capture_template(model, batch)
        small = solve_intra(tpl.captured, cluster, mesh, weights=CostWeights(layer=tpl.weights))
    assert small.objective == pytest.approx(full.objective, rel=1e-9)
    assert small.memory == pytest.approx(full.memory, rel=1e-9)
    assert full.info["ilp_decisions"] == small.info["ilp_decisions"]


def test_mixed_precision_and_zero1_state_bytes() -> None:
    cluster = Cluster.preset("dgx-h100", nodes=1)
    param = torch.empty(8, 16, dtype=torch.bfloat16, device="meta")

    class _Node:  # what node_memory reads of a parameter placeholder
        op = "placeholder"
        target = "p"
        meta = {"val": param, "autopar_role": "param"}

    replicated = NodeStrategy((), ((Replicate(),),))
    sharded = NodeStrategy((), ((Shard(0),),))
    policy = {"mixed_precision": True, "reduce_itemsize": 4}

    def per_element(strategy: NodeStrategy, numel: int, **kw) -> float:
        return CostContext(cluster, **kw).node_memory(_Node, strategy) / numel

    # a bf16 model trained as it is (no policy): bf16 param + bf16 grad + 2 bf16 Adam states
    assert per_element(replicated, 128) == 2 + 2 + 2 * 2
    # bf16 policy: fp32 master + bf16 working copy + fp32 grad + 2 fp32 Adam states
    assert per_element(replicated, 128, **policy) == 4 + 2 + 4 + 2 * 4
    # ZeRO-1 under the policy, 8 replicas: bf16 working copy, the full bf16 gradient plus
    # its fp32 reduce-scattered shard, fp32 master and states split over the replicas
    assert per_element(replicated, 128, shard_optimizer=True, **policy) == 2 + (2 + 4 / 8) + 12 / 8
    # ZeRO-2 keeps only the gradient shard
    zero2 = {"shard_optimizer": True, "shard_gradients": True, **policy}
    assert per_element(replicated, 128, **zero2) == 2 + 4 / 8 + 12 / 8
    # a Shard(0) parameter has no replicas: nothing to split
    assert per_element(sharded, 16, shard_optimizer=True, **policy) == 2 + (2 + 4) + 12


def test_reshaped_cluster_keeps_tp_inside_a_node() -> None:
    cluster = Cluster.preset("dgx-h100", nodes=6)
    lay = Layout(pp=3, dp=4, tp=4, microbatches=12).cluster(cluster)
    assert lay.axis_names == ("pp", "dp", "tp") and lay.mesh_shape == (3, 4, 4)
    assert lay.link("tp") == cluster.fabric.intra
    assert lay.link("pp").bandwidth < lay.link("tp").bandwidth
    for tp, by_degree in candidate_layouts(cluster, 192, 24).items():
        assert 8 % tp == 0
        for layouts in by_degree:
            assert all(24 % x.pp == 0 and x.pp * x.dp * x.tp == 48 for x in layouts)


def test_megatron_1_7b_row_fits_and_matches_megatron() -> None:
    model, batch = _meta_gpt("megatron-1.7b", 192)
    cluster = Cluster.preset("dgx-h100", nodes=6)
    options = SearchOptions(shard_optimizer=True, mixed_precision=True, reduce_itemsize=4)
    with fake_group(cluster.world_size):
        found = search_layout(model, batch, cluster, options)
        megatron, _, _ = _Pricer(model, batch, cluster, options, None).price(
            Layout(pp=1, dp=48, tp=1, microbatches=1), None
        )
    best = found.best
    assert 8 % best.tp == 0  # TP never crosses a node
    assert found.peak_memory <= cluster.device.memory_bytes
    assert found.step_time <= megatron * (1 + 1e-9), found.tried
    assert math.isfinite(found.step_time) and found.tried[best.key] == found.step_time


def test_degree_walk_does_not_assume_unimodal_step_times() -> None:
    """A slower degree between two faster ones does not stop the walk; PATIENCE slower
    degrees in a row do, and infeasible degrees never count."""
    from autopar.search.layouts import PATIENCE, walk_degrees

    def walk(times: list[float | None]) -> tuple[float | None, list[int]]:
        degrees = [[Layout(2**i, 1, 1, 8)] for i in range(len(times))]
        priced: list[int] = []

        def price(layouts):
            priced.append(layouts[0].pp)
            t = times[len(priced) - 1]
            return None if t is None else (t, 0.0, layouts[0])

        found = walk_degrees(degrees, price)
        return (found[0] if found else None), priced

    assert PATIENCE == 2
    assert walk([3.0, 3.5, 1.0, 2.0]) == (1.0, [1, 2, 4, 8])  # a bump is walked through
    assert walk([3.0, None, None, 3.5, 2.0]) == (2.0, [1, 2, 4, 8, 16])
    assert walk([1.0, 2.0, 3.0, 0.5]) == (1.0, [1, 2, 4])  # two slower in a row: stop
    assert walk([None, None]) == (None, [1, 2])
