"""Pipeline ranks on stage meshes of different shapes (`search.stage_meshes`).

Each rank's stages are priced on its own shape's costs and cut to balance them; the
activations cross "canonical" (split alike on any shape); a plan made so takes every node
from the plan of its stage's rank's shape. Parity of such pipelines with one device is in
tests/test_pipeline.py (pp 2 with ranks on dp x tp 2 x 1 and 1 x 2).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar.search.crossing import Crossing
from autopar.search.inter_op import price_schedule, stage_cluster
from autopar.search.layer_costs import PartCost, layer_range, stage_time
from autopar.search.stage_meshes import rank_variants


def _slower(costs, factor: float):
    """`costs` with every layer `factor` times slower (a shape the layers like less)."""
    from autopar.search.step import Part

    def scaled(p: PartCost) -> PartCost:
        program = tuple(
            Part(forward=q.forward * factor, backward=q.backward * factor) for q in p.program
        )
        return replace(p, time=p.time * factor, program=program)

    layer = scaled(costs.parts[0])
    return replace(costs, parts=(layer,) * len(costs.parts), pre=scaled(costs.pre))


def test_each_rank_is_priced_on_its_own_stage_mesh() -> None:
    """Rank 1 twice as slow per layer: the cuts give rank 0 three of the four layers, each
    stage's time is its layers' on its rank's costs, plus the canonical crossing's
    redistributions (sending, receiving); the same costs on both ranks price as one."""
    from tests.test_pipeline import _synthetic, every_cut

    fast, cluster, _ = _synthetic([], layer_forward=1e-3)
    hop = ((1e-4, 1e-4), (0.0, 1e-4))  # (receive, send), (forward, backward) each
    fast = every_cut(fast, Crossing(canonical_bytes=1e3, canonical=hop))
    slow = _slower(fast, 2.0)
    priced = price_schedule((fast, slow), "1f1b", 2, 4, cluster)
    assert priced.boundary == "canonical" and priced.cuts == (0, 3)
    sub = stage_cluster(cluster)
    first = stage_time(layer_range(fast, 0, 3), sub, fast.comm)
    last = stage_time(layer_range(slow, 3, 4), sub, slow.comm)
    assert priced.stage_times == pytest.approx((first + 1e-4, last + 2e-4))
    one = price_schedule(fast, "1f1b", 2, 4, cluster)
    assert price_schedule((fast, fast), "1f1b", 2, 4, cluster) == one
    assert one.boundary == "placed"


def test_the_first_and_last_ranks_are_offered_neighbouring_shapes() -> None:
    """tp halved or doubled inside a node, on the rank of the first stage, of the last, or
    both; never all ranks (that is a uniform layout), never a dp the microbatch's rows
    cannot split."""
    assert rank_variants(2, "1f1b", (2, 1), 8, 4) == [((1, 2), (2, 1)), ((2, 1), (1, 2))]
    # a V holds the first and the last stage on rank 0
    assert rank_variants(4, "zbv", (4, 2), 8, 8) == [
        ((8, 1), (4, 2), (4, 2), (4, 2)),
        ((2, 4), (4, 2), (4, 2), (4, 2)),
    ]
    three = rank_variants(3, "1f1b", (2, 2), 8, 4)
    assert len(three) == 6 and three[2] == ((4, 1), (2, 2), (4, 1))
    assert rank_variants(2, "1f1b", (8, 1), 8, 1) == []  # one row: no dp of 4 or 2
    assert rank_variants(2, "1f1b", (2, 4), 4, 8) == [((4, 2), (2, 4)), ((2, 4), (4, 2))]
    assert rank_variants(2, "1f1b", (4,), 4, 8) == []  # one stage axis: one shape


def test_a_plan_on_two_shapes_takes_each_node_from_its_ranks_shape() -> None:
    """`autopar.plan(stage_meshes=...)`: per stage mesh shape one stage ILP, the merged
    plan's nodes and parameters each its stage's rank's, activations crossing canonical;
    each shape's ILP is the uniform pipeline's on that shape, cut the same way."""
    import autopar
    from autopar.capture import capture
    from autopar.search.stage_meshes import node_stages
    from samples import get_sample

    sample = get_sample("llama")
    model = sample.build("tiny4", device="meta")
    batch = sample.example_batch(model, 8, device="meta")
    pinned = dict(strategy=("dp", "tp"), schedule="1f1b", microbatches=4)

    def planned(mesh, **kw):
        cluster = autopar.Cluster.preset("cpu", mesh=mesh, axis_names=("pp", "dp", "tp"))
        return autopar.plan(model, batch, cluster=cluster, **pinned, **kw)

    merged = planned((2, 2, 1), stage_meshes=((2, 1), (1, 2)))
    pipe = merged.pipeline
    assert pipe.rank_meshes == ((2, 1), (1, 2)) and pipe.boundary == "canonical"
    assert merged.on_rank(1).stage_mesh_shape == (1, 2) and merged.stage_mesh_shape == (2, 1)
    uniform = [planned(m, stage_cuts=pipe.stage_cuts) for m in ((2, 2, 1), (2, 1, 2))]
    small = tuple(t[:2] for t in batch)  # a microbatch: what a pipeline captures
    stage_of = node_stages(capture(model, small), list(pipe.stage_cuts))
    for node in merged.nodes:
        assert node == uniform[stage_of[node.name]].node(node.name), node.name
    for t in merged.tensors:
        assert t == uniform[stage_of[t.name]].tensor(t.name), t.name
    assert len(merged.solver["predicted_memory_per_pp_rank"]) == 2
    with pytest.raises(ValueError, match="give 2 shapes"):
        planned((2, 2, 1), stage_meshes=((2, 1),))


def test_the_layout_search_offers_the_winners_ranks_other_shapes(monkeypatch) -> None:
    """GPT small on two 4-device cpu nodes: the winner is a pipeline of two ranks of 4;
    its embedding-and-head rank (a V: rank 0) on dp x tp 2 x 2 is priced beside it (here
    slower). Priced faster (patched), that variant wins, and the default call's plan runs
    its ranks on those shapes, as pinning them plans it."""
    import autopar
    from autopar.planning import fake_group
    from autopar.search.layouts import _Pricer, search_layout
    from autopar.search.pins import SearchOptions
    from samples import get_sample

    sample = get_sample("gpt")
    model = sample.build("small", device="meta")
    batch = sample.example_batch(model, 16, device="meta")
    cluster = autopar.Cluster.preset("cpu", nodes=2, devices_per_node=4)
    with fake_group(cluster.world_size):
        found = search_layout(model, batch, cluster, SearchOptions())
    won = found.best
    assert (won.pp, won.dp, won.tp, won.schedule) == (2, 4, 1, "zbv"), found.tried
    variant = f"{won.key} ranks 2x2,4x1"
    assert isinstance(found.tried[variant], float), found.tried
    assert found.step_time == min(step for step, _, _ in found.priced) < found.tried[variant]

    price = _Pricer.price

    def favoured(self, layout, schedule, bar=float("inf")):
        step, peak, chosen = price(self, layout, schedule, bar)
        return (step / 2 if layout.rank_meshes else step), peak, chosen

    monkeypatch.setattr(_Pricer, "price", favoured)
    plan = autopar.plan(model, batch, cluster=cluster)
    assert plan.solver["layout"] == variant
    assert plan.pipeline.rank_meshes == ((2, 2), (4, 1)) and plan.mesh_shape == (2, 2, 2)
    monkeypatch.undo()
    pinned = autopar.plan(
        model,
        batch,
        cluster=cluster.reshaped((2, 2, 2), ("pp", "dp", "tp")),
        microbatches=won.microbatches,
        schedule="zbv",
        stage_meshes=((2, 2), (4, 1)),
    )
    assert pinned.nodes == plan.nodes and pinned.pipeline == plan.pipeline


def test_each_stage_ilp_of_a_search_is_priced_once(monkeypatch) -> None:
    """The winner's own stage mesh among its stage-mesh variants, and in its final plan, is
    the ILP its pricing solved (`Captured.solved`, by `solve_intra`'s arguments): no
    problem is built twice in one plan, and the plan is the one solving again gives."""
    import autopar
    from autopar.search import intra_op
    from samples import get_sample

    sample = get_sample("gpt")
    model = sample.build("small", device="meta")
    batch = sample.example_batch(model, 16, device="meta")
    cluster = autopar.Cluster.preset("cpu", nodes=2, devices_per_node=4)
    built, prepare = [], intra_op._prepare

    def counting(*args):
        built.append(intra_op._prepared_key(*args))
        return prepare(*args)

    monkeypatch.setattr(intra_op, "_prepare", counting)
    plan = autopar.plan(model, batch, cluster=cluster)
    assert plan.pipeline is not None  # a pipeline won, and a variant of it was priced
    assert any(" ranks " in key for key in plan.solver["layout_candidates"])
    assert len(built) == len(set(built)), "a problem was built twice"
    monkeypatch.undo()
    unsolved = property(lambda self: {}, lambda self, value: None)  # nothing kept
    monkeypatch.setattr(autopar.capture.export.Captured, "solved", unsolved, raising=False)
    again = autopar.plan(model, batch, cluster=cluster)  # every ILP solved every time
    assert again.nodes == plan.nodes and again.pipeline == plan.pipeline


def test_the_tied_gradients_sum_over_pp_is_priced() -> None:
    """GPT's embedding and head share a weight: after the schedule every pipeline rank
    joins its gradients' all-reduce over pp (`PipelineModel._sync_tied_grads`), of the
    local shard, or of the whole tensor where the ranks' stage meshes differ; then steps.
    An untied model (Llama) pays nothing; nor does a pipeline of one stage."""
    from torch.distributed.tensor import Replicate

    from autopar.cost_models.comm import Collective, collective_time
    from autopar.cost_models.reshard import launch, rearrange_seconds
    from autopar.search.layer_costs import layer_costs
    from autopar.search.shared_params import POST, PRE
    from tests.test_pipeline import _solved_gpt_pipeline, _synthetic

    model, _, captured, (result, _, _) = _solved_gpt_pipeline("dp", "dp")
    whole = model.wte.weight.numel() * 4
    (wte,) = layer_costs(captured, result).shared
    assert (wte.name, wte.readers, wte.home) == ("wte.weight", {PRE, POST}, PRE)
    assert (wte.local, wte.whole, wte.gather) == (whole, whole, 0.0)  # dp: whole, no gather
    model, job, captured, (result, _, _) = _solved_gpt_pipeline("tp", "tp")
    (wte,) = layer_costs(captured, result).shared  # tp: split over 2 devices
    assert (wte.local, wte.whole) == (whole / 2, model.wte.weight.numel() * 4)
    sub = stage_cluster(job.cluster)  # its gradient gathered whole over tp: one all-gather
    gathered = collective_time(Collective.ALL_GATHER, whole, 0, sub)
    (node,) = [n for n in captured.placeholders() if captured.params.get(n.name) == "wte.weight"]
    spec = tuple(result.chosen[node].outputs[0])  # and DTensor's copies around it, if any
    copies = rearrange_seconds(sub, spec, (Replicate(),), tuple(model.wte.weight.shape), 4)
    assert wte.gather == pytest.approx(gathered + launch(Collective.ALL_GATHER, 0, sub) + copies)

    costs, cluster, _ = _synthetic([], layer_forward=1e-3)
    mib = float(2**20)
    tied = replace(
        costs, shared=(_shared({PRE, POST}, PRE, local=mib, whole=4 * mib, gather=2e-3),)
    )
    ar = [collective_time(Collective.ALL_REDUCE, b, 0, cluster) for b in (mib, 4 * mib)]
    base = price_schedule(costs, "1f1b", 2, 4, cluster).step_time
    assert price_schedule(tied, "1f1b", 2, 4, cluster).step_time == pytest.approx(base + ar[0])
    # ranks of two shapes: each gathers its whole gradient on its stage mesh (the slower
    # waited), then the whole tensors' all-reduce
    wider = _shared({PRE, POST}, PRE, local=2 * mib, whole=4 * mib, gather=5e-3)
    other = replace(_slower(tied, 1.0), shared=(wider,))
    mixed = price_schedule((tied, other), "1f1b", 2, 4, cluster)
    assert mixed.step_time == pytest.approx(
        price_schedule((costs, _slower(costs, 1.0)), "1f1b", 2, 4, cluster).step_time + 5e-3 + ar[1]
    )
    one = replace(cluster, mesh_shape=(1, 2))
    assert price_schedule(tied, "gpipe", 1, 4, one, cuts=(0,)).step_time == pytest.approx(
        price_schedule(costs, "gpipe", 1, 4, one, cuts=(0,)).step_time
    )


def _shared(readers, home, *, state=0.0, update=0.0, local=0.0, whole=0.0, gather=0.0):
    from autopar.search.shared_params import SharedParam

    return SharedParam("emb", frozenset(readers), home, state, update, local, whole, gather)


def test_a_shared_parameter_is_held_by_every_stage_that_reads_it() -> None:
    """An encoder-decoder's embedding is read before the first layer, where the decoder
    starts (a middle stage under 4) and by the head: every stage reading it holds a copy
    with its gradient and optimizer states (`passes.stages`), the stage of its first reader
    counting it already; its gradients' sum over pp runs where two stages hold it."""
    from autopar.cost_models.comm import Collective, collective_time
    from autopar.search.layer_costs import layer_costs, stage_parts
    from autopar.search.shared_params import POST, PRE, stage_copies
    from samples import encdec
    from tests.test_pipeline import _solved_gpt_pipeline, _synthetic

    model = encdec.build("tiny", device="meta")
    batch = encdec.example_batch(model, 8, device="meta")
    _, _, captured, (result, _, _) = _solved_gpt_pipeline("dp", "dp", model, batch)
    lc = layer_costs(captured, result)
    (emb,) = lc.shared
    first_decoder = next(name for name in lc.layers if "dec" in name)
    assert emb.readers == {PRE, first_decoder, POST} and emb.home == PRE
    assert emb.state > 0 and emb.update > 0
    # 4 stages of one layer each: the decoder's first (stage 2) and the head's (stage 3)
    # hold a copy beyond their parts' count
    assert stage_copies((lc,) * 4, (0, 1, 2, 3)) == [
        (0, 0), (0, 0), (emb.state, emb.update), (emb.state, emb.update)
    ]  # fmt: skip

    costs, cluster, _ = _synthetic([], layer_forward=1e-3)
    mib = float(2**20)
    middle = _shared({"layers.2"}, "layers.2", state=mib)  # one stage reads it: no sum
    pair = _shared({PRE, "layers.2"}, PRE, state=4 * mib, update=1e-3, local=mib)
    plain = price_schedule(costs, "1f1b", 2, 4, cluster, cuts=(0, 2))
    alone = price_schedule(replace(costs, shared=(middle,)), "1f1b", 2, 4, cluster, cuts=(0, 2))
    assert (alone.peak_memory, alone.step_time) == (plain.peak_memory, plain.step_time)
    held = price_schedule(replace(costs, shared=(pair,)), "1f1b", 2, 4, cluster, cuts=(0, 2))
    stages = stage_parts(costs, (0, 2))
    last = stages[1].state + 4 * mib + stages[1].act * plain.timeline.in_flight[1]
    assert held.peak_memory == pytest.approx(max(plain.peak_memory, last))
    ar = collective_time(Collective.ALL_REDUCE, mib, 0, cluster)
    assert held.step_time == pytest.approx(plain.step_time + ar + 1e-3)


def test_when_no_schedule_fits_the_stage_ilps_are_solved_again_under_less() -> None:
    """`inter_op.fitting_schedules` (uniform pipelines and ranks on several shapes alike):
    stage ILPs that plan their whole budget, each layer holding half of it, fit no
    schedule on 2 ranks of two layers; solved again under the budget scaled by what the
    ranks need (x 0.98), they fit. Never fitting, it gives up after `_RETRIES` re-solves."""
    from autopar.search.inter_op import _RETRIES, PipelineOptions, fitting_schedules
    from tests.test_pipeline import _synthetic

    costs, cluster, _ = _synthetic([], layer_forward=1e-3)
    limit = 2.0**30  # per device: the stage ILPs' budget is both ranks', 2 GiB
    budgets = []

    def solve(budget: float) -> float:  # the ILP's answer: the memory it planned
        budgets.append(budget)
        return budget

    def layers_holding(share: float):
        def costs_of(planned: float):
            layer = replace(costs.parts[0], state=planned * share)
            return replace(costs, parts=(layer,) * 4)

        return costs_of

    pipeline = PipelineOptions(4, "1f1b")
    answer, best, _ = fitting_schedules(
        solve, layers_holding(0.5), float, 2, cluster, pipeline, 2 * limit
    )
    assert budgets[0] == 2 * limit and len(budgets) == 2 and answer == budgets[1]
    needed = price_schedule(layers_holding(0.5)(2 * limit), "1f1b", 2, 4, cluster).peak_memory
    assert needed > limit and budgets[1] == pytest.approx(2 * limit * limit / needed * 0.98)
    assert best.peak_memory <= limit
    budgets.clear()
    with pytest.raises(ValueError, match="no pipeline schedule fits"):
        fitting_schedules(solve, lambda planned: layers_holding(0.5)(2 * limit), float, 2,
                          cluster, pipeline, 2 * limit)  # fmt: skip
    assert len(budgets) == 1 + _RETRIES


def test_ranks_on_two_shapes_are_solved_again_when_no_schedule_fits(monkeypatch) -> None:
    """Under a memory limit the stage ILPs' first answers miss (their budget is both
    ranks' summed), each shape's ILP is solved again under less: the plan recomputes and
    fits, where it used to fail. Each time, the second shape's ILP is prepared while the
    first's solves (`search.ahead`), and its solve takes what was prepared."""
    import autopar
    from autopar.search import ahead, stage_meshes
    from samples import get_sample

    sample = get_sample("llama")
    model = sample.build("tiny4", device="meta")
    batch = sample.example_batch(model, 8, device="meta")
    budgets = []
    solve = stage_meshes.solve_intra
    monkeypatch.setattr(stage_meshes, "solve_intra", lambda *a: budgets.append(a[-1]) or solve(*a))
    # the second shape's problems are prepared while the first's solve, and taken by its solve
    prepared, taken = [], []
    prepare, take = stage_meshes.prepare_intra, ahead.take
    monkeypatch.setattr(stage_meshes, "prepare_intra", lambda *a: prepared.append(a) or prepare(*a))
    monkeypatch.setattr(ahead, "take", lambda key: (found := take(key), taken.append(found))[0])
    cluster = autopar.Cluster.preset("cpu", mesh=(2, 2, 1), axis_names=("pp", "dp", "tp"))
    limit = 7.6e5
    plan = autopar.plan(
        model, batch, cluster=cluster, strategy=("dp", "tp"), schedule="1f1b", microbatches=4,
        stage_meshes=((2, 1), (1, 2)), memory_limit=limit,
    )  # fmt: skip
    assert budgets[:2] == [2 * limit] * 2 and len(budgets) == 4 and budgets[2] < 2 * limit
    assert plan.memory.recompute and plan.predicted_peak_memory <= limit
    assert [(a[1].mesh_shape, a[-1]) for a in prepared] == [((1, 2), b) for b in budgets[1::2]]
    assert sum(found is not None for found in taken) == len(prepared)


def test_a_stage_totals_its_parts_as_their_sum_does() -> None:
    """`PartCost.total` (what `layer_range` sums a stage with) equals `sum(parts,
    PartCost())` to the last bit: the stage cuts break ties on these floats."""
    import random

    rng = random.Random(0)

    def part(k: int) -> PartCost:
        f = [rng.uniform(0, 1) * 10 ** rng.randint(-9, 9) for _ in range(7)]
        grads = ((f"g{k}", "all_reduce", 0, f[0]),)
        return PartCost(*f[:4], grads, *f[4:], program=(k,))

    parts = [part(k) for k in range(97)]
    for first, end in ((0, 97), (3, 50), (10, 11), (5, 5)):
        assert PartCost.total(parts[first:end]) == sum(parts[first:end], PartCost())
