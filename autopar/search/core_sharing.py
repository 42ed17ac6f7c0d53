"""A pipeline's stages on processes that share CPU cores: one computes faster while another waits.

A calibrated CPU host with more processes than cores (`DeviceSpec.core_share` < 1: each
process had that share of a core while its rates were measured, every process computing)
prices a rank's compute at that shared rate. That holds where every rank computes at
once (a data- or tensor-parallel step, a pipeline of like stages). A pipeline whose stages
differ does not: a stage whose ranks wait in their collectives or for their inputs leaves
its cores to the others (4 gloo processes on 2 cores, GPT small, pipeline ranks on dp 2 x 1
and 1 x 2 stage meshes: the dp stage's ranks ran at 63% of a core each, the tp stage's at
33%, where each was priced at 50%, and the dp stage's actions took ~52 ms where they were
priced 80).

In the steady state of a schedule every pipeline rank runs one microbatch's actions per
period ``T``. A rank's compute at one core's speed is ``w = compute * core_share`` (its
priced compute, the stage programs' forward and backward kernels, at the shared rate);
the rest of its actions' time, ``c``, it waits (in its collectives, for its activations),
blocked, leaving its cores to the others (the tp stage's ranks above). The host's cores
do every process's compute in a period, and no process computes faster than one core:

    T = max(sum over processes of w / cores, max over ranks of (w + c))

A rank whose priced actions take longer than ``T`` has its compute scaled so that they
take ``T``; a rank within ``T`` keeps its price. Ranks alike that never wait keep theirs
(``T`` is their compute); warm-up and cool-down, where fewer ranks run, stay at the shared
rate (a bound on what they gain).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from autopar.search.layer_costs import PartCost


def stage_compute(stage: PartCost, seconds: float) -> float:
    """Of a microbatch's `seconds` on `stage`, its compute (the programs' forward and
    backward kernels); all of it where the stage has no program parts."""
    if not stage.program:
        return seconds
    return min(seconds, sum((p.forward + p.backward) * p.weight for p in stage.program))


def shared_core_factors(
    times: Sequence[float],
    compute: Sequence[float],
    ranks: Sequence[int],
    processes: Mapping[int, int],
    share: float,
) -> list[float]:
    """Per stage, the factor its compute is scaled by (module docstring): `times` each
    stage's seconds per microbatch, `compute` the compute in them, `ranks` its pipeline
    rank, `processes` per pipeline rank the processes of its stage mesh, `share` the
    device's `core_share`. All 1 where processes had a core each."""
    if share >= 1:
        return [1.0] * len(times)
    compute_of: dict[int, float] = {}
    waits: dict[int, float] = {}
    for t, k, r in zip(times, compute, ranks, strict=True):
        compute_of[r] = compute_of.get(r, 0.0) + k
        waits[r] = waits.get(r, 0.0) + max(0.0, t - k)
    # sum of w / cores, with w = compute * share and cores = share * processes: the mean
    procs = sum(processes[r] for r in compute_of)
    period = max(
        sum(processes[r] * k for r, k in compute_of.items()) / procs,
        max(k * share + waits[r] for r, k in compute_of.items()),
    )
    return [
        (period - waits[r]) / compute_of[r]
        if compute_of[r] > 0 and compute_of[r] + waits[r] > period
        else 1.0
        for r in ranks
    ]
