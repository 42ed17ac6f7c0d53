"""Operands: a getitem of a multi-output node reads its producer's selected output, in
strategies, costs, the ILP, the plan and its check (planning only: fake process group)."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar._compat import FakeStore
from autopar.capture import Captured, capture
from autopar.capture.operands import Operand, operands, tensor_operands
from autopar.cluster import Cluster
from autopar.passes.strategies import enumerate_strategies
from autopar.plan import Plan, parse_spec
from autopar.search.costs import CostContext, same_spec
from autopar.search.ilp import evaluate
from autopar.search.intra_op import build_decisions, price, solve_intra
from autopar.search.pins import SearchOptions
from autopar.search.to_plan import assemble_plan
from samples import get_sample

aten = torch.ops.aten
MESH_2X2 = dict(mesh=(2, 2), axis_names=("dp", "tp"))


def _sample(name: str, config: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    sample = get_sample(name)
    torch.manual_seed(0)
    model = sample.build(config)
    return model, sample.example_batch(model, 8)


@contextmanager
def _fake_mesh(cluster: Cluster) -> Iterator:
    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cluster.world_size)
    try:
        yield cluster.device_mesh(device_type="cpu")
    finally:
        dist.destroy_process_group()


def _producer_spec(plan: Plan, node, pos: int) -> str:
    arg = node.args[pos]
    tensors = {t.name: t.spec for t in plan.tensors}
    if arg in tensors:
        return tensors[arg]
    index = node.arg_outputs[pos] if node.arg_outputs else None
    return plan.node(arg).outputs[index or 0]


# (sample, config, strategy, options, a multi-output producer the plan must show sharded).
# GPT "small" left to "auto" is the demo's plan; the tiny Llama replicates everything under
# "auto", so its axes are pinned; fused, its RMSNorms become add_rms_norm with two outputs.
CASES = [
    ("gpt", "small", "auto", {}, "native_layer_norm.default"),
    ("llama", "tiny", ("dp", "tp"), {}, "unbind.int"),  # an equal split (capture.splits)
    ("llama", "tiny", ("dp", "tp"), {"fusion": "triton"}, "autopar.add_rms_norm.default"),
]


@pytest.mark.parametrize("name, config, strategy, options, producer", CASES)
def test_every_getitem_reads_its_producers_output(
    name: str, config: str, strategy, options: dict, producer: str
) -> None:
    model, batch = _sample(name, config)
    cluster = Cluster.preset("cpu", **MESH_2X2)
    plan = autopar.plan(model, batch, cluster=cluster, strategy=strategy, **options)
    getitems = [n for n in plan.nodes if n.op == "getitem"]
    assert producer in {plan.node(g.args[0]).op for g in getitems}
    for g in getitems:
        assert len(g.args) == 1 and len(g.arg_outputs) == 1, g
        made = plan.node(g.args[0])
        assert len(made.outputs) > 1 and g.reshards == ()
        assert g.inputs[0] == made.outputs[g.arg_outputs[0]] == g.outputs[0], (g, made)
    sharded = [g for g in getitems if plan.node(g.args[0]).op == producer]
    assert any("S(" in g.inputs[0] for g in sharded), [g.inputs for g in sharded]
    # every input is its producer's output, or a redistribution recorded as priced
    moved = 0
    for n in plan.nodes:
        assert len(n.args) == len(n.inputs), n
        for pos, want in enumerate(n.inputs):
            if want is None:
                continue
            same = same_spec(parse_spec(_producer_spec(plan, n, pos)), parse_spec(want))
            assert (pos in n.reshards) == (not same), (n, pos)
            moved += not same
    assert moved > 0  # the plan does move data between nodes, so the check saw reshards


def _objective_of(captured: Captured, cluster: Cluster, strategy) -> tuple[float, float]:
    """The ILP's objective, and every node's cost (a parameter's: the optimizer's update,
    once per step) plus every operand's redistribution from its producer's chosen output,
    priced independently of the ILP's edges."""
    with _fake_mesh(cluster) as mesh:
        result = solve_intra(captured, cluster, mesh, SearchOptions(strategy=strategy))
    ctx, chosen = result.ctx, result.chosen
    total = sum(ctx.weights.of(n) * ctx.node_cost(n, s) for n, s in chosen.items())
    total += result.update_time()
    for n, s in chosen.items():
        for pos, op in tensor_operands(n):
            src = op.select(chosen[op.producer].outputs)
            total += ctx.weighted_edge_cost(op, src, n, s, pos)
    return result.objective, total


