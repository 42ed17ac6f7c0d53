"""Cost models: alpha-beta collectives, redistribution steps/bytes, FLOPs, memory."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx import Graph

from autopar._compat import MaskPartial
from autopar.cluster import Cluster
from autopar.cost_models import comm, compute, memory
from autopar.cost_models.comm import Collective, collective_time, redistribute_time

S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()
KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]


@pytest.fixture(scope="module")
def h100() -> Cluster:
    return Cluster.preset("dgx-h100", nodes=2, mesh=(2, 8), axis_names=("dp", "tp"))


# --------------------------------------------------------------------------- collectives
@pytest.mark.parametrize("kind", KINDS)
def test_collective_monotonic_and_free_on_size1(kind: str, h100: Cluster) -> None:
    times = [collective_time(kind, b, "tp", h100) for b in (0, 1e3, 1e6, 1e9)]
    assert times[0] == 0.0
    assert times == sorted(times) and len(set(times)) == 4
    # The inter-node axis is slower than NVLink for the same bytes (once bandwidth dominates).
    assert collective_time(kind, 1e9, "dp", h100) > collective_time(kind, 1e9, "tp", h100)
    one = Cluster.preset("dgx-h100", mesh=(1, 8), axis_names=("x", "tp"))
    assert collective_time(kind, 1e9, "x", one) == 0.0


def test_collective_formulas(h100: Cluster) -> None:
    link, n, b = h100.link("tp"), 8, 64e6
    beta = link.bandwidth * link.efficiency
    assert collective_time("all_gather", b, 1, h100) == pytest.approx(
        (n - 1) * link.latency + (n - 1) / n * b / beta
    )
    assert collective_time(Collective.ALL_TO_ALL, b, 1, h100) == pytest.approx(
        (n - 1) * link.latency + (n - 1) / n**2 * b / beta
    )
    for nbytes in (1e3, b, 1e9):  # all-reduce: the cheaper of ring and binary tree
        ring = 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / beta
        tree = 2 * math.ceil(math.log2(n)) * link.latency + 2 * nbytes / beta
        assert collective_time("all_reduce", nbytes, "tp", h100) == pytest.approx(min(ring, tree))
    small, large = 1e3, 1e9  # the tree wins small messages, the ring large ones
    ring_small = 2 * (n - 1) * link.latency + 2 * (n - 1) / n * small / beta
    assert collective_time("all_reduce", small, "tp", h100) < ring_small
    for axis in ("dp", "tp"):
        ar = collective_time("all_reduce", large, axis, h100)
        rs_ag = collective_time("reduce_scatter", large, axis, h100) + collective_time(
            "all_gather", large, axis, h100
        )
        assert ar == pytest.approx(rs_ag, rel=1e-12)
    assert comm.send_recv_time(1e6, link) == pytest.approx(link.latency + 1e6 / beta)
    assert comm.send_recv_time(0, link) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        collective_time("broadcast", 1.0, 0, h100)


# --------------------------------------------------------------------------- redistribution
def test_redistribute_matches_single_collectives(h100: Cluster) -> None:
    shape, item = (64, 1024), 2
    full = 64 * 1024 * item
    assert redistribute_time((S0, R), (R, R), shape, item, h100) == pytest.approx(
        collective_time("all_gather", full, 0, h100)
    )
    assert redistribute_time((R, P), (R, R), shape, item, h100) == pytest.approx(
        collective_time("all_reduce", full, 1, h100)
    )
    assert redistribute_time((R, P), (R, S1), shape, item, h100) == pytest.approx(
        collective_time("reduce_scatter", full, 1, h100)
    )
    assert redistribute_time((R, S0), (R, S1), shape, item, h100) == pytest.approx(
        collective_time("all_to_all", full, 1, h100)
    )
    # MaskPartial (vocab-parallel embedding) reduces like a Partial.
    assert redistribute_time((R, MaskPartial()), (R, R), shape, item, h100) == pytest.approx(
        collective_time("all_reduce", full, 1, h100)
    )
    for spec in [(R, R), (S0, S1), (P, R)]:
        assert redistribute_time(spec, spec, shape, item, h100) == 0.0
    assert redistribute_time((R, R), (S0, P), shape, item, h100) == 0.0  # local only


def test_redistribute_bytes_use_local_shape(h100: Cluster) -> None:
    shape, item = (64, 1024), 4
    # Gather over dp while tp still shards dim 1: the dp groups move 64 x 128 elements.
    t = redistribute_time((S0, S1), (R, S1), shape, item, h100)
    assert t == pytest.approx(collective_time("all_gather", 64 * 128 * item, "dp", h100))
    # Reduce over tp while dp shards dim 0: 32 x 1024 elements; uneven dims round up.
    t = redistribute_time((S0, P), (S0, R), (63, 1024), item, h100)
    assert t == pytest.approx(collective_time("all_reduce", 32 * 1024 * item, "tp", h100))
    # Both axes: DTensor goes inner first (tp on 32 x 1024), then dp on the full tensor.
    t = redistribute_time((S0, P), (R, R), shape, item, h100)
    expected = collective_time("all_reduce", 32 * 1024 * item, "tp", h100) + collective_time(
        "all_gather", 64 * 1024 * item, "dp", h100
    )
    assert t == pytest.approx(expected)
    # (S0, R) -> (R, S1): the local slice on tp happens first, so dp gathers 64 x 128.
    t = redistribute_time((S0, R), (R, S1), shape, item, h100)
    assert t == pytest.approx(collective_time("all_gather", 64 * 128 * item, "dp", h100))


def test_redistribute_steps() -> None:
    assert comm.redistribute_steps((S0, R), (R, R)) == [(0, Collective.ALL_GATHER)]
    assert comm.redistribute_steps((P, S0), (R, S1)) == [(1, "all_to_all"), (0, "all_reduce")]
    # S1 on the outer axis would nest the inner S1: DTensor unshards the inner axis first.
    assert comm.redistribute_steps((P, S0), (S1, S1), include_local=True) == [
        (1, "all_gather"),
        (0, "reduce_scatter"),
        (1, "local"),
    ]
    assert comm.redistribute_steps((R, R), (S0, P)) == []
    assert comm.redistribute_steps((R, R), (S0, P), include_local=True) == [
        (0, "local"),
        (1, "local"),
    ]
    # Nested sharding: (S0, S0) -> (R, S0) must unshard the inner axis first.
    assert comm.redistribute_steps((S0, S0), (R, S0)) == [(1, "all_gather"), (0, "all_gather")]
    with pytest.raises(ValueError, match="cannot redistribute"):
        comm.redistribute_steps((S0,), (P,))
    with pytest.raises(ValueError, match="different mesh ranks"):
        comm.redistribute_steps((S0,), (R, R))


def test_unsupported_transition_is_infinite(h100: Cluster) -> None:
    assert redistribute_time((S0, R), (P, R), (8, 8), 4, h100) == math.inf
    assert redistribute_time((R, P), (R, Partial("max")), (8, 8), 4, h100) == math.inf


def test_step_order_matches_dtensor() -> None:
    """Our step order is DTensor's greedy planner's, for every 2-D and 3-D spec pair."""
    try:  # private: only this cross-check needs it
        from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
    except ImportError:
        pytest.skip("DTensor's redistribute planner moved")
    from autopar._compat import DTensorSpec, FakeStore, TensorMeta

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        for mesh_shape, names in [((2, 4), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))]:
            mesh = Cluster.preset("cpu", mesh=mesh_shape, axis_names=names).device_mesh()
            meta = TensorMeta(torch.Size((8, 8)), (8, 1), torch.float32)
            places = [S0, S1, R, P]
            for src, dst in itertools.product(
                itertools.product(places, repeat=len(names)), repeat=2
            ):
                infos = _gen_transform_infos_non_cached(
                    DTensorSpec(mesh, src, tensor_meta=meta),
                    DTensorSpec(mesh, dst, tensor_meta=meta),
                )
                theirs = [(i.mesh_dim, *i.src_dst_placements) for i in infos]
                ours = [(a, c, t) for a, _, c, t in comm.redistribute_plan(src, dst, mesh_shape)]
                assert ours == theirs, (src, dst)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- memory
def test_local_shape_and_numel() -> None:
    assert memory.local_shape((10, 6), (S0, R), (4, 2)) == (3, 6)  # ceil(10 / 4)
    assert memory.local_shape((10, 6), (S0, S0), (2, 2)) == (3, 6)  # nested: 10 -> 5 -> 3
    assert memory.local_shape((10, 6), (P, Shard(-1)), (2, 3)) == (10, 2)
    assert memory.local_numel((10, 6), (MaskPartial(), S1), (2, 2)) == 30
    with pytest.raises(ValueError, match="2 placements for mesh"):
        memory.local_shape((4,), (S0, R), (2,))
    with pytest.raises(ValueError, match="shards dim 1 of a 1-D tensor"):
        memory.local_shape((4,), (S1,), (2,))


def test_param_state_bytes() -> None:
    """What the runtime holds per parameter (`runtime.optimizer`), category by category."""
    f32, bf16 = torch.float32, torch.bfloat16
    # fp32 AdamW: param + grad + exp_avg + exp_avg_sq, 4 bytes each
    assert memory.param_state_bytes((1000,), f32, (R,), (2,), optimizer="adamw") == 16000
    assert memory.param_state_bytes((1000,), f32, (R,), (2,), optimizer="sgd") == 8000
    # a model handed over in bf16 trains in bf16: no master copy, bf16 states
    assert memory.param_state_bytes((1000,), bf16, (R,), (2,)) == 1000 * 2 * 4
    # the mixed-precision policy (captured in bf16): fp32 master + its bf16 cast, fp32
    # gradient, 2 fp32 states
    assert memory.param_state_breakdown((1000,), bf16, (R,), (2,), mixed_precision=True) == {
        "parameters": 1000 * (4 + 2),
        "gradients": 1000 * 4,
        "optimizer_state": 1000 * 8,
    }
    assert memory.param_state_bytes(
        (1000,), bf16, (R,), (2,), optimizer="sgd", mixed_precision=True
    ) == 1000 * (4 + 2 + 4)
    # not trained (a buffer or an input): the tensor alone
    assert memory.param_state_bytes((1000,), bf16, (R,), (2,), trained=False) == 2000
    # the local shard counts: Shard(0) over 4 devices holds ceil(1001 / 4) = 251 rows
    assert memory.param_state_bytes((1001, 2), f32, (S0, R), (4, 2)) == 251 * 2 * 16
    assert memory.replicas((S0, R), (4, 2)) == 2 and memory.replicas((R, R), (4, 2)) == 8
    # ZeRO-1: working param + full gradient buffer; flat master, states and gradient shard
    # over the replicas (padded to ceil(N / R))
    assert memory.param_state_breakdown((1000, 2), f32, (S0, R), (4, 2), shard_optimizer=True) == {
        "parameters": 500 * 4,
        "gradients": 500 * 4 + 250 * 4,
        "optimizer_state": 250 * 12,
    }
    # ZeRO-2 frees the full gradient; under the policy master/states/grad shard are fp32
    assert memory.param_state_breakdown(
        (1001,), bf16, (R,), (2,), shard_optimizer=True, shard_gradients=True, mixed_precision=True
    ) == {"parameters": 1001 * 2, "gradients": 501 * 4, "optimizer_state": 501 * 12}
    assert memory.param_state_bytes((1000, 2), f32, (S0, S1), (4, 2), shard_optimizer=True) == (
        250 * (4 + 4 + 4 + 12)  # no replicas: the flat master is a full copy
    )
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        memory.param_state_bytes((1,), f32, (R,), (2,), optimizer="lion")
    assert memory.activation_bytes((8, 16), 2, (S0, R), (4, 2)) == 2 * 16 * 2
    assert memory.activation_bytes((8, 16), 2, None, (4, 2)) == 8 * 16 * 2


def test_search_prices_memory_with_the_memory_model() -> None:
    """The search's per-node memory is the memory model's formulas, nothing else."""
    from autopar.capture import capture
    from autopar.passes.strategies import NodeStrategy
    from autopar.search.costs import CostContext

    captured = capture(nn.Linear(24, 40), (torch.randn(12, 24),), loss_fn=lambda y: y.sum())
    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("a", "b"))
    ctx = CostContext(cluster, optimizer_states=1, shard_optimizer=True)
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    by_fqn = {fqn: name for name, fqn in captured.params.items()}
    weight, x = nodes[by_fqn["weight"]], nodes[next(iter(captured.user_inputs))]
    addmm = next(n for n in nodes.values() if n.target == torch.ops.aten.addmm.default)
    for spec in [(R, R), (S0, R), (R, S1), (S0, S1)]:
        expected = memory.param_state_bytes(
            (40, 24), torch.float32, spec, (2, 2), optimizer=1, shard_optimizer=True
        )
        assert ctx.node_memory(weight, NodeStrategy((), (spec,))) == expected
        r = memory.replicas(spec, (2, 2))
        n = 40 * 24 // (4 // r)  # local elements
        assert expected == n * 8 + -(-n // r) * 12  # param + grad buffer; shards of the rest
    # a user input is not trained: its bytes only
    assert ctx.node_memory(x, NodeStrategy((), ((S0, R),))) == 6 * 24 * 4
    # an activation: the local bytes of its output
    out = NodeStrategy(((R, R), (S0, R), (R, R)), ((S0, R),))
    assert ctx.node_memory(addmm, out) == memory.activation_bytes((12, 40), 4, (S0, R), (2, 2))


# --------------------------------------------------------------------------- compute
@pytest.fixture(scope="module")
def linear_graph() -> torch.fx.Graph:
    ep = torch.export.export(nn.Linear(24, 40), (torch.randn(12, 24),)).run_decompositions()
    return ep.graph


def _node(graph: torch.fx.Graph, op) -> torch.fx.Node:
    return next(n for n in graph.nodes if n.op == "call_function" and n.target == op)


def test_addmm_flops_bytes(linear_graph: torch.fx.Graph) -> None:
    aten = torch.ops.aten
    addmm = _node(linear_graph, aten.addmm.default)
    m, k, n = 12, 24, 40
    assert compute.node_flops(addmm) == 2 * m * n * k
    assert compute.node_bytes(addmm) == 4 * (n + m * k + k * n + m * n)
    assert compute.backward_factor(addmm) == 2.0
    permute = _node(linear_graph, aten.permute.default)
    assert compute.node_flops(permute) == 0 and compute.node_bytes(permute) == 0
    assert compute.backward_factor(permute) == 1.0
    placeholder = next(iter(linear_graph.nodes))
    assert compute.node_flops(placeholder) == 0 and compute.node_bytes(placeholder) == 0


def _meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _one_op(op, *vals: torch.Tensor, **kwargs) -> torch.fx.Node:
    """A one-op graph whose inputs carry (meta tensor) ``meta["val"]``, like capture's."""
    g = Graph()
    ins = []
    for i, v in enumerate(vals):
        ph = g.placeholder(f"x{i}")
        ph.meta["val"] = v
        ins.append(ph)
    node = g.call_function(op, tuple(ins), kwargs)
    node.meta["val"] = op(*vals, **kwargs)
    return node


