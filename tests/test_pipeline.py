"""Pipeline parallelism trains like one device, on every schedule torch ships.

GPT (tied embedding/head: the head's stage and the embedding's stage each hold the weight and
their gradients are summed) and Llama, 4 layers, 3 AdamW steps, fp32, rtol 1e-4 on loss and
gradients (the issue's tolerance for pipelines: microbatch sums reorder float additions).
Schedules are spread over the meshes so that each one runs with DP and with TP inside its
stages; interleaved and V-shaped schedules hold 2 virtual stages per rank. The zero-bubble
schedules run each stage's backward split into its input- and weight-gradient halves
(`runtime.zero_bubble`), and the simulator prices the halves as they run. On pp x tp, two
cases run with the activations scattered over tp between the stages (`PipelinePlan.boundary`);
on pp x dp, three run with their pipeline ranks on stage meshes of two shapes (dp x tp 2 x 1
and 1 x 2, `PipelinePlan.rank_meshes`: activations cross "canonical"). A Hugging Face Llama
(`tests/models/hf_families.py`, its rotary buffer on the first stage only) runs 1F1B on pp x tp.
The drop-less MoE (`samples/_moe_dropless.py`, a region) runs pipelined on pp x dp: its
aux-loss sum crosses the stage boundary and enters the next stage as the Partial its plan
keeps.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.fx as fx

from autopar.plan import SCHEDULES, stage_ranks
from autopar.runtime.pipeline import _identity_compiler
from autopar.search.schedules import TORCH_CLASSES, replay, simulate
from autopar.search.stage_cuts import balanced_cuts
from autopar.testing.parity import LR, ParityCase, run_parity

HF_FAMILIES = "tests/models/hf_families.py:build"
ALL = ("gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "zbv", "dualpipev")
STEPS = 3
TOL = 1e-4

RUNS = [  # (world, mesh, axis names, stage strategy, {sample: schedules})
    # over the 2-D meshes, every schedule on both samples; on pure pipeline ranks, one
    # plain and one V-shaped schedule (the 2-D meshes already run each schedule twice)
    (2, (2,), ("pp",), "auto", {"gpt": ("1f1b",), "llama": ("dualpipev",)}),
    (4, (2, 2), ("pp", "dp"), "dp", {"gpt": ALL[:3], "llama": ALL[3:]}),
    (4, (2, 2), ("pp", "tp"), "tp", {"gpt": ALL[3:], "llama": ALL[:3]}),
    pytest.param(
        8,
        (2, 2, 2),
        ("pp", "dp", "tp"),
        ("dp", "tp"),
        {"gpt": ("zbv",), "llama": ()},  # 8 ranks on CI's 2 cores: one case
        marks=pytest.mark.own_ranks,  # the only 8-rank test
    ),
]


def _cases(sample, mesh, names, strategy, schedules):
    return [
        ParityCase(
            sample, mesh, names, strategy, config="tiny4", steps=STEPS, schedule=s, microbatches=4
        )
        for s in schedules
    ]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "world,mesh,names,strategy,schedules", RUNS, ids=["pp2", "pp2xdp2", "pp2xtp2", "pp2xdp2xtp2"]
)
def test_pipeline_matches_single_device(world, mesh, names, strategy, schedules):
    """Both samples' schedules on one set of processes per mesh (and on 4 ranks, the
    default call on the cpu preset's own mesh: compile searches the layout on rank 0)."""
    cases = [
        c
        for sample in ("gpt", "llama")
        for c in _cases(sample, mesh, names, strategy, schedules[sample])
    ]
    if names == ("pp",):  # gradient accumulation: a pp axis of 1, one stage or two
        cases += _cases("gpt", (1, 2), ("pp", "dp"), "dp", ("1f1b", "interleaved1f1b"))
    if names == ("pp", "dp"):
        cases.append(ParityCase("gpt", (4,), ("cpu",), config="tiny4", steps=STEPS))
        # FSDP stages under ZBV: the weight-gradient halves reduce-scatter
        cases += _cases("gpt", mesh, names, "fsdp", ("zbv",))
        # a region (the drop-less MoE) in an AOTAutograd stage; the aux-loss sum crosses
        # the stage boundary complete and enters stage 1 as the Partial its plan keeps
        moe = dict(config="tiny-dropless", steps=STEPS, schedule="1f1b", microbatches=2)
        cases.append(ParityCase("moe", mesh, names, "dp", **moe))
    if names == ("pp", "tp"):  # activations scattered over tp between the stages
        cases += [
            dataclasses.replace(c, boundary="scattered")
            for c in _cases("gpt", mesh, names, strategy, ("1f1b",))
            + _cases("llama", mesh, names, strategy, ("zbv",))
        ]
        # Hugging Face's Llama: its rotary buffer lives on the first stage only (the
        # harness reads every rank's whole state, `PipelineModel.full_state_dict`)
        hf = dict(config="llama:4", steps=STEPS, schedule="1f1b", microbatches=4)
        cases.append(ParityCase(HF_FAMILIES, mesh, names, strategy, **hf))
    if names == ("pp", "dp"):  # stage meshes of two shapes: rank 0 dp x tp 2 x 1, rank 1
        # 1 x 2 (a V holds the tied embedding and head on rank 0; 1F1B sums them over pp,
        # here under ZeRO-1: each rank's flat shards on its own mesh)
        stage = dict(config="tiny4", steps=STEPS, microbatches=4, rank_meshes=((2, 1), (1, 2)))
        cases += [
            ParityCase(
                sample, (2, 2, 1), ("pp", "dp", "tp"), ("dp", "tp"), schedule=s, **zero, **stage
            )
            for sample, s, zero in (
                ("gpt", "zbv", {}),
                ("gpt", "1f1b", {"shard_optimizer": True}),
                ("llama", "interleaved1f1b", {}),
            )
        ]
    # 8 rows in 4 microbatches of 2 over dp = 4: a clear error on every rank, no hang
    (too_thin,) = _cases("gpt", (1, 4), ("pp", "dp"), "dp", ("1f1b",))
    if names == ("pp", "dp"):
        cases.append(too_thin)
    failures = []
    for res in run_parity(cases):
        if res.label == too_thin.label:
            if "cannot give each of the 4 ranks" not in (res.error or ""):
                failures.append(f"{res.label}: no clear error: {res.error}")
            continue
        if res.error:
            failures.append(f"{res.label}: {res.error}")
            continue
        line = (
            f"{res.label}: loss {res.loss_rel_err:.1e} grad {res.grad_err:.1e} "
            f"param {res.param_err:.1e} (ddp {res.ddp_param_err:.1e})"
        )
        print(line)
        if res.loss_rel_err > TOL or res.grad_err > TOL or res.param_err > LR * STEPS:
            failures.append("tolerance exceeded: " + line)
        if res.late_syncs:  # each stage's reduction goes out at its last backward
            failures.append(f"{res.label}: {res.late_syncs} gradient syncs after the schedule")
    assert not failures, "\n".join(failures)


