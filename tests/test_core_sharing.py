"""A pipeline's stages on processes sharing CPU cores (`search.core_sharing`): a rank whose
stage takes longer gets the cores the others leave while they wait or idle, never more
than one core; nothing changes where each process had a core of its own."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from autopar.search.core_sharing import shared_core_factors, stage_compute
from autopar.search.inter_op import price_schedule


def test_processes_with_a_core_each_keep_their_prices() -> None:
    assert shared_core_factors([0.08, 0.05], [0.08, 0.03], [0, 1], {0: 2, 1: 2}, 1.0) == [1, 1]


def test_ranks_alike_that_never_wait_keep_their_prices() -> None:
    factors = shared_core_factors([0.06, 0.06], [0.06, 0.06], [0, 1], {0: 2, 1: 2}, 0.5)
    assert factors == [1.0, 1.0]


def test_the_longer_stage_takes_the_cores_the_waiting_one_leaves() -> None:
    """GPT small's dp | tp pipeline on 4 processes, 2 cores: the dp stage computes 80 ms (at
    the shared rate), the tp stage 34 and waits 20 in its all-reduces. A period does 2 x 40
    + 2 x 17 ms of one core's work on 2 cores: 57 ms; the dp stage's compute fits it, the
    tp stage (54 ms) keeps its price."""
    factors = shared_core_factors([0.080, 0.054], [0.080, 0.034], [0, 1], {0: 2, 1: 2}, 0.5)
    assert factors[0] == pytest.approx(0.057 / 0.080)
    assert factors[1] == 1.0


def test_no_process_computes_faster_than_one_core() -> None:
    """A rank alone computing (the other only waits) runs at one core: its compute at the
    shared rate of 1/2 halves, no more."""
    factors = shared_core_factors([0.080, 0.010], [0.080, 0.0], [0, 1], {0: 2, 1: 2}, 0.5)
    assert factors == [pytest.approx(0.5), 1.0]


def test_sharing_never_slows_a_stage_nor_beats_one_core() -> None:
    rng = random.Random(0)
    for _ in range(200):
        stages, pp = rng.randint(1, 6), rng.randint(1, 3)
        ranks = [s % pp for s in range(stages)]
        compute = [rng.uniform(0.0, 0.1) for _ in range(stages)]
        times = [k + rng.choice([0.0, rng.uniform(0.0, 0.05)]) for k in compute]
        processes = {r: rng.randint(1, 4) for r in range(pp)}
        share = rng.uniform(0.1, 1.0)
        for f in shared_core_factors(times, compute, ranks, processes, share):
            assert share - 1e-12 <= f <= 1.0


def test_a_stage_without_program_parts_is_all_compute() -> None:
    from autopar.search.layer_costs import PartCost
    from autopar.search.step import Part

    assert stage_compute(PartCost(time=0.3), 0.3) == 0.3
    stage = PartCost(time=0.3, program=(Part(forward=0.05, backward=0.1, weight=2.0),))
    assert stage_compute(stage, 0.4) == pytest.approx(0.3)


def test_a_pipeline_on_shared_cores_prices_its_slower_rank_faster() -> None:
    """Rank 1's layers twice as slow, cut so that rank 0 takes three of four (its stage
    still the longer): on processes sharing cores (`core_share` 1/2) the longer stage
    speeds up with the cores the other rank leaves, which keeps its price, so the step is
    shorter; ranks alike that wait (their layers' gathers) never slower than on cores of
    their own."""
    from tests.test_pipeline import _synthetic
    from tests.test_stage_meshes import _slower

    fast, cluster, _ = _synthetic([], layer_forward=1e-3)
    slow = _slower(fast, 2.0)
    shared = replace(cluster, device=replace(cluster.device, core_share=0.5))
    own = price_schedule((fast, slow), "1f1b", 2, 4, cluster)
    priced = price_schedule((fast, slow), "1f1b", 2, 4, shared)
    assert priced.cuts == own.cuts
    assert priced.step_time < own.step_time
    assert own.stage_times[0] > own.stage_times[1]
    assert priced.stage_times[1] == own.stage_times[1]  # the shorter stage keeps its price
    assert own.stage_times[1] <= priced.stage_times[0] < own.stage_times[0]
    alike = price_schedule((fast, fast), "1f1b", 2, 4, shared)
    assert alike.step_time <= price_schedule(fast, "1f1b", 2, 4, cluster).step_time