def test_sdpa_and_elementwise_flops() -> None:
    aten = torch.ops.aten
    b, h, t, d = 2, 4, 16, 8
    q = _meta(b, h, t, d)
    full = _one_op(aten.scaled_dot_product_attention.default, q, q, q)
    assert compute.node_flops(full) == 4 * b * h * t * t * d
    causal = _one_op(aten.scaled_dot_product_attention.default, q, q, q, is_causal=True)
    assert compute.node_flops(causal) == 2 * b * h * t * t * d
    assert compute.backward_factor(full) == 2.5
    assert compute.node_dtype(full) == torch.bfloat16
    relu = _one_op(aten.relu.default, _meta(3, 5))
    assert compute.node_flops(relu) == 15 and compute.node_bytes(relu) == 2 * 30
    red = _one_op(aten.sum.dim_IntList, _meta(3, 5), dim=[1])
    assert compute.node_flops(red) == 15  # a reduction touches every input element
    emb = _one_op(aten.embedding.default, _meta(1000, 8), _meta(4, dtype=torch.int64))
    assert compute.node_bytes(emb) == 4 * 8 * 2 + 4 * 8 + 4 * 8 * 2  # rows read, ids, output


def test_compute_time_roofline() -> None:
    from dataclasses import replace

    from autopar.cluster import DeviceSpec

    peak, bw, eff, half, mem_eff, launch = 100e12, 2e12, 0.8, 1e9, 0.9, 4e-6
    device = DeviceSpec(
        "x", {"float32": peak / 8, "bfloat16": peak}, 1e9, bw, eff, half, 0.5, mem_eff, launch
    )
    c = replace(Cluster.preset("dgx-h100"), device=device)
    f = 1e12  # one large matmul kernel: the size curve f / (f + half)
    expected = f / (peak * eff * f / (f + half)) + launch
    assert compute.compute_time(f, 1e6, "bfloat16", c) == pytest.approx(expected)
    # three kernels of a third of the work each: each further from peak, three launches
    third = f / 3
    per = third / (peak * eff * third / (third + half))
    assert compute.compute_time(f, 1e6, "bfloat16", c, kernels=3) == pytest.approx(
        3 * per + 3 * launch
    )
    assert compute.compute_time(f, 0, "float32", c) > compute.compute_time(f, 0, "bfloat16", c)
    mem = 1e9 / (bw * mem_eff) + launch  # memory-bound: bandwidth at memory_efficiency
    assert compute.compute_time(1e6, 1e9, torch.bfloat16, c, op="memory") == pytest.approx(mem)
    att = f / (peak * 0.5) + launch
    assert compute.compute_time(f, 1e6, "bfloat16", c, op="attention") == pytest.approx(att)
    relu = _one_op(torch.ops.aten.relu.default, _meta(1024, 1024, dtype=torch.float32))
    assert compute.op_class(relu) == "memory"
    assert compute.node_time(relu, c) == pytest.approx(8 * 2**20 / (bw * mem_eff) + launch)
    assert compute.node_time(relu, c, fraction=0.5) == pytest.approx(
        4 * 2**20 / (bw * mem_eff) + launch
    )
    with pytest.raises(ValueError, match="unknown op class"):
        compute.compute_time(1.0, 1.0, "float32", c, op="conv")


