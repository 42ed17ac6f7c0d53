"""Pipeline parallelism trains like one device, on every schedule torch ships.

GPT (tied embedding/head: the head's stage and the embedding's stage each hold the weight and
their gradients are summed) and Llama, 4 layers, 3 AdamW steps, fp32, rtol 1e-4 on loss and
gradients (the issue's tolerance for pipelines: microbatch sums reorder float additions).
Schedules are spread over the meshes so that each one runs with DP and with TP inside its
stages; interleaved and V-shaped schedules hold 2 virtual stages per rank. The zero-bubble
schedules run each stage's backward split into its input- and weight-gradient halves
(`runtime.zero_bubble`), and the simulator prices the halves as they run.
"""

from __future__ import annotations

import pytest

from autopar.plan import SCHEDULES, stage_ranks
from autopar.search.inter_op import balanced_cuts
from autopar.search.schedules import TORCH_CLASSES, replay, simulate
from autopar.testing.parity import LR, ParityCase, run_parity

ALL = ("gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "zbv", "dualpipev")
STEPS = 3
TOL = 1e-4

RUNS = [  # (world, mesh, axis names, stage strategy, {sample: schedules})
    (2, (2,), ("pp",), "auto", {"gpt": ALL, "llama": ALL}),
    (4, (2, 2), ("pp", "dp"), "dp", {"gpt": ALL[:3], "llama": ALL[3:]}),
    (4, (2, 2), ("pp", "tp"), "tp", {"gpt": ALL[3:], "llama": ALL[:3]}),
    (
        8,
        (2, 2, 2),
        ("pp", "dp", "tp"),
        ("dp", "tp"),
        {"gpt": ("zbv",), "llama": ("interleaved1f1b",)},
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
    if names == ("pp", "dp"):
        cases.append(ParityCase("gpt", (4,), ("cpu",), config="tiny4", steps=STEPS))
        # FSDP stages under ZBV: the weight-gradient halves reduce-scatter
        cases += _cases("gpt", mesh, names, "fsdp", ("zbv",))
    failures = []
    for res in run_parity(cases, world):
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
