"""Layout search (Alpa's outer loop) on layer templates, planning only (fake process group).

- A template (two captured blocks, the second weighted) prices exactly like the full graph.
- Block weights are staged, priced and shared with their block.
- Megatron-Core's 1.7B weak-scaling row on 48 H100s: the search keeps TP inside a node,
  fits in 80 GB, and is no slower than Megatron's own (TP 1, PP 1) under the same model.
- Every pipeline degree is priced (the step time is not unimodal in the degree).
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
        pricer = _Pricer(model, batch, cluster, options, None)
        megatron, _, _ = pricer.price(Layout(pp=1, dp=48, tp=1, microbatches=1), None)
        # the prune's bound is below what it bounds
        assert pricer.bound(Layout(pp=1, dp=48, tp=1, microbatches=1)) <= megatron
        assert any(str(v).startswith("pruned") for v in found.tried.values()), found.tried
    best = found.best
    assert 8 % best.tp == 0  # TP never crosses a node
    assert found.peak_memory <= cluster.device.memory_bytes
    assert found.step_time <= megatron * (1 + 1e-9), found.tried
    assert math.isfinite(found.step_time) and found.tried[best.key] == found.step_time


def test_every_degree_is_priced_without_assuming_unimodal_step_times() -> None:
    """No degree is skipped for its neighbours being slower: a fast degree after two slower
    ones still wins; infeasible degrees (None) are passed over; pp = 1 is priced first."""
    from autopar.search.layouts import fastest, pricing_order
    from autopar.search.workers import price_in_processes

    def search(times: dict[int, float | None]) -> tuple[float | None, list[int]]:
        degrees = pricing_order([[Layout(pp, 1, 1, 8)] for pp in times])
        priced: list[int] = []
        bars: list[float] = []

        def price(i, nxt, bar):
            pp = degrees[i][0].pp
            priced.append(pp)
            bars.append(bar.value)
            if times[pp] is None:
                return None
            bar.lower(times[pp])
            return (times[pp], 0.0, degrees[i][0])

        found = fastest(price_in_processes(len(degrees), price, 1))
        assert bars[0] == math.inf and bars == sorted(bars, reverse=True)  # the best so far
        return (found[0] if found else None), priced

    assert search({2: 2.0, 1: 1.5, 4: 3.0, 8: 0.5}) == (0.5, [1, 2, 4, 8])
    assert search({1: 3.0, 2: None, 4: None, 8: 3.5, 16: 2.0}) == (2.0, [1, 2, 4, 8, 16])
    assert search({1: None, 2: None}) == (None, [1, 2])


def test_degrees_priced_on_forked_processes_come_back_in_pricing_order() -> None:
    """On two processes every degree is priced once, by either (this one from the first
    on, the other from the last back), under the bar of both (the best any has found when
    a degree starts), and the answers come back in pricing order with the winner the one
    process would pick: the first among equals."""
    import os
    import time

    from autopar.search.layouts import fastest
    from autopar.search.workers import price_in_processes

    steps = [3.0, 2.5, None, 1.0, 4.0, 1.0, 2.0, None, 0.5, 0.5, 6.0]

    def price(i, nxt, bar):
        assert nxt is None or nxt != i  # the next degree this process takes is another
        time.sleep(0.05)  # long enough for the forked process to start and take some
        seen = bar.value
        if steps[i] is not None:
            bar.lower(steps[i])
        found = None if steps[i] is None else (steps[i], float(i), Layout(i + 1, 1, 1, 1))
        return (i, os.getpid(), seen, found)

    out = price_in_processes(len(steps), price, 2)
    assert [i for i, *_ in out] == list(range(len(steps)))
    assert len({pid for _, pid, _, _ in out}) == 2  # both processes priced some
    assert out[0][1] == os.getpid() != out[-1][1]  # this one the first, the other the last
    for _, _, seen, _ in out:  # each degree saw a bar some degree's step had set, or none
        assert seen == math.inf or seen in steps
    best = fastest([found for *_, found in out])
    assert best == (0.5, 8.0, Layout(9, 1, 1, 1))  # the first of the two 0.5s


def test_a_failed_search_process_leaves_its_degrees_to_this_one() -> None:
    """A forked process whose pricing raises, or that dies: its degree (and every degree
    it would have taken) is priced again on this process, with a warning naming why."""
    import os
    import time

    from autopar.search.workers import price_in_processes

    parent = os.getpid()

    def price(i, nxt, bar):
        time.sleep(0.05)
        if os.getpid() != parent:
            raise RuntimeError("boom in the child")
        return i * 10

    with pytest.warns(RuntimeWarning, match="boom in the child"):
        out = price_in_processes(6, price, 2)
    assert out == [0, 10, 20, 30, 40, 50]

    def dies(i, nxt, bar):  # a child that exits without a word (killed, out of memory)
        time.sleep(0.05)
        if os.getpid() != parent:
            os._exit(3)
        return i * 10

    with pytest.warns(RuntimeWarning, match="exited unexpectedly"):
        out = price_in_processes(6, dies, 2)
    assert out == [0, 10, 20, 30, 40, 50]


def test_two_search_processes_find_what_one_finds(monkeypatch) -> None:
    """The layout search on two processes: the same winner, step and peak as on one, and
    every layout both priced at the same price (which layouts are pruned depends on when
    the other process's best arrives)."""
    from autopar.search import workers

    model, batch = _meta_gpt("tiny4", 16)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    forks, fork = [], workers._fork
    monkeypatch.setattr(workers, "_fork", lambda *args: forks.append(1) or fork(*args))
    found = {}
    for n in (1, 2):
        monkeypatch.setenv(workers.PROCESSES_ENV, str(n))
        with fake_group(cluster.world_size):
            found[n] = search_layout(model, batch, cluster, SearchOptions())
    one, two = found[1], found[2]
    assert forks == [1]  # enough degrees to fork, on the second search only
    assert (two.best, two.step_time, two.peak_memory) == (one.best, one.step_time, one.peak_memory)
    prices = {layout: step for step, _, layout in one.priced}
    both = [(step, layout) for step, _, layout in two.priced if layout in prices]
    assert len(both) > 1 and all(prices[layout] == step for step, layout in both)


def test_what_the_default_call_searches() -> None:
    """The layout is searched by default on a cluster given by its hardware (the preset's
    own mesh) with nothing pinned; a pinned mesh, strategy, placements or stage count keep
    the user's mesh; "auto" searches whatever the mesh."""
    from autopar.options import PlanOptions
    from autopar.planning import searches_layout

    free = [Cluster.preset("dgx-h100", nodes=4), Cluster.preset("cpu", nodes=4)]
    free.append(Cluster.preset("cpu", mesh=(4,), axis_names=("cpu",), devices_per_node=4))
    pinned = [Cluster.preset("dgx-h100", nodes=4, mesh=(4, 8), axis_names=("dp", "tp"))]
    pinned += [Cluster.preset("cpu", mesh=(4,)), Cluster.preset("cpu", nodes=1)]  # 1 device
    for c in free:
        assert searches_layout(PlanOptions(), c), c
        for pin in (
            {"pipeline_stages": 1},
            {"pipeline_stages": 2},
            {"strategy": "dp"},
            {"placements": {"wte.weight": "R"}},
        ):
            assert not searches_layout(PlanOptions(**pin), c), (c, pin)
    for c in pinned:
        assert not searches_layout(PlanOptions(), c), c
        assert searches_layout(PlanOptions(pipeline_stages="auto"), c)


def test_default_call_pipelines_a_memory_bound_gpt_where_it_pays() -> None:
    """Two V100 nodes joined by 25 Gb/s Ethernet, a 1 GiB budget: data parallelism must
    shard or recompute to fit; two pipeline stages hold half the model each and send only
    activations. The default call finds the pipeline; pipeline_stages=1 turns it off."""
    import autopar
    from samples.gpt import GPT, GPTConfig, example_batch

    cfg = GPTConfig(vocab_size=512, block_size=1024, n_layer=4, n_head=16, n_embd=1024)
    with torch.device("meta"):
        model = GPT(cfg)
    batch = example_batch(cfg, 8, device="meta")
    cluster = Cluster.preset("p3.16xlarge", nodes=2, devices_per_node=1)
    limit = 1.1 * 2**30
    plan = autopar.plan(model, batch, cluster=cluster, memory_limit=limit)
    assert plan.pipeline is not None and plan.pipeline.pp == 2, plan.solver["layout_candidates"]
    assert plan.mesh_shape[0] == 2 and plan.axis_names[0] == "pp"
    off = autopar.plan(model, batch, cluster=cluster, memory_limit=limit, pipeline_stages=1)
    assert off.pipeline is None and off.mesh_shape == cluster.mesh_shape
    assert plan.predicted_step_time < off.predicted_step_time
    assert max(plan.predicted_peak_memory, off.predicted_peak_memory) <= limit


def test_gradient_accumulation_where_the_whole_batch_does_not_fit() -> None:
    """Without pipelining, a batch whose activations do not fit runs as microbatches
    accumulating their gradients (a pipeline on a "pp" axis of 1); it is priced only where
    the whole batch needs memory levers or does not fit."""
    import autopar
    from autopar.views import summary

    model, batch = _meta_gpt("small", 64)
    cluster = Cluster.preset("dgx-a100-80g", nodes=1)
    roomy = SearchOptions()
    with fake_group(cluster.world_size):
        found = search_layout(model, batch, cluster, roomy, pipeline_stages=1)
    assert not found.best.accumulates
    assert any(
        v == "skipped: the whole batch fits without memory levers" for v in found.tried.values()
    )
    limit = 0.027 * 2**30
    with fake_group(cluster.world_size):
        found = search_layout(
            model, batch, cluster, SearchOptions(memory_limit=limit), pipeline_stages=1
        )
    best = found.best
    assert best.accumulates and best.microbatches > 1, found.tried
    assert str(found.tried[f"pp1 dp{best.dp} tp{best.tp} m1"]).startswith("infeasible")
    assert found.peak_memory <= limit
    plan = autopar.plan(
        model,
        batch,
        cluster=best.cluster(cluster),
        microbatches=best.microbatches,
        memory_limit=limit,
    )
    assert plan.pipeline.pp == 1 and plan.pipeline.microbatches == best.microbatches
    assert plan.axis_names[0] == "pp" and plan.mesh_shape[0] == 1
    assert f"gradient accumulation: {best.microbatches} microbatches" in summary(plan)
    # the stage ILP's memory, as the search priced it (the liveness replay of the final plan
    # also counts the weights its stage gathers, which the search's pipeline peak does not:
    # above memory_limit here, and `planning.warn_if_over_memory` says so)
    assert plan.solver["ilp_memory"] <= limit


def test_a_winner_whose_plan_is_over_memory_gives_way_to_the_next_fastest() -> None:
    """The search prices a pipeline's peak without its gradient buckets and gather buffers;
    the final plan's liveness simulation counts them. A winner whose final plan is over
    the limit is replaced by the next fastest layout whose plan fits, and the search's
    record says why."""
    import autopar

    model, batch = _meta_gpt("small", 64)
    cluster = Cluster.preset("dgx-a100-80g", nodes=1)
    limit = 30 * 2**20
    plan = autopar.plan(model, batch, cluster=cluster, memory_limit=limit)
    tried = plan.solver["layout_candidates"]
    over = {k: v for k, v in tried.items() if str(v).startswith("over memory")}
    assert over, tried
    assert plan.predicted_peak_memory <= limit
    kept = plan.solver["layout"]
    assert kept not in over and isinstance(tried[kept], float)
    # the layouts given up were priced faster than the one kept
    assert all(float(v.rsplit("priced ", 1)[1].split(" s")[0]) < tried[kept] for v in over.values())


def test_work_prepared_ahead_changes_no_price(monkeypatch) -> None:
    """While a layout's ILP solves, the next layout's template, strategies and prices are
    prepared (`search.ahead`), its ILPs started on a spare core, and taken by its own call:
    the search prices and decides exactly as it does without it (the winner's stage-mesh
    variants likewise: a second shape's ILP prepared while the first's solves). On one
    process: the layouts pruned depend on when another process's bar arrives."""
    from autopar.search import ahead, stage_meshes, workers

    monkeypatch.setenv(workers.PROCESSES_ENV, "1")

    model, batch = _meta_gpt("tiny4", 16)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    taken, started = [], []
    take, start = ahead.take, ahead.start

    def counting(key):
        found = take(key)
        taken.append(found is not None and found[-1] is not None)
        return found

    def starting(solve, *args):
        started.append(len(args[0]))  # the candidate's problems
        return start(solve, *args)

    monkeypatch.setattr(ahead, "take", counting)
    monkeypatch.setattr(ahead, "start", starting)
    with fake_group(cluster.world_size):
        with_ahead = search_layout(model, batch, cluster, SearchOptions())
        # work was taken, its solve started ahead where a core was spare; nothing (kept
        # work, a solve started ahead) outlives the search
        assert any(taken) == ahead.spare_core() == bool(started), (taken, started)
        assert not ahead._KEPT and not ahead._STARTED
        monkeypatch.setattr(_Pricer, "prepare_next", lambda self, layout, bar: None)
        monkeypatch.setattr(stage_meshes, "prepare_intra", lambda *args: None)  # its variants'
        taken.clear()
        without = search_layout(model, batch, cluster, SearchOptions())
        assert not any(taken)
    assert with_ahead.priced == without.priced
    assert with_ahead.tried == without.tried