def test_recompute_prices_the_forward_share_of_a_node() -> None:
    """`CostContext.forward_time` (what recomputing a node costs) is the roofline of its
    forward work alone, on the strategy's share; views cost nothing."""
    from autopar.capture import capture
    from autopar.passes.strategies import NodeStrategy
    from autopar.search.costs import CostContext

    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU())
    captured = capture(model, (torch.randn(64, 256),), loss_fn=lambda y: y.sum())
    cluster = Cluster.preset("dgx-h100", nodes=1, mesh=(2, 4), axis_names=("a", "b"))
    ctx = CostContext(cluster)
    nodes = list(captured.gm.graph.nodes)
    addmm = next(n for n in nodes if n.target == torch.ops.aten.addmm.default)
    relu = next(n for n in nodes if n.target == torch.ops.aten.relu.default)
    view = next((n for n in nodes if n.target == torch.ops.aten.view.default), None)
    split = NodeStrategy(((S0, R), (S0, R), (R, R)), ((S0, R),))  # 2-way on axis a
    flops, nbytes = compute.node_flops(addmm), ctx.local_bytes(addmm, split)
    expected = compute.compute_time(flops / 2, nbytes, "float32", cluster)
    assert ctx.forward_time(addmm, split) == pytest.approx(expected, rel=1e-12)
    # a matmul's backward is twice its forward: node_cost prices 3x the FLOPs and the bytes
    # in three kernels (forward, grad of the input, grad of the weight)
    full = compute.compute_time(3 * flops / 2, 3 * nbytes, "float32", cluster, kernels=3)
    assert ctx.node_cost(addmm, split) == pytest.approx(full, rel=1e-12)
    rep = NodeStrategy(((R, R),), ((R, R),))
    relu_fwd = compute.compute_time(
        compute.node_flops(relu), compute.node_bytes(relu), "float32", cluster, op="memory"
    )
    assert ctx.forward_time(relu, rep) == pytest.approx(relu_fwd, rel=1e-12)
    assert 0 < ctx.forward_time(relu, rep) < ctx.node_cost(relu, rep)
    if view is not None:
        assert ctx.forward_time(view, rep) == 0.0