def test_gpipe_and_1f1b_bubbles_follow_the_textbook() -> None:
    # p stages, m microbatches, f=1, b=2: (m + p - 1) * (f + b)
    for schedule in ("gpipe", "1f1b"):
        t = simulate(schedule, [1.0] * 4, [2.0] * 4, 8, 4)
        assert t.step_time == pytest.approx((8 + 3) * 3)
    assert simulate("1f1b", [1.0] * 4, [2.0] * 4, 8, 4).in_flight == (4, 3, 2, 1)
    assert simulate("gpipe", [1.0] * 4, [2.0] * 4, 8, 4).in_flight == (8, 8, 8, 8)


def test_interleaving_shrinks_the_bubble() -> None:
    base = simulate("1f1b", [1.0] * 4, [2.0] * 4, 8, 4)
    inter = simulate("interleaved1f1b", [0.5] * 8, [1.0] * 8, 8, 4)
    assert inter.step_time < base.step_time and inter.bubble < base.bubble


def _torch_rows(schedule: str, pp: int, m: int) -> list[str]:
    """Each rank's actions as torch's own schedule object orders them (stand-in stages),
    overlapped forward+backward steps flattened in the order they run."""
    from types import SimpleNamespace

    from torch import nn
    from torch.distributed.pipelining import schedules as pp_schedules

    ranks = stage_ranks(schedule, pp)
    stand_ins = [
        SimpleNamespace(
            num_stages=len(ranks),
            group_size=pp,
            group_rank=0,
            stage_index=s,
            submod=nn.Identity(),
            is_first=s == 0,
            is_last=s == len(ranks) - 1,
        )
        for s, r in enumerate(ranks)
        if r == 0
    ]
    order = getattr(pp_schedules, TORCH_CLASSES[schedule])(stand_ins, m).pipeline_order
    kind = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W", "FULL_BACKWARD": "B"}
    return [
        " ".join(
            f"{kind[a.computation_type.name]}{a.stage_index}.{a.microbatch_index}"
            for step in order[rank]
            if step is not None
            for a in (step.sub_actions or (step,))
        )
        for rank in range(pp)
    ]


@pytest.mark.parametrize("schedule", [s for s in ALL if SCHEDULES[s] == 2])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_simulator_runs_what_the_runtime_runs(schedule, pp, m) -> None:
    # the order: the actions torch's schedule object executes, rank by rank
    n = 2 * pp
    fwd = [1.0 + 0.1 * s for s in range(n)]
    bwd = [2.0 + 0.3 * s for s in range(n)]
    wgrad = [0.4 * b for b in bwd]
    t = simulate(schedule, fwd, bwd, m, pp, p2p=0.05, wgrad=wgrad, stash=[0.5] * n)
    assert list(t.rows) == _torch_rows(schedule, pp, m)
    # the durations: I and W split a stage's backward (I + W = B), so each rank is busy
    # m * (f + b) per stage it holds (and DualPipeV's overlapped forward+backward runs one
    # after the other)
    ranks = stage_ranks(schedule, pp)
    busy = [m * sum(fwd[s] + bwd[s] for s in range(n) if ranks[s] == r) for r in range(pp)]
    assert (1 - t.bubble) * t.step_time == pytest.approx(max(busy))
    assert t.step_time > max(busy)  # the ranks wait on each other at some point
    # the weight gradients fill bubbles: never slower than running them at I
    assert t.step_time <= simulate(schedule, fwd, bwd, m, pp, p2p=0.05).step_time + 1e-9


