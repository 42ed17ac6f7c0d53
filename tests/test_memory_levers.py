"""Memory levers chosen by the search (planning only: fake process group, meta model).

Shrinking `memory_limit` step by step walks the plan through cheaper-in-memory, slower
plans, in the order the cost model prices them: the step as the runtime runs it (gradient
buckets, prefetched all-gathers; `search.step`), which is what the search ranks by and
`Plan.predicted_step_time` reports. Each step is checked against forced alternatives
(strategy x activation_checkpointing x reshard_after_forward pinned): the search's choice,
with the levers left to it, is never slower than the fastest forced alternative that fits,
and the walk's memory falls while its time rises.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from autopar.cluster import Cluster
from autopar.options import PlanOptions
from autopar.planning import fake_group, prepare
from autopar.search import MemoryInfeasible
from autopar.search.intra_op import search_plan
from autopar.search.peak import with_predicted_memory
from autopar.search.pins import SearchOptions
from autopar.views import axis_roles
from samples.gpt import GPT, GPTConfig, example_batch

ROLES = ("dp", "fsdp", "tp")
POLICIES = ("none", "selective", "full")
REL = 1e-6  # the ILP's relative gap is 1e-7
CANDIDATES_REL = 1e-3


@pytest.fixture(scope="module")
def captured():
    """GPT with long sequences (activations matter) on 4 H100s, captured once."""
    cfg = GPTConfig(vocab_size=4096, block_size=512, n_layer=2, n_head=4, n_embd=512)
    with torch.device("meta"):
        model = GPT(cfg)
    batch = example_batch(cfg, 8, device="meta")
    cluster = Cluster.preset("dgx-h100", devices_per_node=4)
    _, graph, *_ = prepare(model, batch, cluster, None, PlanOptions())
    return graph, cluster


@pytest.fixture(scope="module")
def setting(captured):
    """A planner on the captured model and every forced (role, policy, reshard) plan."""
    graph, cluster = captured
    with fake_group(cluster.world_size):
        mesh = cluster.device_mesh(device_type="cpu")

        def plan(**kw):
            return search_plan(graph, cluster, mesh, SearchOptions(**kw))

        forced = {}
        for role, policy in itertools.product(ROLES, POLICIES):
            for raf in (False, True) if role == "fsdp" else (False,):
                p = plan(strategy=role, activation_checkpointing=policy, reshard_after_forward=raf)
                forced[(role, policy, raf)] = p
        yield plan, forced


def _lever(p) -> tuple[str, bool]:
    policies = {pol for _, pol in p.memory.recompute} or {"none"}
    assert len(policies) == 1, p.memory.recompute  # identical layers share their levers
    return policies.pop(), bool(p.memory.reshard_after_forward)


def test_pinned_levers_are_applied_and_priced(captured, setting) -> None:
    _, forced = setting
    for (role, policy, raf), p in forced.items():
        assert axis_roles(p) == [role]
        assert _lever(p) == (policy, raf), (role, policy, raf)
    graph, _ = captured
    for role in ROLES:  # recompute trades time for memory, full more than selective
        none, sel, full = (forced[(role, x, False)] for x in POLICIES)
        assert none.predicted_step_time < sel.predicted_step_time < full.predicted_step_time
        # simulated on the same placements: the fastest plan under each lever may place
        # differently (TP with full recompute keeps the residual stream replicated rather
        # than gather it again in the recomputation, for more memory than without)
        peaks = [
            with_predicted_memory(graph, replace(none, memory=p.memory)).predicted_peak_memory
            for p in (none, sel, full)
        ]
        assert peaks[0] > peaks[1] > peaks[2], (role, peaks)
    for policy in ("none", "selective"):  # reshard: a second all-gather for less memory
        keep, free = forced[("fsdp", policy, False)], forced[("fsdp", policy, True)]
        assert keep.predicted_step_time < free.predicted_step_time
        assert keep.predicted_peak_memory > free.predicted_peak_memory
    # full recompute re-runs the layer's all-gathers too: it reshards whatever the flag says
    keep, free = forced[("fsdp", "full", False)], forced[("fsdp", "full", True)]
    assert keep.predicted_step_time == free.predicted_step_time
    assert keep.predicted_peak_memory == free.predicted_peak_memory
    # FSDP's gathered weights are counted: without resharding, FSDP holds more than its
    # sharded states alone, i.e. more than the sharded-states saving over DP suggests
    dp, fsdp = forced[("dp", "none", False)], forced[("fsdp", "none", False)]
    assert fsdp.predicted_peak_memory < dp.predicted_peak_memory


def test_shrinking_memory_walks_through_the_levers(setting) -> None:
    plan, forced = setting
    limits = sorted({p.predicted_peak_memory for p in forced.values()}, reverse=True)
    walk = []
    for limit in limits:
        limit *= 1 + 1e-9
        fits = [
            (p.predicted_step_time, k)
            for k, p in forced.items()
            if p.predicted_peak_memory <= limit
        ]
        best_forced = min(fits)
        chosen = []
        for role in ROLES:
            try:
                p = plan(strategy=role, memory_limit=limit)
            except MemoryInfeasible:
                assert not [k for _, k in fits if k[0] == role], (role, limit)
                continue
            assert p.predicted_peak_memory <= limit
            role_best = (
                min(t for t, k in fits if k[0] == role)
                if any(k[0] == role for _, k in fits)
                else None
            )
            if role_best is not None:  # the levers the search picks beat every pinned pair
                assert p.predicted_step_time <= role_best * (1 + REL), (role, limit)
            chosen.append((p.predicted_step_time, role, *_lever(p), p.predicted_peak_memory))
        step = min(chosen)
        assert step[0] <= best_forced[0] * (1 + REL)
        walk.append(step)
    times = [s[0] for s in walk]
    assert times == sorted(times), walk  # less memory never buys speed
    memories = [s[4] for s in walk]
    assert memories == sorted(memories, reverse=True), walk
    levers = [s[1:4] for s in walk]  # (role, recompute, reshard after forward)
    # with the overlap priced, FSDP wins at every limit: its reduce-scatter's exposed tail
    # is half DP's all-reduce's and its forward gathers hide under the previous layer;
    # reshard alone re-gathers in backward (waited in full) for less than selective saves;
    # FSDP + full recompute (gathers again, recomputes) still beats TP + selective (every
    # activation collective waited at once) at less memory
    order = [("fsdp", "none", False), ("fsdp", "selective", False), ("fsdp", "selective", True)]
    order.append(("fsdp", "full", False))  # full regathers whatever the flag says
    assert list(dict.fromkeys(levers)) == order, walk
    assert levers[-1][1] != "none", levers  # the tightest limit needs recompute


def test_auto_never_loses_to_a_pinned_lever(setting) -> None:
    plan, forced = setting
    for limit in (None, forced[("fsdp", "selective", False)].predicted_peak_memory * 1.001):
        auto = plan(memory_limit=limit)
        fits = [
            p.predicted_step_time
            for p in forced.values()
            if limit is None or p.predicted_peak_memory <= limit
        ]
        # the search ranks a few ILP optima by the overlapped step (`search.intra_op`): a
        # candidate set, not the overlapped step's optimum, so within 0.1% of every pin
        assert auto.predicted_step_time <= min(fits) * (1 + CANDIDATES_REL)
    none = plan(activation_checkpointing="none", reshard_after_forward=False)
    assert plan().predicted_step_time == none.predicted_step_time  # ample memory: no lever


def _per_node(result) -> tuple[float, float]:
    """The step time and memory summed node by node (what the pipeline search reads) with
    the optimizer's update once per step, plus the one-layer working sets the ILP adds:
    recomputed outputs, regathered weights."""
    from autopar.capture.export import layer_of
    from autopar.search.levers import gathered_bytes

    time = sum(result.node_time(n) for n in result.chosen) + result.update_time()
    memory = sum(result.node_memory(n) + result.held_weights(n) for n in result.chosen)
    canonical = result.levers.canonical
    for n, s in result.chosen.items():
        layer = layer_of(n)
        if layer is None or canonical[layer] != layer:
            continue
        if result.recomputed(n):
            memory += result.ctx.node_memory(n, s)
        if result.regathers(n):
            for pos, op in result.ctx.operands(n):
                if result.ctx.is_weight(op.producer):
                    src = result.ctx.output_spec(op, result.chosen[op.producer])
                    fwd = result.ctx.edge_parts(op, src, n, s, pos)[0]
                    if result._gathered(n, op, fwd):
                        memory += gathered_bytes(op, s, pos, result.ctx)
    return time, memory


@pytest.mark.parametrize(
    "kw",
    [
        dict(strategy="fsdp", activation_checkpointing="selective", reshard_after_forward=False),
        dict(strategy="fsdp", activation_checkpointing="none", reshard_after_forward=True),
        dict(strategy="fsdp", activation_checkpointing="full"),
        dict(strategy="tp", activation_checkpointing="full"),
        dict(strategy="auto", memory_limit=150e6),
    ],
)
def test_ilp_prices_the_levers_node_by_node(captured, kw) -> None:
    """The ILP's objective and memory equal the per-node accounting under the chosen levers."""
    from autopar.search.intra_op import solve_intra

    graph, cluster = captured
    with fake_group(cluster.world_size):
        mesh = cluster.device_mesh(device_type="cpu")
        result = solve_intra(graph, cluster, mesh, SearchOptions(**kw))
    time, memory = _per_node(result)
    assert result.objective == pytest.approx(time, rel=1e-9)
    assert result.memory == pytest.approx(memory, rel=1e-9)
    if kw.get("activation_checkpointing", "auto") != "none":
        assert any(result.recomputed(n) for n in result.chosen)