@pytest.mark.parametrize("name, config, strategy", [c[:3] for c in CASES[:2]])
def test_objective_prices_every_redistribution(name: str, config: str, strategy) -> None:
    model, batch = _sample(name, config)
    cluster = Cluster.preset("cpu", **MESH_2X2)
    objective, total = _objective_of(capture(model, batch), cluster, strategy)
    assert objective == pytest.approx(total, rel=1e-9)


class _NormHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x)).sum()


def _node(captured: Captured, target) -> torch.fx.Node:
    return next(n for n in captured.gm.graph.nodes if n.target == target)


def test_sharded_norm_feeding_a_replicated_consumer_is_priced() -> None:
    """LayerNorm's output Shard(0) read Replicate by the head's matmul: the all-gather (and
    its backward) is on the ILP's edge from the norm to the matmul. Before operands, the
    getitem between them was a free decision with no edge, so the ILP could pick
    getitem=R after norm=S(0) and pay nothing."""
    captured = capture(_NormHead(), (torch.randn(8, 16),))
    norm, addmm = (
        _node(captured, aten.native_layer_norm.default),
        _node(captured, aten.addmm.default),
    )
    getitem = _node(captured, operator.getitem)
    assert operands(getitem) == [Operand(norm, 0)]
    pos, op = next((p, o) for p, o in tensor_operands(addmm) if o.producer is getitem)
    cluster = Cluster.preset("cpu", mesh=(2,), axis_names=("dp",))
    with _fake_mesh(cluster) as mesh:
        strats = enumerate_strategies(captured.gm, mesh)
    ctx = CostContext(cluster)
    dec = build_decisions(captured.gm, strats, ctx)
    (d, map_norm), (d_get, map_get) = dec.owner[norm], dec.owner[getitem]
    assert d_get == d, "a getitem follows its producer's decision"
    for c in range(dec.items[d].num_choices):
        assert strats[getitem][map_get[c]].inputs[0] == strats[norm][map_norm[c]].outputs[0]

    problem, var_of = price(dec, list(range(len(dec.items))), strats, ctx, float("inf"), 10.0)
    sharded = next(c for c, j in enumerate(map_norm) if strats[norm][j].outputs[0] == (Shard(0),))
    d_mm, map_mm = dec.owner[addmm]
    replicated = next(
        c for c, j in enumerate(map_mm) if strats[addmm][j].inputs[pos] == (Replicate(),)
    )
    edge = next(e for e in problem.edges if (e.u, e.v) == (var_of[d], var_of[d_mm]))
    cost = edge.cost[sharded][replicated]
    s_mm = strats[addmm][map_mm[replicated]]
    assert cost > 0
    assert cost == pytest.approx(ctx.weighted_edge_cost(op, (Shard(0),), addmm, s_mm, pos))
    # the objective of that assignment includes it: no choice of the getitem avoids it
    choices = [0] * len(problem.node_cost)
    choices[var_of[d]], choices[var_of[d_mm]] = sharded, replicated
    assert evaluate(problem, choices)[0] >= cost


def test_assembly_rejects_an_unpriced_mismatch() -> None:
    captured = capture(_NormHead(), (torch.randn(8, 16),))
    cluster = Cluster.preset("cpu", mesh=(2,), axis_names=("dp",))
    with _fake_mesh(cluster) as mesh:
        result = solve_intra(captured, cluster, mesh)
    norm = _node(captured, aten.native_layer_norm.default)
    getitem = _node(captured, operator.getitem)
    assert getitem not in result.priced  # a follower: takes its producer's output as it is
    chosen = dict(result.chosen)
    out = chosen[norm].outputs[0]
    other = (Replicate(),) if out != (Replicate(),) else (Shard(0),)
    chosen[getitem] = type(chosen[getitem])((other,), (other,))
    args = (captured, cluster, chosen, "auto", 1.0, 1.0, {})
    with pytest.raises(AssertionError, match="did not price that redistribution"):
        assemble_plan(*args, priced=result.priced)
    # priced (a decision head), the same mismatch is a recorded reshard
    plan = assemble_plan(*args, priced=result.priced | {getitem})
    assert plan.node(getitem.name).reshards == (0,)
    assert plan.node(getitem.name).args == (norm.name,)
    assert plan.node(getitem.name).arg_outputs == (0,)