def test_zero_bubble_actions_run_their_halves() -> None:
    # stage 1 on rank 1: I = b - w, W = w; stage 0 (its input, the batch, takes no
    # gradient): I empty, W its whole backward
    orders = [
        [("F", 0, 0), ("I", 0, 0), ("W", 0, 0)],
        [("F", 1, 0), ("I", 1, 0), ("W", 1, 0)],
    ]
    split = replay(orders, [1.0, 1.0], [2.0, 2.0], [0, 1], wgrad=[0.5, 0.5])
    assert split.step_time == pytest.approx(1 + 1 + 1.5 + 2)  # stage 0 waits on I1 only
    whole = replay(orders, [1.0, 1.0], [2.0, 2.0], [0, 1])
    assert whole.step_time == pytest.approx(1 + 1 + 2 + 2)
    # between I and W a microbatch keeps its `stash` share of activations
    orders = [
        [("F", 0, 0), ("F", 0, 1), ("I", 0, 0), ("W", 0, 0), ("I", 0, 1), ("W", 0, 1)],
        [("F", 1, 0), ("I", 1, 0), ("F", 1, 1), ("W", 1, 0), ("I", 1, 1), ("W", 1, 1)],
    ]
    held = replay(orders, [1.0, 1.0], [2.0, 2.0], [0, 1], wgrad=[0.5, 0.5], stash=[0.5, 0.25])
    assert held.in_flight == (2, pytest.approx(1 + 0.25))  # stage 0 keeps all until W


def test_stage_backward_splits_into_input_and_weight_halves() -> None:
    """`runtime.zero_bubble`: AOTAutograd's backward runs the input-gradient half and
    queues the weight-gradient half (the weight's matmul); together they make autograd's
    gradients exactly."""
    import torch

    from autopar._compat import aot_function
    from autopar.runtime.zero_bubble import WeightGradients

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3, 4))
    g = torch.nn.Parameter(torch.randn(3))
    buf, x = torch.randn(3), torch.randn(5, 4, requires_grad=True)

    def program(w, g, buf, x):
        return (torch.nn.functional.layer_norm(x @ w.t(), (3,), g) + buf,)

    halves = []  # what the inner compiler gets: the I half, then the W half

    def keep(gm, _example):
        halves.append(gm)
        return gm

    queue = WeightGradients(lambda: [w, g])
    fn = aot_function(program, fw_compiler=lambda gm, _: gm, bw_compiler=queue.compiler(keep, 2, 3))
    (fn(w, g, buf, x)[0] * torch.arange(3.0)).sum().backward()
    assert x.grad is not None and w.grad is None and g.grad is None  # I ran, W waits
    mms = [sum(n.target is torch.ops.aten.mm.default for n in h.graph.nodes) for h in halves]
    assert mms == [1, 1]  # dx = dy w at I, dw = dy^T x at W
    queue.builder()()
    expect = torch.autograd.grad((program(w, g, buf, x)[0] * torch.arange(3.0)).sum(), [w, g, x])
    for got, ref in zip((w.grad, g.grad, x.grad), expect, strict=True):
        assert torch.equal(got, ref)


def test_balanced_cuts_minimize_the_slowest_stage() -> None:
    assert balanced_cuts([1, 1, 1, 1], 2) == (0, 2)
    assert balanced_cuts([5, 1, 1, 1, 1, 1], 2) == (0, 1)
    assert balanced_cuts([1, 1, 1, 1, 4], 3) == (0, 2, 4)
    with pytest.raises(ValueError, match="need at least 5 layers"):
        balanced_cuts([1, 1, 1, 1], 5)


def test_pipeline_degree_search_keeps_the_fastest_candidate() -> None:
    import autopar
    from autopar.cluster import Cluster
    from samples import get_sample

    sample = get_sample("gpt")
    model = sample.build("tiny4", device="meta")
    batch = sample.example_batch(model, 8, device="meta")
    plan = autopar.plan(
        model, batch, cluster=Cluster.preset("cpu", mesh=(4,)), pipeline_stages="auto"
    )
    tried = plan.solver["layout_candidates"]
    times = [t for t in tried.values() if isinstance(t, float)]
    assert "pp1 dp4 tp1 m1" in tried and len(times) >= 2
    assert plan.predicted_step_time == min(times)
    # compile searches the layout too (on rank 0 of the job): only the missing job stops it
    with pytest.raises(RuntimeError, match="needs a process group"):
        autopar.compile(
            model, batch, cluster=Cluster.preset("cpu", mesh=(4,)), pipeline_stages="auto"
        )


def test_weight_gradients_are_the_weight_matmuls() -> None:
    """What the simulator puts at W: the weight-gradient matmul of a matmul reading a
    weight (it reads the activation operand); a matmul of two activations has none."""
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.capture.operands import tensor_operands
    from autopar.search.schedules import weight_gradient_reads

    def f(w, x):
        h = x @ w.t()
        return torch.bmm(h.unsqueeze(0), h.unsqueeze(0).transpose(1, 2))

    gm = make_fx(f)(torch.randn(3, 4), torch.randn(5, 4))
    nodes = {n.target: n for n in gm.graph.nodes if n.op == "call_function"}
    w = next(n for n in gm.graph.nodes if n.op == "placeholder")
    weights = {w, nodes[torch.ops.aten.t.default]}
    reads = {
        target: [
            op.producer.name
            for _, op in weight_gradient_reads(n, tensor_operands(n), weights.__contains__)
        ]
        for target, n in nodes.items()
    }
    assert reads[torch.ops.aten.mm.default] == ["x_1"]
    assert reads[torch.ops.aten.bmm.default] == []
    assert reads[torch.ops.aten.t.default] == []