@pytest.mark.parametrize("strategy", ["dp", "fsdp", "tp", "auto"])
def test_levers_pinned_off_keep_the_objective_exactly(captured, strategy) -> None:
    """activation_checkpointing="none" adds only zero terms: the same optimum, bit for bit;
    reshard_after_forward=False adds only the gathered copies' memory."""
    from autopar.capture.analysis import batch_dependent
    from autopar.passes.strategies import enumerate_strategies
    from autopar.search.costs import CostContext
    from autopar.search.ilp import solve_intra_op
    from autopar.search.intra_op import build_decisions, price, share_layers
    from autopar.search.levers import add_levers
    from autopar.search.pins import apply_pins

    graph, cluster = captured
    with fake_group(cluster.world_size):
        mesh = cluster.device_mesh(device_type="cpu")
        options = SearchOptions(strategy=strategy)
        strats = apply_pins(graph, enumerate_strategies(graph.gm, mesh), options, mesh)
        ctx = CostContext(cluster, batch_dependent=batch_dependent(graph))
        dec = build_decisions(graph.gm, strats, ctx)
        rep = share_layers(dec, strats)
        plain, var_of = price(dec, rep, strats, ctx, 1e30, 30.0)
        index = {r: var_of[r] for r in set(rep)}
        off, _ = add_levers(dec, rep, index, strats, ctx, plain, recompute="none", reshard=False)
        before, after = solve_intra_op(plain), solve_intra_op(off)
    assert after.objective == before.objective
    assert after.memory >= before.memory  # + gathered weight copies kept until backward
    if strategy == "dp":
        assert after.memory == before.memory


