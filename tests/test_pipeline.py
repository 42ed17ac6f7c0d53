"""Pipeline parallelism trains like one device, on every schedule torch ships.

GPT (tied embedding/head: the head's stage and the embedding's stage each hold the weight and
their gradients are summed) and Llama, 4 layers, 3 AdamW steps, fp32, rtol 1e-4 on loss and
gradients (the issue's tolerance for pipelines: microbatch sums reorder float additions).
Schedules are spread over the meshes so that each one runs with DP and with TP inside its
stages; interleaved and V-shaped schedules hold 2 virtual stages per rank.
"""

from __future__ import annotations

import pytest

from autopar.plan import SCHEDULES, stage_ranks
from autopar.search.inter_op import balanced_cuts
from autopar.search.schedules import TORCH_CLASSES, simulate
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
    """Both samples' schedules on one set of processes per mesh."""
    cases = [
        c
        for sample in ("gpt", "llama")
        for c in _cases(sample, mesh, names, strategy, schedules[sample])
    ]
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
    t = simulate(schedule, fwd, bwd, m, pp, p2p=0.05)
    assert list(t.rows) == _torch_rows(schedule, pp, m)
    # the durations: a stage's backward runs whole at the input-gradient action and the
    # weight-gradient action is empty, so each rank is busy m * (f + b) per stage it holds
    # (and DualPipeV's overlapped forward+backward runs one after the other)
    ranks = stage_ranks(schedule, pp)
    busy = [m * sum(fwd[s] + bwd[s] for s in range(n) if ranks[s] == r) for r in range(pp)]
    assert (1 - t.bubble) * t.step_time == pytest.approx(max(busy))
    assert t.step_time >= max(busy) + (fwd[0] + bwd[0])  # the first stage waits on the rest


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
    with pytest.raises(ValueError, match="autopar.plan"):
        autopar.compile(
            model, batch, cluster=Cluster.preset("cpu", mesh=(4,)), pipeline_stages="auto"
        )