def test_stages_are_priced_with_the_communication_pass() -> None:
    """Pipelined plans run the communication pass in their stage programs, priced so: an
    fsdp stage's per-layer fused, prefetched gathers cost less than its collectives waited
    at once, one per tensor (the ILP's price, what a stage without the pass runs); its
    activation sends are priced at the rank's shard, as `runtime.pipeline` sends them."""
    from dataclasses import replace

    from autopar.plan import DEFAULT_COMM, SCHEDULES
    from autopar.search.inter_op import Dominated, price_schedule, price_schedules
    from autopar.search.layer_costs import layer_costs, reduced_per_step

    model, job, captured, (result, best, _) = _solved_gpt_pipeline("dp", "fsdp")
    assert result.comm == DEFAULT_COMM and result.info["comm_pass"]
    costs = layer_costs(captured, result)
    waited = price_schedule(replace(costs, comm=None), "1f1b", 2, 4, job.cluster)
    assert best.step_time == price_schedule(costs, "1f1b", 2, 4, job.cluster).step_time
    assert best.step_time < waited.step_time
    # a stage sends its rank's shard of the residual stream and of the targets the loss
    # reads (int64): a microbatch's 2 rows over dp
    cfg = model.config
    residual, targets = cfg.block_size * cfg.n_embd * 4, cfg.block_size * 8
    assert all(c.placed_bytes == 2 // 2 * (residual + targets) for c in costs.crossings[1:])
    # the fsdp layers' gradient reduce-scatters run in every microbatch's backward
    scatters = [g for g in costs.parts[0].grads if not reduced_per_step(g)]
    assert scatters and all(g in costs.parts[0].program[0].grads for g in scatters)
    # the layout search's prune: the stages' work bounds every schedule's step from below
    every = replace(job.pipeline, schedule=None)
    priced, _, _ = price_schedules(costs, list(SCHEDULES), 2, job.cluster, every, math.inf)
    fastest = min(p.step_time for p in priced)
    assert len(priced) >= 4
    price_schedules(costs, list(SCHEDULES), 2, job.cluster, replace(every, bar=fastest), math.inf)
    with pytest.raises(Dominated):
        price_schedules(costs, ["1f1b"], 2, job.cluster, replace(every, bar=fastest / 2), math.inf)


def test_step_text_says_what_a_pipelined_step_is_made_of() -> None:
    import autopar
    from autopar.cluster import Cluster
    from autopar.views.tables import step_text
    from samples import get_sample

    sample = get_sample("gpt")
    model = sample.build("tiny4", device="meta")
    batch = sample.example_batch(model, 8, device="meta")
    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("pp", "dp"))
    plan = autopar.plan(model, batch, cluster=cluster, schedule="1f1b", microbatches=4)
    stages = plan.solver["stage_times"]
    assert len(stages) == 2 and all(t > 0 for t in stages)
    text = step_text(plan)
    assert "1f1b schedule over 4 microbatches" in text
    assert f"[{stages[0] * 1e3:.3f}, {stages[1] * 1e3:.3f}] ms, collectives overlapped" in text
    sync = plan.solver["gradient_sync"]
    assert f"gradient sync beyond the timeline {sync * 1e3:.3f} ms" in text


def every_cut(costs, crossing):
    """`costs` whose every stage cut carries `crossing`."""
    from dataclasses import replace

    from autopar.search.crossing import Crossing

    return replace(costs, crossings=(Crossing(), *(crossing,) * (len(costs.layers) - 1)))


def _synthetic(grads=(), layer_forward: float | None = None, pre: float = 0.0):
    """Four identical layers (forward f, backward 2f, one weight gather of 1 MiB taking g
    seconds, and `grads`) after a compute-only embedding of `pre` x g seconds, on pp=2 x
    dp=2; f = `layer_forward`, or g (a gather hides under one layer's forward)."""
    from dataclasses import replace

    from autopar.cluster import Cluster
    from autopar.cost_models.buckets import collective_times
    from autopar.plan import DEFAULT_COMM
    from autopar.search.crossing import Crossing
    from autopar.search.inter_op import stage_cluster
    from autopar.search.layer_costs import LayerCosts, PartCost
    from autopar.search.step import Part

    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("pp", "dp"))
    # every collective kind at the link's rate (the preset prices gloo's slower ones), and
    # all the schedule hides hidden (the preset's gloo hides little under compute)
    links = tuple(replace(link, kind_efficiency=()) for link in cluster.links)
    device = replace(cluster.device, overlap_efficiency=1.0)
    cluster = replace(cluster, links=links, fabric=None, device=device)
    gather = [(("ag",), "all_gather", 0, 2.0**20)]
    g = collective_times(gather, stage_cluster(cluster))
    f = g if layer_forward is None else layer_forward
    pre_compute = pre * g
    program = Part(forward=f, backward=2 * f, gather=g, gathers=gather, grads=list(grads))
    layer = PartCost(time=3 * f + g, grads=tuple(grads), program=(program,))
    pre = PartCost(
        time=pre_compute, program=(Part(forward=pre_compute / 3, backward=2 * pre_compute / 3),)
    )
    names = tuple(f"layers.{i}" for i in range(4))
    costs = LayerCosts(names, (layer,) * 4, pre, PartCost(), (Crossing(),) * 4, DEFAULT_COMM)
    return costs, cluster, g