def test_levers_priced_once_for_every_scale_equal_each_scale_alone(captured) -> None:
    """`add_levers_at_scales` prices the lever terms once and applies the gathers' scale
    per problem: each problem equals `add_levers` of that problem and scale alone, to the
    last bit (the ILP breaks exact ties by the order and values of its coefficients)."""
    from autopar.capture.analysis import batch_dependent
    from autopar.passes.strategies import enumerate_strategies
    from autopar.search.costs import CostContext
    from autopar.search.intra_op import build_decisions, price_scales, share_layers
    from autopar.search.levers import add_levers, add_levers_at_scales
    from autopar.search.pins import apply_pins

    graph, cluster = captured
    scales = ((1.0, 1.0), (0.3, 1.0), (2.0, 0.5))
    with fake_group(cluster.world_size):
        mesh = cluster.device_mesh(device_type="cpu")
        strats = apply_pins(graph, enumerate_strategies(graph.gm, mesh), SearchOptions(), mesh)
        ctx = CostContext(cluster, batch_dependent=batch_dependent(graph))
        dec = build_decisions(graph.gm, strats, ctx)
        rep = share_layers(dec, strats)
        priced = price_scales(dec, rep, strats, ctx, 1e30, 30.0, scales)
        index = {r: priced[0][1][r] for r in set(rep)}
        pairs = [(p, s) for s, (p, _) in zip(scales, priced, strict=True)]
        together = add_levers_at_scales(dec, rep, index, strats, ctx, pairs)
        alone = [add_levers(dec, rep, index, strats, ctx, p, comm_scale=s) for p, s in pairs]
    assert [p for p, _ in together] == [p for p, _ in alone]
    assert together[0][0].gated != together[1][0].gated  # the regathers' scale is applied
    assert all(lv == alone[0][1] for _, lv in together)