def test_a_replicated_operand_is_read_whole_by_every_rank() -> None:
    """A node's bytes are its operands' and outputs' local sizes under the strategy: a
    data-parallel matmul reads the whole weight on every rank (a small batch is bound by
    it), and each of its three kernels (forward, grad of the input, of the weight) moves
    as much as the forward: not the node's bytes over the work's split."""
    from autopar.capture import capture
    from autopar.passes.strategies import NodeStrategy
    from autopar.search.costs import CostContext

    model = nn.Linear(1024, 1024)
    captured = capture(model, (torch.randn(8, 1024),), loss_fn=lambda y: y.sum())
    cluster = Cluster.preset("dgx-h100", nodes=1, mesh=(8,))
    ctx = CostContext(cluster)
    addmm = next(n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.addmm.default)
    x, w, bias, out = 8 * 1024 * 4, 1024 * 1024 * 4, 1024 * 4, 8 * 1024 * 4
    assert compute.node_bytes(addmm) == x + w + bias + out
    dp = NodeStrategy(((R,), (S0,), (R,)), ((S0,),))  # bias, rows split, weight replicated
    assert ctx.local_bytes(addmm, dp) == bias + x / 8 + w + out / 8
    flops = compute.node_flops(addmm)
    expected = compute.compute_time(
        3 * flops / 8, 3 * (bias + x / 8 + w + out / 8), "float32", cluster, kernels=3
    )
    assert ctx.node_cost(addmm, dp) == pytest.approx(expected, rel=1e-12)
    # memory-bound: three reads of the whole weight, however many ranks split the rows
    bw = cluster.device.memory_bandwidth * cluster.device.memory_efficiency
    assert ctx.node_cost(addmm, dp) > 3 * w / bw
    tp = NodeStrategy(((S0,), (R,), (S1,)), ((S1,),))  # the weight's columns split
    assert ctx.local_bytes(addmm, tp) == bias / 8 + x + w / 8 + out / 8
    tp_bytes = 3 * (bias / 8 + x + w / 8 + out / 8)
    tp_time = compute.compute_time(3 * flops / 8, tp_bytes, "float32", cluster, kernels=3)
    assert ctx.node_cost(addmm, tp) == pytest.approx(tp_time, rel=1e-12)