def test_fsdp_gradients_are_reduced_in_every_microbatch() -> None:
    """A sharded parameter's gradient reduce-scatter runs in each microbatch's backward
    program (`runtime.pipeline._DeferGradSync` leaves only the replicated ones' partial):
    priced in the stage's microbatch, bucketed behind its backward; a replicated one's
    all-reduce runs once per step from the stage's last backward (`GradientSync`)."""
    from dataclasses import replace

    from autopar.cost_models.buckets import fused_copies, fused_time
    from autopar.search.inter_op import price_schedule, stage_cluster
    from autopar.search.layer_costs import reduced_per_step, stage_time

    scatter = [(("rs",), "reduce_scatter", 0, 2**22)]
    reduce = [(("ar",), "all_reduce", 0, 2**22)]
    assert not reduced_per_step(scatter[0]) and reduced_per_step(reduce[0])
    bare, cluster, _ = _synthetic(layer_forward=1e-3)
    sub = stage_cluster(cluster)
    comm = bare.comm
    layer = bare.parts[0]
    for grads, per_step in ((scatter, False), (reduce, True)):
        costs, _, _ = _synthetic(grads, layer_forward=1e-3)
        part = costs.parts[0]
        t, t0 = stage_time(part, sub, comm), stage_time(layer, sub, comm)
        # the last layer's bucket is exposed: its whole reduce-scatter, every microbatch
        assert t == (t0 if per_step else pytest.approx(t0 + fused_time(grads, sub)))
        waited = stage_time(part, sub, None)  # no pass: one per tensor, waited at once
        assert waited == pytest.approx(part.time + (0 if per_step else fused_time(grads, sub)))
        one, four = (price_schedule(costs, "gpipe", 2, m, cluster) for m in (1, 4))
        # a stage's two layers: one flat buffer, copied in (the sums stay its slices); the
        # first rank's last backward ends the timeline, so its reduction is all exposed
        flat = fused_time(grads * 2, sub) + fused_copies(grads * 2, sub)
        assert one.sync == pytest.approx(flat if per_step else 0.0)
        # reduced in another dtype than the gradients: the sums are cast back into them
        cast = price_schedule(replace(costs, cast_back=True), "gpipe", 2, 1, cluster)
        back = fused_copies(grads * 2, sub, back=True) - fused_copies(grads * 2, sub)
        assert back > 0 and cast.sync == pytest.approx(one.sync + (back if per_step else 0.0))
        assert four.sync == pytest.approx(one.sync)  # once per step, whatever the microbatches


def test_a_stage_reduces_its_gradients_from_its_last_backward() -> None:
    """Each stage's gradient all-reduce goes out when its last backward is done, on its
    rank's one communication channel (`runtime.pipeline.GradientSync`): a rank of two
    stages hides the first-finished one's under the other's remaining backward; the
    reductions never add more than their sum after the rank's last action."""
    from dataclasses import replace

    from autopar.cost_models.buckets import fused_time
    from autopar.search.inter_op import price_schedule, stage_cluster
    from autopar.search.schedules import synced_end

    assert synced_end(10.0, [4.0, 9.0], [2.0, 3.0]) == 12.0  # 4..6 hidden, 9..12
    assert synced_end(10.0, [4.0, 9.0], [6.0, 3.0]) == 13.0  # 4..10, then 10..13
    assert synced_end(10.0, [9.0, 4.0], [0.0, 1.0]) == 10.0  # all hidden
    reduce = [(("ar",), "all_reduce", 0, 2**22)]
    costs, cluster, _ = _synthetic(reduce, layer_forward=1e-3)
    one_stage = fused_time(reduce, stage_cluster(cluster))  # a stage of one layer
    for schedule in ("interleaved1f1b", "zbv"):
        p = price_schedule(costs, schedule, 2, 4, cluster)
        tl = p.timeline
        assert p.step_time == pytest.approx(tl.step_time + p.sync)
        for rank, end in enumerate(tl.ends):
            stages = [s for s, r in enumerate(stage_ranks(schedule, 2)) if r == rank]
            done = [tl.grads_done[s] for s in stages]
            assert max(done) <= end <= p.step_time - (one_stage if max(done) == end else 0)
            assert p.step_time <= tl.step_time + len(stages) * one_stage + 1e-12
    # interleaved: the first rank's stage 2 is done well before its stage 0, which ends
    # the timeline: only stage 0's reduction is exposed
    p = price_schedule(costs, "interleaved1f1b", 2, 4, cluster)
    assert p.sync == pytest.approx(one_stage)
    # ZeRO (`runtime.stage_grads`): a reduce-scatter per stage, the same way, and each
    # stage's parameters all-gathered (here half the gradient's bytes) from the step's
    # start, in stage order, before its first forward: the first stage's delays the
    # timeline, the rank's later stage's hides under the first's forwards
    zero = price_schedule(replace(costs, zero=0.5), "interleaved1f1b", 2, 4, cluster)
    sub = stage_cluster(cluster)
    scatter = fused_time([(k, "reduce_scatter", a, b) for k, _, a, b in reduce], sub)
    gather = fused_time([(k, "all_gather", a, b / 2) for k, _, a, b in reduce], sub)
    assert zero.sync == pytest.approx(scatter)
    assert zero.timeline.step_time == pytest.approx(p.timeline.step_time + gather)


