"""Pipeline schedules priced by their timelines, in the order the runtime runs them.

`simulate(schedule, stage_times, microbatches, pp) -> Timeline`

Each stage s has forward time f[s] and backward time b[s] per microbatch. Each rank's
actions come in the order torch.distributed.pipelining executes them: for GPipe and 1F1B
the textbook orders (`_orders`: all forwards then all backwards; warm-up,
one-forward-one-backward, cool-down), for the multi-stage schedules the `pipeline_order`
of torch's own schedule object (`torch_order`). `replay` list-schedules those orders under
the dependencies F(s, m) after F(s-1, m) and the backward of (s, m) after F(s, m) and the
backward of (s+1, m), plus `p2p` seconds per crossing between ranks. Durations are what
the runtime runs: the zero-bubble schedules' input-gradient action I runs the stage's whole
backward and their weight-gradient action W is empty (the stage programs do not split the
backward), and DualPipeV's overlapped forward+backward runs its two halves back to back.
The result: step time, bubble fraction, and the peak number of microbatches whose
activations a rank holds at once (the in-flight memory multiplier).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from autopar._compat import pipeline_order
from autopar.plan import SCHEDULES, V_SHAPED, stage_ranks


@dataclass(frozen=True, slots=True)
class Timeline:
    step_time: float
    bubble: float  # idle fraction of the busiest rank
    in_flight: tuple[int, ...]  # per rank: peak microbatches with saved activations
    rows: tuple[str, ...]  # text timeline per rank


def _orders(schedule: str, pp: int, m: int) -> list[list[tuple[str, int, int]]]:
    """Per pipeline rank, its actions ("F"|"B", stage, microbatch) in execution order."""
    ranks = stage_ranks(schedule, pp)
    orders = []
    for rank in range(pp):
        stages = [s for s, r in enumerate(ranks) if r == rank]
        if schedule == "gpipe":
            st = stages[0]
            orders.append([("F", st, i) for i in range(m)] + [("B", st, i) for i in range(m)])
            continue
        # microbatches in rounds of pp, each round through the rank's stages in order
        # (Megatron's interleaving); backward visits the stages in reverse
        fwd = [
            (st, i) for r0 in range(0, m, pp) for st in stages for i in range(r0, min(r0 + pp, m))
        ]
        bwd = [
            (st, i)
            for r0 in range(0, m, pp)
            for st in reversed(stages)
            for i in range(r0, min(r0 + pp, m))
        ]
        warmup = (pp - rank - 1) + (len(stages) - 1) * pp + 1
        if schedule in V_SHAPED:
            warmup = 2 * (pp - rank) - 1
        warmup = min(warmup, len(fwd))
        order = [("F", *a) for a in fwd[:warmup]]
        rest = fwd[warmup:]
        for k, b in enumerate(bwd):
            order.append(("B", *b))
            if k < len(rest):
                order.append(("F", *rest[k]))
        orders.append(order)
    return orders


ZERO_BUBBLE = {"interleavedzb", "zbv", "dualpipev"}

# torch.distributed.pipelining's class for each schedule of the plan's vocabulary (the
# runtime builds these; the multi-stage ones are priced by replaying their own order)
TORCH_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved1f1b": "ScheduleInterleaved1F1B",
    "interleavedzb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def simulate(
    schedule: str, fwd: list[float], bwd: list[float], microbatches: int, pp: int, p2p: float = 0.0
) -> Timeline:
    """List-schedule the actions; `fwd`/`bwd`: per stage, seconds per microbatch."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule '{schedule}'; choose from {sorted(SCHEDULES)}")
    if SCHEDULES[schedule] == 1:
        orders = [[(k, s, i) for k, s, i in o] for o in _orders(schedule, pp, microbatches)]
    else:
        orders = [[a for step in o for a in step] for o in torch_order(schedule, pp, microbatches)]
    return replay(orders, fwd, bwd, stage_ranks(schedule, pp), p2p, schedule)


def torch_order(schedule: str, pp: int, microbatches: int) -> list[list[tuple]]:
    """Per rank, the steps torch's schedule object runs (each a tuple of (kind, stage,
    microbatch) actions run back to back; DualPipeV's overlapped forward+backward is one
    step of two). Raises ValueError where torch rejects the microbatch count."""
    try:
        return _torch_order(schedule, pp, microbatches)
    except ValueError as exc:
        raise ValueError(
            f"{schedule} cannot run {microbatches} microbatches on {pp} pipeline ranks "
            f"({exc}): choose another microbatch count or schedule"
        ) from None


@functools.lru_cache(maxsize=256)
def _torch_order(schedule: str, pp: int, microbatches: int) -> list[list[tuple]]:
    ranks = stage_ranks(schedule, pp)
    stages_of = [[s for s, r in enumerate(ranks) if r == rank] for rank in range(pp)]
    return pipeline_order(TORCH_CLASSES[schedule], pp, stages_of, microbatches)


def replay(
    orders: list[list[tuple[str, int, int]]],
    fwd: list[float],
    bwd: list[float],
    owner: list[int],
    p2p: float = 0.0,
    schedule: str = "",
) -> Timeline:
    """Each rank runs its actions in order, each starting once the rank is free and its
    inputs exist (F(s, m) after F(s-1, m); the backward of (s, m) after F(s, m) and the
    backward of (s+1, m); W after I), plus `p2p` per crossing between ranks. Durations as
    the runtime runs them: F = fwd, B = bwd, and for the zero-bubble actions I = bwd (a
    stage program's backward yields input and weight gradients together, so the input
    action runs it whole) and W = 0. Activations are held from F until the backward."""
    num, pp = len(fwd), len(orders)
    cost = {"F": fwd, "B": bwd, "I": bwd, "W": [0.0] * num}
    done: dict[tuple[str, int, int], float] = {}
    clock, busy = [0.0] * pp, [0.0] * pp
    held, peak = [0] * pp, [0] * pp
    rows: list[list[str]] = [[] for _ in range(pp)]
    at = [0] * pp
    while any(at[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for rank in range(pp):
            while at[rank] < len(orders[rank]):
                kind, s, i = orders[rank][at[rank]]
                deps = _deps(kind, s, i, num)
                if any(d not in done for d in deps):
                    break
                start = max(
                    [clock[rank]]
                    + [done[d] + (p2p if owner[d[1]] != owner[s] else 0.0) for d in deps]
                )
                clock[rank] = start + cost[kind][s]
                done[("G" if kind in "IB" else kind, s, i)] = clock[rank]
                busy[rank] += cost[kind][s]
                held[rank] += {"F": 1, "B": -1, "I": -1, "W": 0}[kind]
                peak[rank] = max(peak[rank], held[rank])
                rows[rank].append(f"{kind}{s}.{i}")
                at[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {schedule} deadlocks on {pp} ranks")
    total = max(clock)
    bubble = 1.0 - max(busy) / total if total else 0.0
    return Timeline(total, bubble, tuple(peak), tuple(" ".join(r) for r in rows))


def _deps(kind: str, s: int, i: int, num: int) -> list[tuple[str, int, int]]:
    if kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if kind == "W":
        return [("G", s, i)]
    return [("F", s, i)] + ([("G", s + 1, i)] if s < num - 1 else [])