def test_a_matmul_runs_at_each_of_its_sides_share_of_the_rate() -> None:
    """With `matmul_half_dim` h, a matmul's efficiency is scaled by d / (d + h) for each of
    its local sides d (rows, inner, columns under the strategy); 0 changes nothing."""
    from dataclasses import replace

    from autopar.capture import capture
    from autopar.passes.strategies import NodeStrategy
    from autopar.search.costs import CostContext

    base = Cluster.preset("cpu", mesh=(4,))
    thin = replace(base, device=replace(base.device, matmul_half_dim=32.0))
    f = 1e9
    plain = compute.compute_efficiency(f, "matmul", base)
    assert compute.compute_efficiency(f, "matmul", base, dims=(64, 64, 64)) == plain
    assert compute.compute_efficiency(f, "matmul", thin, dims=(32,)) == pytest.approx(plain / 2)
    both = compute.compute_efficiency(f, "matmul", thin, dims=(32, 96, 32))
    assert both == pytest.approx(plain / 2 * 3 / 4 / 2)
    assert compute.compute_efficiency(f, "matmul", thin, dims=None) == plain
    assert 0 < compute.compute_efficiency(f, "matmul", thin, dims=(1, 1e9, 1e9)) < plain <= 1
    # a second small side slows it further; a wider one never slows it
    wide = compute.compute_efficiency(f, "matmul", thin, dims=(32, 4096, 4096))
    assert both < wide < plain / 2
    captured = capture(nn.Linear(512, 256), (torch.randn(128, 512),), loss_fn=lambda y: y.sum())
    addmm = next(n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.addmm.default)
    assert compute.matmul_dims(addmm) == ((1, 0, 128), (1, 1, 512), (2, 1, 256))
    dp = NodeStrategy(((R,), (S0,), (R,)), ((S0,),))  # 32 rows per rank
    tp = NodeStrategy(((S0,), (R,), (S1,)), ((S1,),))  # 64 columns per rank
    sides = compute.matmul_dims(addmm)
    assert compute.local_matmul_dims(sides, dp.inputs, (4,)) == (32, 512, 256)
    assert compute.local_matmul_dims(sides, tp.inputs, (4,)) == (128, 512, 64)
    slow, fast = CostContext(thin), CostContext(base)
    for s in (dp, tp):
        assert slow.node_cost(addmm, s) > fast.node_cost(addmm, s)
        assert slow.forward_time(addmm, s) > fast.forward_time(addmm, s)
    relu = nn.ReLU()
    assert (
        compute.matmul_dims(
            next(
                iter(capture(relu, (torch.randn(4, 4),), loss_fn=lambda y: y.sum()).gm.graph.nodes)
            )
        )
        is None
    )