def test_stage_cuts_balance_the_overlapped_stage_times() -> None:
    """The cuts minimize the slowest stage as the schedule prices it (`stage_time`: gathers
    prefetched under the previous layer, the stage's first one exposed), not the layers'
    collectives waited at once: here those would put two layers on the first stage."""
    from itertools import combinations

    from autopar.search.inter_op import price_schedule, stage_cluster
    from autopar.search.layer_costs import stage_parts, stage_time

    costs, cluster, _ = _synthetic(pre=3.5)
    sub = stage_cluster(cluster)
    weights = [p.time for p in costs.parts]
    weights[0] += costs.pre.time
    assert balanced_cuts(weights, 2) == (0, 2)  # by the collectives waited at once

    def slowest(cuts):
        return max(stage_time(p, sub, costs.comm) for p in stage_parts(costs, cuts))

    priced = price_schedule(costs, "gpipe", 2, 4, cluster)
    assert priced.cuts == (0, 1)
    every = [(0, c) for (c,) in combinations(range(1, 4), 1)]
    assert slowest(priced.cuts) == min(slowest(c) for c in every)
    assert slowest((0, 1)) < slowest((0, 2))
    assert list(priced.stage_times) == [
        stage_time(p, sub, costs.comm) for p in stage_parts(costs, (0, 1))
    ]


def test_gathers_prefetch_in_issue_order() -> None:
    """The pass issues each collective after the one traced before it: a layer's gather
    is prefetched only under the previous layer's forward after its last activation
    collective (`Part.tail`), not under all of it. A stage of four layers whose gather
    hides under one layer's forward: in full once, then not at all; with each layer ending
    on an activation collective (tail 0): in full every layer. A dp x tp plan's layers end
    so (the row-parallel output's all-reduce), with little forward after it."""
    from dataclasses import replace

    from torch.distributed.device_mesh import init_device_mesh

    from autopar.capture import capture
    from autopar.cluster import Cluster
    from autopar.plan import DEFAULT_COMM
    from autopar.planning import fake_group
    from autopar.search.inter_op import stage_cluster
    from autopar.search.intra_op import solve_intra
    from autopar.search.layer_costs import PartCost, stage_time
    from autopar.search.pins import SearchOptions
    from autopar.search.step import program_parts
    from samples import get_sample

    costs, cluster, g = _synthetic()
    sub = stage_cluster(cluster)
    stage = sum(costs.parts, PartCost())
    compute = sum(p.forward + p.backward for q in costs.parts for p in q.program)
    assert stage_time(stage, sub, costs.comm) == pytest.approx(compute + g)
    ending = replace(stage, program=tuple(replace(p, tail=0.0) for p in stage.program))
    assert stage_time(ending, sub, costs.comm) == pytest.approx(compute + 4 * g)

    sample = get_sample("gpt")
    model = sample.build("tiny", device="meta")
    batch = sample.example_batch(model, 8, device="meta")
    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("dp", "tp"))
    with fake_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        captured = capture(model, batch)
        options = SearchOptions(strategy=("fsdp", "tp"))
        result = solve_intra(captured, cluster, mesh, options, comm=DEFAULT_COMM)
    layers = program_parts(captured, result)[1:-1]
    assert layers and all(p.gathers and 0 < p.tail < p.forward for p in layers)


def test_scattered_boundary_splits_each_replicated_axis_on_a_dim_of_its_own() -> None:
    from torch.distributed.tensor import Replicate, Shard

    from autopar.plan import PipelinePlan, scattered_spec

    r = Replicate()
    # dp shards the rows; tp takes the first dim it divides that no axis splits
    assert scattered_spec((Shard(0), r), (2, 16, 32), (2, 4)) == (Shard(0), Shard(1))
    assert scattered_spec((r, r), (4, 6), (2, 3)) == (Shard(0), Shard(1))
    assert scattered_spec((r, Shard(0)), (4, 6), (2, 2)) == (Shard(1), Shard(0))
    # no dim the axis divides (or a size-1 axis): it stays replicated
    assert scattered_spec((r,), (3, 5), (4,)) == (r,)
    assert scattered_spec((r, r), (8,), (1, 2)) == (r, Shard(0))
    with pytest.raises(ValueError, match="pipeline boundary 'flat'"):
        PipelinePlan(2, (0, 1), ("a", "b"), "1f1b", 2, (2,), ("tp",), (0, 1), boundary="flat")


def test_a_canonical_crossing_is_one_split_on_any_stage_mesh() -> None:
    """Stage k's device holds chunk k of the value whatever its mesh's shape: every axis
    splits the first dim the stage's devices divide (nested), or none does."""
    from torch.distributed.tensor import Replicate, Shard

    from autopar.plan import PipelinePlan, canonical_spec

    r, s0, s1 = Replicate(), Shard(0), Shard(1)
    assert canonical_spec((8, 16, 32), 4, 2) == (s0, s0)
    assert canonical_spec((2, 16, 32), 4, 2) == (s1, s1)  # 2 rows cannot give 4 devices one
    assert canonical_spec((3, 5), 4, 2) == (r, r)
    assert canonical_spec((8,), 1, 2) == (r, r)
    meshes = ((2, 1), (1, 2))
    stages = dict(pp=2, stage_cuts=(0, 1), layers=("a", "b"), schedule="1f1b", microbatches=2)
    axes = dict(stage_mesh=(2, 1), stage_axis_names=("dp", "tp"), rank_of_stage=(0, 1))
    plan = PipelinePlan(**stages, **axes, boundary="canonical", rank_meshes=meshes)
    assert plan.mesh_of(1) == (1, 2) and PipelinePlan.from_dict(dataclasses.asdict(plan)) == plan
    with pytest.raises(ValueError, match="cross 'canonical'"):
        PipelinePlan(**stages, **axes, rank_meshes=meshes)
    with pytest.raises(ValueError, match="every rank 2 devices"):
        PipelinePlan(**stages, **axes, boundary="canonical", rank_meshes=((2, 1), (2, 2)))


