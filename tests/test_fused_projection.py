"""A fused projection split by heads (Megatron's column-parallel QKV): capture's rewrite of
equal splits, the strided placements the plan gives the fused weight, what the cost model
lets reach them. Numerics: `test_strategies.py::test_fused_projection_strided_strategies_
numerically` (each strided strategy on DTensors) and the tp parity cases (`test_parity.py`:
the GPT sample trains with its QKV split by heads)."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar._compat import StridedShard, make_fx
from autopar.capture.splits import unflatten_equal_splits
from autopar.cli.sources import load_model
from autopar.cluster import Cluster
from autopar.cost_models.comm import redistribute_time
from autopar.plan import parse_spec, spec_str

aten = torch.ops.aten


def test_an_equal_split_becomes_a_view_and_unbind_with_the_same_values() -> None:
    def f(x):
        q, k, v = x.split(4, dim=-1)
        a, b = x.chunk(2, dim=1)  # also an equal split
        first, rest = x.split([3, 9], dim=-1)  # unequal: left as it is
        return q * 1 + k * 2 + v * 3, a - b, first.sum() + rest.sum()

    x = torch.randn(2, 6, 12)
    gm = make_fx(f, tracing_mode="fake")(x)
    want = make_fx(f)(x)(x)
    assert unflatten_equal_splits(gm) == 2
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.unbind.int) == 2
    assert targets.count(aten.split_with_sizes.default) + targets.count(aten.split.Tensor) == 1
    for got, ref in zip(gm(x), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_the_gpt_tp_plan_computes_each_ranks_heads_q_k_v_without_communication() -> None:
    model, batch = load_model("gpt", "tiny", 8)[:2]
    cluster = Cluster.preset("cpu", mesh=(2,), axis_names=("tp",))
    plan = autopar.plan(model, batch, cluster=cluster, strategy="tp")
    qkv = {t.name: t.spec for t in plan.tensors if "c_attn" in t.name}
    assert qkv and set(qkv.values()) == {"SS(0:3)"}, qkv
    nodes = {n.name: n for n in plan.nodes}
    for unbind in (n for n in plan.nodes if n.op == "unbind.int"):
        view = nodes[unbind.args[0]]
        assert view.inputs == ("SS(2:3)",) and view.outputs == ("S(3)",), view
        assert not view.reshards and not unbind.reshards, (view, unbind)
        assert unbind.outputs == ("S(2)",) * 3
    sdpa = [n for n in plan.nodes if n.op.startswith("scaled_dot_product_attention")]
    assert sdpa and all(n.inputs == ("S(1)",) * 3 for n in sdpa)
    assert spec_str(parse_spec("SS(0:3)")) == "SS(0:3)"
    assert parse_spec("SS(0:3)") == (StridedShard(0, split_factor=3),)


def test_a_strided_shard_is_reached_only_from_an_unsplit_dim() -> None:
    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("dp", "tp"))
    shape, strided = (12, 8), (Replicate(), StridedShard(0, split_factor=3))
    assert redistribute_time((Replicate(), Replicate()), strided, shape, 4, cluster) == 0.0
    # a dim split on another axis (FSDP's Shard(0)) would be re-split: DTensor fails there
    assert math.isinf(redistribute_time((Shard(0), Replicate()), strided, shape, 4, cluster))
    assert math.isinf(redistribute_time((Replicate(), Shard(1)), strided, shape, 4, cluster))
    gather = redistribute_time((Replicate(), Shard(0)), (Replicate(),) * 2, shape, 4, cluster)
    assert redistribute_time(strided, (Replicate(),) * 2, shape, 4, cluster) == gather > 0


def test_fsdp_beside_heads_shards_the_fused_weight_on_its_other_dim() -> None:
    """DTensor does not nest a shard inside a strided one: FSDP takes dim 1 of the fused
    weight and leaves its bias whole (the fsdp x tp parity case trains this plan)."""
    model, batch = load_model("gpt", "tiny", 8)[:2]
    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("dp", "tp"))
    plan = autopar.plan(model, batch, cluster=cluster, strategy=("fsdp", "tp"))
    specs = {t.name.rsplit("_", 1)[-1]: t.spec for t in plan.tensors if "c_attn" in t.name}
    assert specs == {"weight": "S(1),SS(0:3)", "bias": "R,SS(0:3)"}, specs


def test_the_fused_projections_input_gradient_stays_partial_at_run_time() -> None:
    """Lowered, the column-parallel QKV's backward runs on each rank's heads as priced: its
    input gradient is a partial product of the strided gradient and the strided weight (one
    all-reduce), not both gathered and un-permuted to compute the whole product."""
    import torch.distributed as dist

    from autopar._compat import FakeStore
    from autopar.options import PlanOptions
    from autopar.passes.comm import OFF
    from autopar.rank_plans import plan_for_ranks
    from autopar.runtime.parallel_model import ParallelModel

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model, batch = load_model("gpt", "tiny", 8)[:2]
        cluster = Cluster.preset("cpu", mesh=(2,), axis_names=("tp",))
        plan, captured, mesh = plan_for_ranks(
            model, batch, cluster, None, PlanOptions(strategy="tp"), None
        )
        assert {t.spec for t in plan.tensors if "c_attn_weight" in t.name} == {"SS(0:3)"}
        gm = ParallelModel(model, captured, plan, mesh, comm=OFF).program.gm
    finally:
        dist.destroy_process_group()
    fused = 3 * model.config.n_embd
    gathers = [
        n
        for n in gm.graph.nodes
        if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default
    ]
    assert gathers  # the vocabulary-parallel embedding and head still gather
    for n in gathers:  # none of the fused dim's halves
        assert fused // 2 not in n.args[0].meta["val"].shape, n.args[0].meta["val"].shape
    permutes = [n for n in gm.graph.nodes if n.target is aten.index_select.default]
    assert not [n for n in permutes if fused in n.meta["val"].shape], permutes