def test_ring_price_spreads_the_balanced_causal_split_and_adds_its_swaps() -> None:
    """`cost_models.ring`: with free K/V passes a rank's kernels sum to its even share and
    the causal split adds its partner swaps; with passes as long as an even step, the causal
    split's uneven steps (some with nothing to compute) cost more than an even spread."""
    from autopar.cost_models.ring import ring_attention_time, ring_forward_time
    from autopar.passes.strategies.rules.ring import HalfBytes

    link, n = Cluster.preset("dgx-h100", mesh=(8,), axis_names=("cp",)).link(0), 8
    halves = HalfBytes(q=1e6, out=2e6, lse=1e4)
    forward_swaps = comm.send_recv_time(1e6, link) + comm.send_recv_time(2e6 + 1e4, link)
    backward_swaps = comm.send_recv_time(5e6 + 1e4, link) + comm.send_recv_time(1e6, link)
    assert ring_forward_time(1.0, n, 0.0, link, halves) == pytest.approx(1.0 + forward_swaps)
    both = ring_attention_time(3.0, 2.0, n, 0.0, link, halves)
    assert both == pytest.approx(3.0 + forward_swaps + backward_swaps)
    kv = 1e8
    step = comm.send_recv_time(kv, link)
    assert ring_forward_time(n * step, n, kv, link) == pytest.approx(n * step)
    no_swaps = HalfBytes(0.0, 0.0, 0.0)
    assert ring_forward_time(n * step, n, kv, link, no_swaps) > 1.2 * n * step