def test_a_scattered_boundary_is_run_where_it_is_faster() -> None:
    """`price_schedule` simulates both boundaries where scattering sends less and keeps the
    faster; its stage times carry the redistributions the scattered one adds."""
    from dataclasses import replace

    from autopar.cost_models.comm import send_recv_time
    from autopar.search.crossing import Crossing
    from autopar.search.inter_op import price_schedule

    costs, cluster, g = _synthetic([], layer_forward=1e-3)
    link = cluster.links[0]
    big = 64 * link.bandwidth * 1e-3  # 64 ms of messages placed, 4 ms scattered
    assert send_recv_time(big, link) > 50e-3
    placed = price_schedule(every_cut(costs, Crossing(big, big)), "1f1b", 2, 4, cluster)
    assert placed.boundary == "placed"
    cheap = Crossing(big, big / 16, receive=(1e-4, 1e-4), send=(0.0, 1e-4))
    fast = price_schedule(every_cut(costs, cheap), "1f1b", 2, 4, cluster)
    assert fast.boundary == "scattered" and fast.step_time < placed.step_time
    assert fast.stage_times[0] == pytest.approx(placed.stage_times[0] + 1e-4)  # sends
    assert fast.stage_times[1] == pytest.approx(placed.stage_times[1] + 2e-4)  # receives
    # redistributions dearer than the messages they shorten: placed
    dear = Crossing(big, big / 16, receive=(1.0, 1.0))
    slow = price_schedule(every_cut(costs, dear), "1f1b", 2, 4, cluster)
    assert slow.boundary == "placed" and slow.step_time == placed.step_time
    # no rank-to-rank boundary (two stages on a pipeline of one rank): placed, unsimulated
    one = replace(cluster, mesh_shape=(1, 2))
    assert price_schedule(every_cut(costs, cheap), "1f1b", 1, 4, one).boundary == "placed"


def test_the_embedding_is_priced_on_the_first_stage() -> None:
    """The stage split runs the embedding on the first stage; its price is there too (the
    part before the first layer, `layer_parts`), not after the last layer (where it was
    priced while the blocks' parameters, listed before it, marked a layer seen)."""
    import torch

    from autopar.search.layer_costs import layer_costs

    _, _, captured, (result, _, _) = _solved_gpt_pipeline("dp", "dp")
    costs = layer_costs(captured, result)
    lookups = [n for n in captured.gm.graph.nodes if n.target == torch.ops.aten.embedding.default]
    seconds = sum(result.node_times(n)[0] for n in lookups)
    assert lookups and seconds > 0
    assert costs.pre.time >= seconds


def test_nodes_between_two_stacks_run_with_the_next_stack() -> None:
    """Between an encoder's last block and a decoder's first (Hugging Face BART), the
    nodes outside the blocks (the encoder's final norm, the decoder's embedding) run with
    the decoder's first block; a parameter outside the blocks is held where its first
    reader runs (the encoder's embedding norm, registered after its blocks, on the first
    stage); before the first block and after the last as ever."""
    from autopar.capture import capture
    from autopar.capture.analysis import assign_stages, batch_dependent, layer_parts
    from autopar.capture.export import layer_of
    from autopar.cli.sources import load_model

    model, batch = load_model(HF_FAMILIES, "bart:2", 4)
    captured = capture(model, batch)
    parts, stages = layer_parts(captured), assign_stages(captured, [0, 2])
    nodes = [n for n in captured.gm.graph.nodes if n.op == "call_function"]
    first_decoder = next(i for i, n in enumerate(nodes) if "decoder.layers.0" in str(layer_of(n)))
    last_encoder = max(i for i, n in enumerate(nodes) if "encoder.layers.1" in str(layer_of(n)))
    between = nodes[last_encoder + 1 : first_decoder]
    assert between and all(parts[n] == 3 for n in between)  # decoder block 0: part 3
    batch_nodes = batch_dependent(captured)
    assert all(stages[n] == 1 for n in between if n in batch_nodes)
    assert parts[nodes[0]] == 0 and parts[nodes[-1]] == 5  # embedding; loss
    norm = next(n for n in captured.placeholders() if "encoder_layernorm_embedding_w" in n.name)
    assert parts[norm] == 0


def test_each_cut_is_priced_with_what_it_carries() -> None:
    """The schedule's messages between ranks are each cut's own: a cut where 64 ms of
    messages cross is dearer than one where nothing does (the same stages otherwise)."""
    from dataclasses import replace

    from autopar.search.crossing import Crossing
    from autopar.search.inter_op import price_schedule

    costs, cluster, _ = _synthetic([], layer_forward=1e-3)
    big = 64 * cluster.links[0].bandwidth * 1e-3
    none, heavy = Crossing(), Crossing(big, big)
    at_cut = replace(costs, crossings=(none, none, heavy, none))
    elsewhere = replace(costs, crossings=(none, heavy, none, none))
    light = price_schedule(elsewhere, "1f1b", 2, 4, cluster, cuts=(0, 2))
    dear = price_schedule(at_cut, "1f1b", 2, 4, cluster, cuts=(0, 2))
    assert light.step_time == price_schedule(costs, "1f1b", 2, 4, cluster, cuts=(0, 2)).step_time
    assert dear.step_time > light.step_time + 2 * 50e-3  # forward and backward, at least


def test_the_residual_stream_crossing_is_priced_both_ways() -> None:
    """Stages holding TP with the residual stream replicated over tp: scattered, each rank
    sends half of it, and the receiving stage's layer gathers it back (an all-gather more
    in its forward) where placed it sent the whole."""
    from autopar.search.layer_costs import layer_costs

    model, _, captured, (result, _, _) = _solved_gpt_pipeline("tp", "tp")
    crossing = layer_costs(captured, result).crossings[1]
    cfg = model.config
    residual, targets = cfg.block_size * cfg.n_embd * 4, cfg.block_size * 8
    assert crossing.placed_bytes == 2 * (residual + targets)  # 2 rows, whole
    assert crossing.scattered_bytes == crossing.placed_bytes / 2 and crossing.can_scatter
    assert crossing.receive[0] > 0  # the gather back, in the receiving stage's forward


def test_a_cut_is_priced_carrying_what_the_stage_split_sends() -> None:
    """Each stage cut of an encoder-decoder (Hugging Face BART) is priced with what
    `passes.stages` sends across it: inside the decoder the encoder's output too (every
    decoder block's cross-attention reads it), twice a decoder's residual stream; the
    targets (and BART's encoder padding mask) cross every cut. Data parallel stages: each
    rank sends its half of every value."""
    from autopar.cli.sources import load_model
    from autopar.passes.stages import split_stages
    from autopar.search.layer_costs import layer_costs

    model, batch = load_model(HF_FAMILIES, "bart:2", 8)
    _, _, captured, (result, _, _) = _solved_gpt_pipeline("dp", "dp", model, batch)
    costs = layer_costs(captured, result)
    values = {n.name: n.meta.get("val") for n in captured.gm.graph.nodes}
    for cut in range(1, len(costs.layers)):
        sent = split_stages(captured, [0, cut])[1].inputs  # (captured at a microbatch)
        whole = sum(values[v].numel() * values[v].element_size() for v in sent)
        assert costs.crossings[cut].placed_bytes == whole / 2, costs.layers[cut]
    encoder = costs.crossings[1].placed_bytes  # its stream, the targets and padding mask
    assert costs.crossings[3].placed_bytes > 1.8 * encoder  # two streams and the targets
    # between the stacks the encoder's final norm and the decoder's embedding run on the
    # decoder's first stage, priced there: that cut carries the decoder's token ids, not
    # its embeddings
    assert costs.crossings[2].placed_bytes < costs.crossings[3].placed_bytes


def _solved_gpt_pipeline(axis: str, strategy: str, model=None, batch=None):
    """(model, job, captured, `solve_pipeline`'s answer) of the tiny GPT (or `model` on
    `batch`) under 1F1B with 4 microbatches on pp 2 x `axis` 2 of the cpu preset,
    `strategy` in the stages (a fake process group of 4)."""
    import torch.distributed as dist

    from autopar._compat import FakeStore
    from autopar.cluster import Cluster
    from autopar.options import PlanOptions
    from autopar.planning import prepare
    from autopar.search.inter_op import solve_pipeline
    from autopar.search.pins import SearchOptions
    from samples import get_sample

    if model is None:
        sample = get_sample("gpt")
        model = sample.build("tiny4", device="meta")
        batch = sample.example_batch(model, 8, device="meta")
    cluster = Cluster.preset("cpu", mesh=(2, 2), axis_names=("pp", axis))
    options = PlanOptions(strategy=strategy, schedule="1f1b", microbatches=4)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        job, captured, _, _ = prepare(model, batch, cluster, None, options)
        search = SearchOptions.from_options(job.options)
        mesh = job.cluster.device_mesh()[(axis,)]
        solved = solve_pipeline(captured, job.cluster, mesh, search, job.pipeline)
    finally:
        dist.destroy_process_group()
    return model, job, captured, solved


def test_schedules_that_fail_alike_are_named_together() -> None:
    """A model with one layer (ALBERT: one layer applied at every depth) fails every
    schedule on 2 stages for one of two reasons: each is said once, with its schedules."""
    from autopar.search.inter_op import _grouped

    with pytest.raises(ValueError) as two:
        balanced_cuts([1.0], 2)
    with pytest.raises(ValueError) as four:
        balanced_cuts([1.0], 4)
    failures = [(s, str(two.value)) for s in ("gpipe", "1f1b")]
    failures += [(s, str(four.value)) for s in ("interleaved1f1b", "zbv")]
    assert _grouped(failures) == f"gpipe, 1f1b: {two.value}; interleaved1f1b, zbv: {four.value}"


def test_stage_programs_take_aot_autograds_boxed_arguments() -> None:
    """A stage's graphs are handed back to AOTAutograd boxed (a plain callable made it warn
    "Your compiler for AOTAutograd is returning a function that doesn't take boxed
    arguments" on every rank of every pipeline run), and called with the argument list."""
    gm = fx.symbolic_trace(lambda x, y: x + y)
    compiled = _identity_compiler(gm, [])
    assert getattr(compiled, "_boxed_call", False)
    assert compiled([torch.ones(2), torch.ones(2)]).tolist() == [2.0, 2.0]