def test_pipelines_price_a_weights_all_reduce_once_per_step() -> None:
    """In a pipeline (4 microbatches: `CostWeights.sync` = 1/4) a weight gradient's
    all-reduce runs once per step, as `runtime.pipeline` defers every replicated axis,
    whatever the weight's other axes: Megatron's TP weight (sharded on tp, replicated on
    dp) counts 1/4; an FSDP weight's reduce-scatter runs in every microbatch's backward."""
    from autopar.capture import capture
    from autopar.capture.analysis import batch_dependent
    from autopar.capture.operands import tensor_operands
    from autopar.passes.strategies import NodeStrategy
    from autopar.search.costs import CostContext, CostWeights

    lin = nn.Linear(24, 40, bias=False)
    captured = capture(lin, (torch.randn(12, 24),), loss_fn=lambda y: y.sum())
    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("dp", "tp"))
    weights = CostWeights(sync=0.25)
    ctx = CostContext(cluster, weights=weights, batch_dependent=batch_dependent(captured))
    mm = next(n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    pos, w = next((p, op) for p, op in tensor_operands(mm) if ctx.is_weight(op.producer))
    megatron = NodeStrategy(((S0, R), (R, S1)), ((S0, S1),))  # column-parallel, batch on dp
    assert ctx.sync_weight(w, (R, S1), mm, megatron, pos) == 0.25
    assert ctx.sync_weight(w, (S0, S1), mm, megatron, pos) == 1.0  # FSDP on dp
    unpipelined = CostContext(cluster, batch_dependent=batch_dependent(captured))
    assert unpipelined.sync_weight(w, (R, S1), mm, megatron, pos) == 1.0
